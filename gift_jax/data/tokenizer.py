"""Tokenizers (text -> int32 ids) and the ``data.tokenizer`` setting that picks one.

``data.tokenizer`` (``--tokenizer`` of ``scripts/train.py``) takes one of:

* ``byte`` (the default) -- :class:`ByteTokenizer`: the UTF-8 bytes of the text (vocab 256,
  documents joined by NUL). Needs nothing installed.
* ``PATH.model`` -- a SentencePiece model file (:class:`SentencePieceTokenizer`), e.g. the
  T5 or LLaMA tokenizer a user already has on disk (``pip install sentencepiece``).
* ``PATH`` ending in ``tokenizer.json`` -- a Hugging Face ``tokenizers`` file
  (:class:`HFTokenizer`), e.g. GPT-2's (``pip install tokenizers``).
* ``spm:N`` / ``bpe:N`` -- a SentencePiece (LLaMA-style BPE with byte fallback) or a
  ``tokenizers`` byte-level BPE (GPT-2-style) model of exactly ``N`` ids, trained on the train
  split of the corpus and cached next to the prepared data
  (:mod:`gift_jax.data.train_tokenizer`), so no download is ever needed.

The model's ``model.vocab_size`` must be the tokenizer's vocabulary padded up to a multiple of
:data:`VOCAB_MULTIPLE` (as the paper configs pad GPT-2's 50257 to 50304):
:func:`vocab_mismatch` says what to set otherwise. Every tokenizer joins documents with one
``eos_id`` in the token stream (see :mod:`gift_jax.data.source`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Protocol

import numpy as np
from etils import epath

from gift_jax.data.errors import DataError
from gift_jax.data.storage import first_line

VOCAB_SIZE = 256
#: The byte that joins documents in a token stream. NUL never occurs in ordinary text.
SEPARATOR = 0
#: ``model.vocab_size`` is the tokenizer's vocabulary padded up to a multiple of this.
VOCAB_MULTIPLE = 128
#: Smallest ``N`` of ``spm:N`` / ``bpe:N``: the 256 byte pieces and the special tokens.
MIN_TRAINED_VOCAB = 260
TOKENIZER_HELP = (
    "'byte', a SentencePiece file PATH.model, a Hugging Face PATH/tokenizer.json, or 'spm:N' / "
    f"'bpe:N' (N >= {MIN_TRAINED_VOCAB}: trained on the train split)"
)
#: Token strings tried, in order, as the document separator of a ``tokenizer.json``.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer."""

    vocab_size: int  # ids lie in [0, vocab_size)
    eos_id: int  # joins documents in the token stream
    fingerprint: str  # identifies the model: the cache key of tokenized streams

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The int32 ids of each text, with no special tokens added.

        Args:
          texts: the documents.

        Returns:
          One 1-D ``int32`` array of ids in ``[0, vocab_size)`` per text.
        """
        ...

    def decode(self, ids) -> str:
        """The text of a sequence of ids.

        Args:
          ids: token ids (any integer array-like).

        Returns:
          The decoded text.
        """
        ...


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back.

    ``decode(encode(s)) == s`` for every string; decoding arbitrary ids replaces invalid UTF-8
    sequences with U+FFFD, so sampled model output always decodes.
    """

    vocab_size: int = VOCAB_SIZE
    separator: int = SEPARATOR
    eos_id: int = SEPARATOR
    fingerprint: str = "byte"

    def encode(self, text: str | bytes) -> np.ndarray:
        """Returns the int32 token ids of ``text`` (a ``str`` is UTF-8 encoded first).

        Args:
          text: a string, or its bytes.

        Returns:
          ``int32 [len(bytes)]``: one id in ``[0, 256)`` per byte.
        """
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text.

        Args:
          texts: the documents (``str`` or ``bytes``).

        Returns:
          One ``int32`` array of byte ids per text (see :meth:`encode`).
        """
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Returns the text of a sequence of ids in ``[0, 256)``.

        Args:
          ids: byte ids (any integer array-like).

        Returns:
          The bytes decoded as UTF-8, invalid sequences replaced by U+FFFD.

        Raises:
          ValueError: an id outside ``[0, 256)``.
        """
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
            raise ValueError(f"byte tokenizer ids must lie in [0, {VOCAB_SIZE}), got {arr}")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def require_package(module: str, spec: str):
    """Imports ``module``, or raises DataError naming the ``data.tokenizer`` that needs it.

    Args:
      module: the top-level module to import (``"sentencepiece"``, ``"tokenizers"``).
      spec: the ``data.tokenizer`` value (or file) that needs it, for the message.

    Returns:
      The imported module.

    Raises:
      DataError: ``module`` is not installed.
    """
    try:
        return __import__(module)
    except ImportError:
        raise DataError(
            f"data.tokenizer={spec!r} needs the package {module!r} (pip install {module}, or "
            "the 'data' extra of gift_jax)"
        ) from None


