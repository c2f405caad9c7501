"""Token streams of a subword tokenizer, tokenized once and read as a memory map.

A :class:`TokenizedSource` has the interface of :class:`gift_jax.data.source.TokenSource`
(``splits``, ``num_tokens``, ``read``, ``vocab_size``), so :func:`gift_jax.data.batch_iterator`
batches it unchanged. The token stream of a split is each document's ids followed by the
tokenizer's ``eos_id``, in record order::

    ids(doc_0) EOS ids(doc_1) EOS ... ids(doc_{n-1}) EOS

Why tokenize once, up front: the batch scheme reads windows at arbitrary stream positions, so
every document's token count must be known anyway; tokenizing on the fly would also cost
subword-tokenizer time on every step (measure both with ``scripts/bench_data.py``). The first
use of a split makes one pass over its documents and writes the stream (``uint16`` ids when the
vocabulary fits, else ``int32``) to ``cache_dir/tokens-<tokenizer fingerprint>/``; later runs,
resumed runs and the other processes of a job map that file. Batch ``k`` therefore depends only
on the corpus, the tokenizer model (its fingerprint is the hash of the model file) and
``(seed, k)``.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from gift_jax.data.storage import cached, is_remote
from gift_jax.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CHUNK_DOCS = 512


def stream_dtype(vocab_size: int) -> np.dtype:
    """The narrowest stored dtype of ids below ``vocab_size``.

    Args:
      vocab_size: the tokenizer's number of ids.

    Returns:
      ``uint16`` when ``vocab_size`` <= 65536, else ``int32``.
    """
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def tokenize_split(source, split: str, tokenizer: Tokenizer, out) -> int:
    """Writes the token stream of ``split`` to the binary file ``out`` (see the module doc) in
    chunks of documents; returns its length in tokens.

    Args:
      source: a byte-level :class:`~gift_jax.data.source.TokenSource` (its documents are
        read 512 at a time).
      split: the split to tokenize.
      tokenizer: the tokenizer; every document, empty ones included, is followed by its
        ``eos_id``.
      out: a writable binary file; receives the raw ids in :func:`stream_dtype` of the
        vocabulary, native byte order, no header.

    Returns:
      The number of tokens written.

    Raises:
      DataError: ``split`` is not a split of ``source``.
    """
    dtype = stream_dtype(tokenizer.vocab_size)
    eos = np.asarray([tokenizer.eos_id], dtype)
    n, total = source.num_docs(split), 0
    for lo in range(0, n, _CHUNK_DOCS):
        docs = source.documents(split, lo, min(n, lo + _CHUNK_DOCS))
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        pieces = []
        for ids in tokenizer.encode_batch(texts):
            pieces += [ids.astype(dtype), eos]
        chunk = np.concatenate(pieces)
        out.write(chunk.tobytes())
        total += chunk.size
        if lo and lo % (200 * _CHUNK_DOCS) == 0:
            log.info("%s/%s: tokenized %d of %d documents", source.name, split, lo, n)
    return total


class TokenizedSource:
    """Random access to the token streams of ``source`` under ``tokenizer``.

    Args:
      source: a :class:`~gift_jax.data.source.TokenSource` (its documents are read once).
      tokenizer: any :class:`~gift_jax.data.tokenizer.Tokenizer`.
      cache_dir: where streams are written and mapped; ``None`` keeps them in memory.
    """

    def __init__(self, source, tokenizer: Tokenizer, cache_dir: str | None = None):
        self.source = source
        self.tokenizer = tokenizer
        self.name = source.name
        self.vocab_size = tokenizer.vocab_size
        self._dir = (os.path.join(cache_dir, f"tokens-{tokenizer.fingerprint[:24]}")
                     if cache_dir else None)
        self._streams: dict[str, np.ndarray] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        return self.source.splits

    def num_docs(self, split: str) -> int:
        """Number of documents in ``split`` (those of the byte-level source).

        Args:
          split: a split name.

        Returns:
          The number of documents.

        Raises:
          DataError: ``split`` is not a split of the corpus.
        """
        return self.source.num_docs(split)

    def num_tokens(self, split: str) -> int:
        """Length of the token stream of ``split`` (documents plus one EOS each).

        Args:
          split: a split name; on first use its stream is tokenized or mapped (:meth:`stream`).

        Returns:
          The number of tokens of the stream.

        Raises:
          DataError: ``split`` is not a split of the corpus, or the cache cannot be written.
        """
        return int(self.stream(split).shape[0])

    def read(self, split: str, starts, length: int) -> np.ndarray:
        """Returns ``int32 [len(starts), length]``: the stream of ``split`` at each start.

        Args:
          split: a split name (see :meth:`stream`).
          starts: token offsets into the split's stream (any integer array-like, flattened).
          length: tokens per window.

        Returns:
          ``int32 [len(starts), length]``: row ``i`` is the stream at ``starts[i] ..
          starts[i] + length - 1`` (EOS ids included).

        Raises:
          IndexError: a window that starts before 0 or ends past the stream.
          DataError: ``split`` is not a split of the corpus, or the cache cannot be written.
        """
        stream = self.stream(split)
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + length > stream.shape[0]):
            raise IndexError(f"window out of range of {self.name}/{split} "
                             f"({stream.shape[0]} tokens)")
        return stream[starts[:, None] + np.arange(length, dtype=np.int64)].astype(np.int32)

    def stream(self, split: str) -> np.ndarray:
        """The whole token stream of ``split`` (a read-only memory map when cached on disk).

        On first use the split is tokenized (:func:`tokenize_split`): in memory without a
        ``cache_dir``, else once into ``cache_dir/tokens-<fingerprint>/<split>-<n>docs.<dtype>``
        (read whole when that is on object storage).

        Args:
          split: a split name.

        Returns:
          The 1-D stream in :func:`stream_dtype` of the vocabulary.

        Raises:
          DataError: ``split`` is not a split of the corpus, or the cache cannot be written.
        """
        if split not in self._streams:
            self._streams[split] = self._load(split)
        return self._streams[split]

    def _load(self, split: str) -> np.ndarray:
        dtype = stream_dtype(self.vocab_size)
        n = self.source.num_docs(split)  # also rejects an unknown split
        if self._dir is None:
            import io

            buf = io.BytesIO()
            tokenize_split(self.source, split, self.tokenizer, buf)
            return np.frombuffer(buf.getvalue(), dtype)
        path = os.path.join(self._dir, f"{split}-{n}docs.{dtype.name}")

        def tokenize(tmp) -> None:
            log.info("tokenizing %s/%s (%d documents) into %s", self.name, split, n, path)
            with tmp.open("wb") as f:
                tokenize_split(self.source, split, self.tokenizer, f)

        stored = cached(path, tokenize, f"the token stream of {self.name}/{split}")
        if is_remote(path):  # object storage: read it whole (a memory map needs a local file)
            return np.frombuffer(stored.read_bytes(), dtype)
        return np.memmap(path, dtype=dtype, mode="r")
