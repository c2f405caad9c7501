"""The streaming pipeline (gift_jax.data.stream, data.pipeline='stream'): batches that depend
on neither the worker nor the process count, disjoint per-process documents that make up the
global batch, exact resume from a saved state, no pass over the split before the first batch,
bad input as one line, and bit-exact trainer resume."""

import copy
import json
import os
import runpy
import signal
from collections.abc import Sequence

import numpy as np
import pytest

from gift_jax.data import DataError, TokenizedSource, TokenSource, get_tokenizer, stream_batches
from gift_jax.data.id_cache import ShardedIds, cache_folder
from gift_jax.data.stream import CHUNK_DOCS, LaneLayout, global_state

pytest.importorskip("grain")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORDS = "thou art the king of all this land and i the fool who follows thee".split()


def _docs(n=300, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(_WORDS, int(rng.integers(1, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus():
    docs = _docs()
    return TokenSource({"train": docs[20:], "validation": docs[:20]}, name="toy")


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(xs, ys) -> bool:
    return all((x == y).all() for x, y in zip(xs, ys, strict=True))


def test_batches_depend_on_neither_workers_nor_processes(corpus, tmp_path):
    pytest.importorskip("sentencepiece")
    source = TokenizedSource(corpus, get_tokenizer("spm:300", corpus, str(tmp_path)))
    kw = dict(global_batch=8, seq_len=16, seed=5)
    ref = _take(stream_batches(source, "train", **kw), 12)
    assert ref[0].shape == (8, 17) and ref[0].dtype == np.int32
    assert ref[0].max() < 300 and not _same(ref[:-1], ref[1:])
    # the SentencePiece model is pickled into two worker processes
    assert _same(ref, _take(stream_batches(source, "train", workers=2, **kw), 12))
    halves = [_take(stream_batches(source, "train", process_index=p, process_count=2, **kw), 12)
              for p in range(2)]
    assert _same([np.concatenate(rows) for rows in zip(*halves, strict=True)], ref)
    # each process reads its own documents: disjoint positions, together every position
    reads = [{LaneLayout(8, 4 * p, 4).position(i) for i in range(400)} for p in range(2)]
    assert not reads[0] & reads[1] and reads[0] | reads[1] == set(range(800))
    other_seed = _take(stream_batches(source, "train", global_batch=8, seq_len=16, seed=6), 1)
    assert not (other_seed[0] == ref[0]).all()


def test_resume_from_a_saved_state_is_exact(corpus):
    kw = dict(global_batch=6, seq_len=40, seed=1)
    ref = _take(stream_batches(corpus, "train", **kw), 30)  # several epochs of 280 documents
    it = stream_batches(corpus, "train", **kw)
    _take(it, 13)
    saved = json.dumps(global_state([it.state()]))
    again = stream_batches(corpus, "train", state=saved, workers=1, **kw)
    assert global_state([again.state()]) == json.loads(saved)  # before it reads anything
    assert _same(_take(again, 17), ref[13:])
    # saved by 2 processes, resumed by 3: the state names global lanes
    parts = [stream_batches(corpus, "train", process_index=p, process_count=2, **kw)
             for p in range(2)]
    for part in parts:
        _take(part, 13)
    saved = global_state([part.state() for part in parts])
    assert saved == json.loads(json.dumps(global_state([it.state()])))
    thirds = [stream_batches(corpus, "train", process_index=p, process_count=3, state=saved,
                             **kw) for p in range(3)]
    assert _same([np.concatenate(rows) for rows in zip(*(_take(t, 5) for t in thirds),
                                                        strict=True)], ref[13:18])
    with pytest.raises(DataError, match="holds 6 lanes, this run reads 12"):
        stream_batches(corpus, "train", 12, 40, state=saved)


class _CountingRecords(Sequence):
    """A large split that counts the records read."""

    def __init__(self, n):
        self.n, self.read = n, set()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.add(int(i))
        return f"document {i} " * 5


def test_first_batch_reads_only_its_documents():
    records = _CountingRecords(1_000_000)
    source = TokenSource({"train": records}, name="large")
    batch = next(stream_batches(source, "train", 4, 64, seed=0))
    assert batch.shape == (4, 65)
    assert len(records.read) <= 4 * CHUNK_DOCS  # a few chunks, not the million documents


def test_documents_pack_into_lanes_empty_and_long_ones_included():
    # lane j of 2 takes positions j, j + 2, ...: lane 0 '', '', 'de', 'gh'; lane 1 'ab', 'c' *
    # 50, 'f', 'i'. Empty documents add nothing, a long one continues in the next window.
    docs = ["", "ab", "", "c" * 50, "de", "f", "gh", "i"]
    source = TokenSource({"validation": docs}, name="edge")
    rows = [r.astype(np.uint8).tobytes() for b in
            stream_batches(source, "validation", 2, 2, loop=False) for r in b]
    assert rows == [b"de\0", b"ab\0", b"gh\0", b"ccc"]
    with pytest.raises(DataError, match="too few tokens for one batch: every one of its 8 rows"):
        next(stream_batches(source, "validation", 8, 4, loop=False))


class _CachedOnly:
    """The tokenizer it wraps, but it refuses to tokenize: every id must come from the cache."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode_batch(self, texts):
        if texts:
            raise AssertionError(f"tokenized {len(texts)} documents despite the id cache")
        return []


def test_id_cache_fills_in_the_background_and_changes_no_batch(corpus, tmp_path):
    pytest.importorskip("sentencepiece")
    tokenizer = get_tokenizer("spm:300", corpus, str(tmp_path))
    source = TokenizedSource(corpus, tokenizer)
    kw = dict(global_batch=8, seq_len=16, seed=5)
    ref = _take(stream_batches(source, "train", **kw), 40)  # about two epochs
    cache_dir = str(tmp_path / "ids")
    it = stream_batches(source, "train", id_cache=cache_dir, shard_docs=32, **kw)
    assert _same(_take(it, 40), ref)  # while the builder process fills the cache
    it._builder.join(timeout=120)
    cache = ShardedIds(cache_folder(cache_dir, tokenizer, corpus, "train", 280),
                       np.uint16, 32)
    assert all(cache.complete(s) for s in range(9)) and not cache.complete(9)
    it.close()
    cached = TokenizedSource(corpus, _CachedOnly(tokenizer))
    again = stream_batches(cached, "train", id_cache=cache_dir, shard_docs=32, **kw)
    assert again._builder is None  # nothing left to build
    assert _same(_take(again, 40), ref)
    with pytest.raises(DataError, match=r"data\.id_cache='gs://b/ids' must be a local dir"):
        stream_batches(source, "train", id_cache="gs://b/ids", **kw)


class _Failing(Sequence):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        if i >= 200:
            raise OSError("disk went away")
        return "some text"


class _KilledInWorker(Sequence):
    """Reading document 200 in a worker process kills that process (SIGKILL: the OOM
    killer's signal), which no Python handler in the worker can report."""

    def __init__(self):
        self.parent = os.getpid()

    def __len__(self):
        return 1000

    def __getitem__(self, i):
        if i >= 200 and os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return "some text"


def test_worker_killed_by_a_signal_is_one_line():
    source = TokenSource({"train": _KilledInWorker()}, name="oom")
    it = stream_batches(source, "train", 2, 300, shuffle=False, workers=1)
    with pytest.raises(DataError) as err:
        _take(it, 20)
    message = str(err.value)
    assert "\n" not in message and "a data worker failed" in message, message
    assert "exit code -9" in message, message


def test_close_stops_the_workers_at_once_and_leaves_no_shared_memory(corpus):
    """Stopping a stream whose worker is still reading ahead ends the worker process now and
    leaves no shared-memory segment behind (grain puts each array a worker returns in a
    segment of its own; the chunks come back as one ``bytes`` instead)."""
    import multiprocessing
    import time

    def segments():  # Python's shared memory (grain's arrays): psm_* (other tests' locks vary)
        return ({n for n in os.listdir("/dev/shm") if n.startswith("psm_")}
                if os.path.isdir("/dev/shm") else set())

    before = segments()
    it = stream_batches(corpus, "train", 4, 8, workers=1)
    next(it)
    assert multiprocessing.active_children()
    start = time.perf_counter()
    it.close()
    assert time.perf_counter() - start < 10 and not multiprocessing.active_children()
    with pytest.raises(StopIteration):
        next(it)
    assert segments() <= before


@pytest.mark.parametrize("workers", [0, 1])
def test_failed_read_is_one_line(workers):
    source = TokenSource({"train": _Failing()}, name="flaky")
    it = stream_batches(source, "train", 2, 300, shuffle=False, workers=workers)
    with pytest.raises(Exception) as err:
        _take(it, 20)
    if workers:
        message = str(err.value)
        assert isinstance(err.value, DataError) and "\n" not in message, message
        assert "a data worker failed (OSError: disk went away)" in message, message
        assert "data.workers=0" in message
    else:
        assert "disk went away" in str(err.value)


@pytest.mark.parametrize("state, match", [
    ({"lanes": [[0, 0], [1, 2, 3], [0, 0], [0, 0]]}, r"lane 1 is \[1, 2, 3\]; expected"),
    ({"lanes": [[0, 0], [0, "5"], [0, 0], [0, 0]]}, r"lane 1 is \[0, '5'\]; expected"),
    ({"lanes": [[0, 0], [0, 0], [0, -1], [0, 0]]}, r"lane 2 is \[0, -1\]; expected"),
    ({"lanes": [7, [0, 0], [0, 0], [0, 0]]}, r"lane 0 is 7; expected"),
    ({"position": 3}, r"has no list of lanes; expected \{\"lanes\""),
    ("{not json", r"not valid JSON .*; expected"),
])
def test_malformed_state_is_a_data_error(corpus, state, match):
    with pytest.raises(DataError, match=match):
        stream_batches(corpus, "train", 4, 8, state=state)


@pytest.mark.parametrize("kw, match", [
    (dict(workers=-1), r"data.workers=-1 must be an int >= 0"),
    (dict(process_index=2, process_count=2), r"process_index=2 must lie in \[0, 2\)"),
    (dict(global_batch=3, process_count=2), "not divisible by process_count=2"),
])
def test_bad_settings_are_one_line(corpus, kw, match):
    args = dict(global_batch=4, seq_len=8) | kw
    with pytest.raises(DataError, match=match):
        stream_batches(corpus, "train", **args)


@pytest.mark.slow
def test_trainer_resumes_the_stream_bit_exactly(tmp_path):
    from gift_jax.training import train
    from gift_jax.training.config import complete_config, set_fields

    config = complete_config(runpy.run_path(os.path.join(ROOT, "configs", "tiny.py"))[
        "get_config"]())
    config = set_fields(config, {
        "data.pipeline": "stream", "data.workers": 0, "train.num_steps": 6,
        "train.checkpoint_every": 3, "train.eval_every": 0, "train.log_every": 3,
        "train.global_batch_size": 8, "train.seq_len": 32, "model.max_seq_len": 32,
        "optimizer.warmup_steps": 2})
    whole = train(config, str(tmp_path / "whole"), show_progress=False)
    train(config, str(tmp_path / "split"), stop_after=3, show_progress=False)
    meta = json.loads((tmp_path / "split" / "checkpoints" / "3" / "meta" / "metadata"
                       ).read_text())
    assert meta["data_state"] == {"lanes": [[0, 3 * 33]] * 8}  # 3 windows into each play
    resumed = train(config, str(tmp_path / "split"), resume=True, show_progress=False)
    import jax

    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_json_lines_are_one_record_each(tmp_path):
    """``text:DIR`` reads ``.jsonl`` / ``.json.gz`` files (allenai/c4's layout) as one record
    per line; a line that is not a JSON object with "text" is one line naming file and line."""
    import gzip

    from gift_jax.data import get_source

    corpus = tmp_path / "c4"
    corpus.mkdir()
    docs = [f"document {i} " * 3 for i in range(40)]
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:20]))
    with gzip.open(corpus / "b.json.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d, "url": "x"}) + "\n" for d in docs[20:]))
    source = get_source(f"text:{corpus}", str(tmp_path / "dd"))
    got = sorted(d.decode() for s in source.splits for d in source.documents(s))
    assert got == sorted(docs)
    (corpus / "c.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"c.jsonl line 2 is not a JSON object with a \"text\""):
        get_source(f"text:{tmp_path / 'c4'}", str(tmp_path / "dd2"))


@pytest.mark.slow
def test_a_stream_checkpoint_of_a_small_corpus_resumes_with_the_stream_under_auto(tmp_path):
    """A run of a small ``text:DIR`` corpus with an explicit ``stream``, stopped at step 3,
    resumes under the default ``auto`` with the stream (the checkpoint's pipeline, not the grid
    that ``auto`` takes for a small corpus), bit for bit the uninterrupted stream run; the same
    config in a new workdir takes the grid."""
    from gift_jax.training import train
    from gift_jax.training.config import complete_config, set_fields

    text = tmp_path / "corpus"
    text.mkdir()
    for i, doc in enumerate(_docs(60, seed=3)):
        (text / f"doc{i:03d}.txt").write_text(doc)
    data = dict(data=f"text:{text}", data_dir=str(tmp_path / "dd"), show_progress=False)
    config = set_fields(complete_config(runpy.run_path(os.path.join(
        ROOT, "configs", "tiny.py"))["get_config"]()), {
        "data.workers": 0, "train.num_steps": 6, "train.checkpoint_every": 3,
        "train.eval_every": 0, "train.log_every": 3, "train.global_batch_size": 8,
        "train.seq_len": 32, "model.max_seq_len": 32, "optimizer.warmup_steps": 2})
    assert config.data.pipeline == "auto"
    stream = set_fields(copy.deepcopy(config), {"data.pipeline": "stream"})
    whole = train(stream, str(tmp_path / "whole"), **data)
    train(stream, str(tmp_path / "split"), stop_after=3, **data)
    resumed = train(config, str(tmp_path / "split"), resume=True, **data)
    import jax

    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    meta = json.loads((tmp_path / "split" / "checkpoints" / "6" / "meta" / "metadata"
                       ).read_text())
    assert json.loads(meta["config"])["data.pipeline"] == "stream"
    fresh = train(config, str(tmp_path / "fresh"), stop_after=3, **data)
    meta = json.loads((tmp_path / "fresh" / "checkpoints" / "3" / "meta" / "metadata"
                       ).read_text())
    assert json.loads(meta["config"])["data.pipeline"] == "grid" and fresh.step == 3