class SentencePieceTokenizer:
    """A SentencePiece model (``.model`` bytes); documents are joined by its ``</s>``."""

    def __init__(self, model_proto: bytes, name: str = "sentencepiece"):
        spm = require_package("sentencepiece", name)
        self._proto, self._name = model_proto, name
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except (RuntimeError, TypeError, ValueError) as e:
            raise DataError(f"data.tokenizer={name!r} is not a SentencePiece model: "
                            f"{first_line(e)}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.eos_id = int(self._sp.eos_id())
        if self.eos_id < 0:
            raise DataError(f"data.tokenizer={name!r}: the SentencePiece model has no </s> id")
        self.fingerprint = "spm-" + hashlib.sha1(model_proto).hexdigest()

    @classmethod
    def from_file(cls, path: str) -> SentencePieceTokenizer:
        """Loads a SentencePiece ``.model`` file.

        Args:
          path: the file (local or object storage); also the tokenizer's name in messages.

        Returns:
          The tokenizer.

        Raises:
          DataError: ``sentencepiece`` is missing, or the file is not a SentencePiece model (or
            has no ``</s>``).
        """
        return cls(epath.Path(path).read_bytes(), name=path)

    def __reduce__(self):  # data worker processes rebuild it from the model's bytes
        return SentencePieceTokenizer, (self._proto, self._name)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text (no BOS/EOS; SentencePiece encodes the batch in threads, each
        text independently, so the result does not depend on the thread count).

        Args:
          texts: the documents.

        Returns:
          One 1-D ``int32`` array of piece ids per text.
        """
        return [np.asarray(ids, np.int32) for ids in self._sp.encode(list(texts))]

    def decode(self, ids) -> str:
        """The text of a sequence of piece ids.

        Args:
          ids: piece ids (any integer array-like; flattened).

        Returns:
          The decoded text.
        """
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])


class HFTokenizer:
    """A Hugging Face ``tokenizers`` model (``tokenizer.json`` text); documents are joined by
    the first of :data:`EOS_TOKENS` in its vocabulary."""

    def __init__(self, json_text: str, name: str = "tokenizer.json"):
        tokenizers = require_package("tokenizers", name)
        self._json, self._name = json_text, name
        try:
            self._tok = tokenizers.Tokenizer.from_str(json_text)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(f"data.tokenizer={name!r} is not a Hugging Face tokenizer.json: "
                            f"{first_line(e)}") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        eos = next((t for t in EOS_TOKENS if t in vocab), None)
        if eos is None:
            raise DataError(
                f"data.tokenizer={name!r} has none of the end-of-text tokens {list(EOS_TOKENS)} "
                "that join documents"
            )
        self.eos_id = int(vocab[eos])
        self.fingerprint = "hf-" + hashlib.sha1(json_text.encode()).hexdigest()

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        """Loads a Hugging Face ``tokenizer.json`` file.

        Args:
          path: the file (local or object storage); also the tokenizer's name in messages.

        Returns:
          The tokenizer.

        Raises:
          DataError: ``tokenizers`` is missing, the file is not a ``tokenizer.json``, or its
            vocabulary has none of :data:`EOS_TOKENS`.
        """
        return cls(epath.Path(path).read_text(encoding="utf-8"), name=path)

    def __reduce__(self):  # data worker processes rebuild it from the file's text
        return HFTokenizer, (self._json, self._name)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text, without the post-processor's special tokens.

        Args:
          texts: the documents.

        Returns:
          One 1-D ``int32`` array of ids per text.
        """
        encoded = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in encoded]

    def decode(self, ids) -> str:
        """The text of a sequence of ids, special tokens kept.

        Args:
          ids: token ids (any integer array-like; flattened).

        Returns:
          The decoded text.
        """
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                skip_special_tokens=False)


