"""The tokenizer of a ``data.tokenizer`` value (:func:`get_tokenizer`), and training one on a
corpus's train split (``data.tokenizer=spm:N`` / ``bpe:N``).

As flax's lm1b example does, a run with no tokenizer file trains one on its own training data,
so nothing is downloaded. Two kinds, each the open-source counterpart of a paper tokenizer:

* ``spm`` -- SentencePiece BPE with byte fallback, identity normalization and split digits,
  the settings of the LLaMA tokenizer (32000 in the GaLore/PLUMAGE configs). Newlines and
  every other character survive ``decode(encode(text))``.
* ``bpe`` -- a ``tokenizers`` byte-level BPE with ``<|endoftext|>``, as GPT-2's (50257, padded
  to 50304 in the GIFT configs).

Bounded: the model is trained on the first ``max_chars`` characters of the train split, in
record order (:func:`training_texts`; a whole corpus such as C4 is never read for it).
Deterministic: one thread, no input sampling or shuffling, so the same corpus prefix gives the
same model file byte for byte. Cached: :func:`trained_tokenizer` writes the model once under
``cache_dir`` (next to the prepared data), named by corpus, kind, vocabulary and ``max_chars``
(:func:`trained_path`, local or ``gs://``); process 0 of a job trains it while the others wait
(:func:`gift_jax.data.storage.cached`), and later runs reuse it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from collections.abc import Iterator

from gift_jax.data.errors import DataError
from gift_jax.data.storage import cached
from gift_jax.data.tokenizer import (
    TOKENIZER_HELP,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer_file,
    parse_tokenizer,
    require_package,
)

log = logging.getLogger(__name__)

#: Characters of the train split a tokenizer is trained on (about 20 MB of text).
MAX_TRAIN_CHARS = 20_000_000
#: Bump when the training settings change, so cached models are not reused across versions.
TRAINER_VERSION = 1
#: SentencePiece skips training lines longer than this many bytes.
_MAX_LINE_BYTES = 16384
_CHUNK_DOCS = 256


def training_texts(source, max_chars: int = MAX_TRAIN_CHARS, split: str = "train"
                   ) -> Iterator[str]:
    """The documents of ``split`` in record order, cut off after ``max_chars`` characters.

    Args:
      source: a byte-level :class:`~gift_jax.data.source.TokenSource`.
      max_chars: the total number of characters to yield.
      split: the split to read.

    Yields:
      Each document decoded as UTF-8 (invalid bytes replaced), the last one truncated so that
      the total is at most ``max_chars``; documents are read 256 at a time.

    Raises:
      DataError: ``split`` is not a split of ``source``.
    """
    left = max_chars
    n = source.num_docs(split)
    for lo in range(0, n, _CHUNK_DOCS):
        for doc in source.documents(split, lo, min(n, lo + _CHUNK_DOCS)):
            text = doc.decode("utf-8", errors="replace")[:left]
            left -= len(text)
            yield text
            if left <= 0:
                return


def train_sentencepiece(texts: Iterator[str], vocab_size: int) -> bytes:
    """The ``.model`` bytes of a LLaMA-style SentencePiece BPE of ``vocab_size`` pieces.

    Lines (with their newline) are the training sentences; ``<unk>``, ``<s>``, ``</s>`` are
    ids 0, 1, 2 and the 256 byte pieces follow.

    Args:
      texts: the training documents (:func:`training_texts`); blank lines are skipped, lines
        longer than 16384 bytes are skipped by SentencePiece.
      vocab_size: the number of pieces.

    Returns:
      The serialized model (the contents of a ``.model`` file).

    Raises:
      DataError: ``sentencepiece`` is not installed, or training failed (e.g. ``vocab_size``
        too large for the text; the message carries SentencePiece's last line).
    """
    spm = require_package("sentencepiece", f"spm:{vocab_size}")
    lines = (line for text in texts for line in text.splitlines(keepends=True) if line.strip())
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_writer=model, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True, character_coverage=0.9995,
            max_sentence_length=_MAX_LINE_BYTES, input_sentence_size=0,
            shuffle_input_sentence=False, num_threads=1, minloglevel=2,
        )
    except RuntimeError as e:  # e.g. "Vocabulary size too high (32000) ... <= 21048"
        raise DataError(f"data.tokenizer=spm:{vocab_size}: SentencePiece training failed: "
                        f"{str(e).splitlines()[-1]}") from None
    return model.getvalue()


def train_bpe(texts: Iterator[str], vocab_size: int) -> str:
    """The ``tokenizer.json`` text of a GPT-2-style byte-level BPE of exactly ``vocab_size``
    ids (the 256 bytes, ``<|endoftext|>`` and merges); a corpus too small for that many
    merges raises :class:`DataError` with the size it supports.

    Args:
      texts: the training documents (:func:`training_texts`).
      vocab_size: the number of ids, special token included.

    Returns:
      The tokenizer's JSON (the contents of a ``tokenizer.json`` file).

    Raises:
      DataError: ``tokenizers`` is not installed, or training yields another number of ids.
    """
    tokenizers = require_package("tokenizers", f"bpe:{vocab_size}")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise DataError(
            f"data.tokenizer=bpe:{vocab_size}: the training text yields only {got} BPE ids; "
            f"use bpe:{got} (or fewer) or a larger corpus"
        )
    return tok.to_str()


def trained_path(cache_dir: str, corpus: str, kind: str, vocab_size: int,
                 max_chars: int = MAX_TRAIN_CHARS) -> str:
    """Where the ``kind`` (``spm``/``bpe``) tokenizer of ``corpus`` is cached.

    Args:
      cache_dir: the corpus's artifact directory (local or ``gs://``).
      corpus: the corpus's name (``source.name``).
      kind: ``"spm"`` or ``"bpe"``.
      vocab_size: the number of ids.
      max_chars: the training text's length in characters.

    Returns:
      ``cache_dir/<kind>_<vocab_size>_<hash>.model`` (``spm``) or ``...tokenizer.json``
      (``bpe``), the hash being 12 hex digits of the SHA-1 of ``corpus``, ``kind``,
      ``vocab_size``, ``max_chars`` and :data:`TRAINER_VERSION`.
    """
    key = f"{corpus}|{kind}|{vocab_size}|{max_chars}|v{TRAINER_VERSION}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    suffix = ".model" if kind == "spm" else ".tokenizer.json"
    return os.path.join(cache_dir, f"{kind}_{vocab_size}_{digest}{suffix}")


def trained_tokenizer(source, kind: str, vocab_size: int, cache_dir: str,
                      max_chars: int = MAX_TRAIN_CHARS) -> Tokenizer:
    """The ``spm``/``bpe`` tokenizer of ``vocab_size`` ids trained on ``source``'s train split,
    loaded from ``cache_dir`` or trained once and written there.

    Args:
      source: a byte-level :class:`~gift_jax.data.source.TokenSource`.
      kind: ``"spm"`` (:func:`train_sentencepiece`) or ``"bpe"`` (:func:`train_bpe`).
      vocab_size: the number of ids.
      cache_dir: where the model is cached (:func:`trained_path`).
      max_chars: characters of the train split to train on (:func:`training_texts`).

    Returns:
      A :class:`~gift_jax.data.tokenizer.SentencePieceTokenizer` or
      :class:`~gift_jax.data.tokenizer.HFTokenizer`.

    Raises:
      DataError: training failed, a package is missing, or the cache cannot be written.
    """
    path = trained_path(cache_dir, source.name, kind, vocab_size, max_chars)

    def train(tmp) -> None:
        log.info("training a %s tokenizer of %d ids on %s/train", kind, vocab_size, source.name)
        texts = training_texts(source, max_chars)
        if kind == "spm":
            tmp.write_bytes(train_sentencepiece(texts, vocab_size))
        else:
            tmp.write_bytes(train_bpe(texts, vocab_size).encode("utf-8"))

    path = str(cached(path, train, f"the {kind}:{vocab_size} tokenizer"))
    if kind == "spm":
        return SentencePieceTokenizer.from_file(path)
    return HFTokenizer.from_file(path)


def get_tokenizer(setting: str, source=None, cache_dir: str | None = None, *,
                  max_chars: int | None = None) -> Tokenizer:
    """The tokenizer of a ``data.tokenizer`` value.

    ``spm:N`` / ``bpe:N`` train on ``source``'s train split (at most ``max_chars`` characters,
    default :data:`MAX_TRAIN_CHARS`) and cache the model under
    ``cache_dir``; the other forms need neither. Bad values raise :class:`DataError`.

    Args:
      setting: a ``data.tokenizer`` value (see :data:`~gift_jax.data.tokenizer.TOKENIZER_HELP`).
      source: the byte-level corpus to train on (``spm:N`` / ``bpe:N`` only).
      cache_dir: where trained models are cached (``spm:N`` / ``bpe:N`` only; usually
        :func:`gift_jax.data.source.artifact_dir`).
      max_chars: training characters; ``None``: :data:`MAX_TRAIN_CHARS`.

    Returns:
      A :class:`~gift_jax.data.tokenizer.Tokenizer`.

    Raises:
      DataError: an unsupported value, a missing or invalid tokenizer file, ``spm:N`` /
        ``bpe:N`` without ``source`` or ``cache_dir``, or a failed training.
    """
    spec = parse_tokenizer(setting)
    if spec is None:
        raise DataError(f"data.tokenizer={setting!r} is not supported; allowed: {TOKENIZER_HELP}")
    if spec.kind == "byte":
        return ByteTokenizer()
    if spec.path is not None:
        return load_tokenizer_file(spec)
    if source is None or cache_dir is None:
        raise DataError(f"data.tokenizer={setting!r} is trained on a corpus: pass its source "
                        "and a cache directory")
    limit = MAX_TRAIN_CHARS if max_chars is None else max_chars
    return trained_tokenizer(source, spec.kind, spec.vocab, cache_dir, limit)