# --- the data.tokenizer setting ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A parsed ``data.tokenizer``: ``kind`` is ``byte``, ``spm_file``, ``hf_file`` (``path``
    set) or ``spm``, ``bpe`` (trained; ``vocab`` set)."""

    kind: str
    path: str | None = None
    vocab: int | None = None


def parse_tokenizer(spec: str) -> TokenizerSpec | None:
    """The :class:`TokenizerSpec` of a ``data.tokenizer`` value, or ``None`` when it has none
    of the forms of :data:`TOKENIZER_HELP`. Reads nothing from disk.

    Args:
      spec: a ``data.tokenizer`` value (anything else than a non-empty string gives ``None``).

    Returns:
      ``byte``; ``spm``/``bpe`` with ``vocab=N`` (``N`` >= :data:`MIN_TRAINED_VOCAB`, else
      ``None``); ``spm_file`` (``*.model``) or ``hf_file`` (``*tokenizer.json``) with ``path``
      ``~``-expanded; or ``None``.
    """
    if not isinstance(spec, str) or not spec:
        return None
    if spec == "byte":
        return TokenizerSpec("byte")
    kind, sep, arg = spec.partition(":")
    if sep and kind in ("spm", "bpe"):
        if arg.isdigit() and int(arg) >= MIN_TRAINED_VOCAB:
            return TokenizerSpec(kind, vocab=int(arg))
        return None
    if spec.endswith(".model"):
        return TokenizerSpec("spm_file", path=os.path.expanduser(spec))
    if spec.endswith("tokenizer.json"):
        return TokenizerSpec("hf_file", path=os.path.expanduser(spec))
    return None


def load_tokenizer_file(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer of a ``spm_file`` / ``hf_file`` spec; a missing file raises DataError.

    Args:
      spec: a parsed spec with ``path`` set.

    Returns:
      A :class:`SentencePieceTokenizer` (``spm_file``) or an :class:`HFTokenizer` (``hf_file``).

    Raises:
      DataError: the file is missing or unreadable, its package is not installed, or it is not
        a valid model of its kind.
    """
    if not epath.Path(spec.path).is_file():
        raise DataError(f"data.tokenizer={spec.path!r}: no such file")
    try:
        if spec.kind == "spm_file":
            return SentencePieceTokenizer.from_file(spec.path)
        return HFTokenizer.from_file(spec.path)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.tokenizer={spec.path!r} cannot be read: {first_line(e)}"
                        ) from None


def tokenizer_vocab_size(setting: str) -> int:
    """The vocabulary of a ``data.tokenizer`` value, known without training or preparing
    anything: 256, the ``N`` of ``spm:N`` / ``bpe:N``, or the size of the file's model.

    Args:
      setting: a ``data.tokenizer`` value (a file is loaded to read its size).

    Returns:
      The number of ids (unpadded).

    Raises:
      DataError: an unsupported value, or a file that cannot be loaded.
    """
    spec = parse_tokenizer(setting)
    if spec is None:
        raise DataError(f"data.tokenizer={setting!r} is not supported; allowed: {TOKENIZER_HELP}")
    if spec.kind == "byte":
        return VOCAB_SIZE
    if spec.vocab is not None:
        return spec.vocab
    return load_tokenizer_file(spec).vocab_size


def padded_vocab_size(vocab: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (50257 -> 50304, 32000 -> 32000).

    Args:
      vocab: a tokenizer's vocabulary size.
      multiple: the padding multiple (:data:`VOCAB_MULTIPLE`).

    Returns:
      The smallest multiple of ``multiple`` that is >= ``vocab``.
    """
    return -(-vocab // multiple) * multiple


def vocab_mismatch(model_vocab: int, setting: str) -> str | None:
    """``None`` when ``model.vocab_size`` is the padded vocabulary of tokenizer ``setting``,
    else one line naming both numbers and the two fixes.

    Args:
      model_vocab: ``model.vocab_size``.
      setting: a ``data.tokenizer`` value.

    Returns:
      ``None`` when ``model_vocab`` equals :func:`padded_vocab_size` of the tokenizer's
      vocabulary, else the message.

    Raises:
      DataError: an unsupported ``setting``, or a tokenizer file that cannot be loaded.
    """
    vocab = tokenizer_vocab_size(setting)
    padded = padded_vocab_size(vocab)
    if model_vocab == padded:
        return None
    other = "a tokenizer of that vocabulary"
    if model_vocab >= MIN_TRAINED_VOCAB:
        other = f"a tokenizer of {model_vocab} ids, e.g. --config.data.tokenizer=spm:{model_vocab}"
    return (
        f"model.vocab_size={model_vocab} does not match data.tokenizer={setting!r}, whose "
        f"vocabulary is {vocab} ids ({padded} padded to a multiple of {VOCAB_MULTIPLE}); set "
        f"--config.model.vocab_size={padded}, or use {other}"
    )
