"""Token ids cached per shard of documents, built in the background while training runs
(``data.id_cache``; levanter's idea of a cache that fills as the run goes, not before it).

The documents of a split, in record order, fall into shards of :data:`SHARD_DOCS`. Shard ``s``
is two files, named by ``s`` in seven digits (``0000012``), in the folder
``<id_cache>/<fingerprint[:24]>/<split>-<key>/`` of :func:`cache_folder` (the tokenizer's
fingerprint; ``key`` the first 20 hex digits of the SHA-1 of the corpus, split and document
count):

* ``{s:07d}.ids``: its documents' ids as the stream packs them (each followed by EOS; an empty
  document has none), one after the other, in the stream dtype (``uint16`` when the vocabulary
  fits);
* ``{s:07d}.offsets.npy``: ``int64 [n + 1]``, document ``k``'s ids are
  ``ids[offsets[k]:offsets[k+1]]``.

The offsets file is renamed into place last, so a shard whose offsets exist is complete. A
builder process (:func:`start_builder`) tokenizes the shards not yet cached, process ``p`` of
``P`` the shards ``s ≡ p (mod P)``, while the stream's readers (:class:`ShardedIds`) take each
document's ids from its shard where that shard is complete and tokenize it where not. Both
give the same ids, so the batches do not depend on how far the cache has come.

Why a local directory only: the stream visits documents in shuffled order, so a cached read is
one small random read per document. A memory map makes that a page fault on a local disk; on
object storage it would be one HTTP range request per document (tens of milliseconds), slower
than tokenizing the document again.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import threading
from collections import OrderedDict

import numpy as np

from gift_jax.data.errors import DataError
from gift_jax.data.storage import is_remote, local_or_url

log = logging.getLogger(__name__)

#: Documents per shard: one tokenizer call and one pair of files each.
SHARD_DOCS = 4096
#: Shards kept memory-mapped per reader (older ones are unmapped).
OPEN_SHARDS = 64


def cache_folder(id_cache: str, tokenizer, source, split: str, num_docs: int) -> str:
    """Where the shards of ``split`` of ``source`` (a byte-level
    :class:`~gift_jax.data.source.TokenSource`, named by its ``cache_key`` where it has one)
    under ``tokenizer`` live (a local folder).

    Args:
      id_cache: the ``data.id_cache`` root directory (``~`` expanded, made absolute).
      tokenizer: the tokenizer (its ``fingerprint`` names the first level).
      source: the byte-level source of the documents.
      split: the split.
      num_docs: the split's number of documents (part of the key).

    Returns:
      ``<id_cache>/<fingerprint[:24]>/<split>-<key>``, ``key`` the first 20 hex digits of the
      SHA-1 of ``corpus|split|num_docs``.

    Raises:
      DataError: ``id_cache`` is object storage (see the module doc).
    """
    if is_remote(id_cache):
        raise DataError(f"data.id_cache={id_cache!r} must be a local directory (a cached read is "
                        "a random read per document; on object storage that is slower than "
                        "tokenizing); use the host's local disk, or '' for no cache")
    corpus = getattr(source, "cache_key", None) or source.name
    key = hashlib.sha1(f"{corpus}|{split}|{num_docs}".encode()).hexdigest()[:20]
    return os.path.join(local_or_url(id_cache), tokenizer.fingerprint[:24], f"{split}-{key}")


class ShardedIds:
    """Read side: the cached ids of documents whose shard is complete.

    Args:
      folder: :func:`cache_folder`.
      dtype: the ids' dtype (:func:`gift_jax.data.tokenized.stream_dtype`).
      shard_docs: documents per shard.
    """

    def __init__(self, folder: str, dtype, shard_docs: int = SHARD_DOCS):
        self.folder, self.dtype, self.shard_docs = folder, np.dtype(dtype), shard_docs
        self._open: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def path(self, shard: int, suffix: str) -> str:
        """The file of shard ``shard`` with ``suffix``.

        Args:
          shard: the shard index.
          suffix: ``"ids"``, ``"offsets.npy"`` or a temporary name's suffix.

        Returns:
          ``<folder>/<shard, 7 digits>.<suffix>``.
        """
        return os.path.join(self.folder, f"{shard:07d}.{suffix}")

    def _shard(self, shard: int) -> tuple[np.ndarray, np.ndarray] | None:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        try:
            offsets = np.load(self.path(shard, "offsets.npy"))
        except FileNotFoundError:
            return None  # not built yet: asked again at the next document of this shard
        ids = (np.memmap(self.path(shard, "ids"), self.dtype, mode="r") if offsets[-1]
               else np.zeros(0, self.dtype))
        self._open[shard] = (ids, offsets)
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)
        return ids, offsets

    def get(self, doc: int) -> np.ndarray | None:
        """Document ``doc``'s ids (with EOS, as packed), or ``None`` while its shard is not
        cached.

        Args:
          doc: the document's index in the split (record order).

        Returns:
          Its ids in the cache's dtype (empty for an empty document), or ``None``.
        """
        found = self._shard(doc // self.shard_docs)
        if found is None:
            return None
        ids, offsets = found
        k = doc % self.shard_docs
        return np.asarray(ids[offsets[k]:offsets[k + 1]])

    def num_shards(self, num_docs: int) -> int:
        """The number of shards of a split.

        Args:
          num_docs: the split's number of documents.

        Returns:
          ``ceil(num_docs / shard_docs)``.
        """
        return -(-num_docs // self.shard_docs)

    def complete(self, shard: int) -> bool:
        """Whether shard ``shard`` is cached (its offsets file, written last, exists).

        Args:
          shard: the shard index.

        Returns:
          Whether the shard is complete.
        """
        return os.path.exists(self.path(shard, "offsets.npy"))

    def __getstate__(self):  # pickled into grain's workers without its open maps
        return {"folder": self.folder, "dtype": self.dtype, "shard_docs": self.shard_docs}

    def __setstate__(self, state):
        self.__init__(**state)


def build_shard(reader, tokenizer, cache: ShardedIds, shard: int) -> None:
    """Tokenizes shard ``shard`` of ``reader``'s documents into ``cache`` (atomically: the
    offsets file appears last, under its final name).

    A shard already complete is left as it is.

    Args:
      reader: the split's :class:`~gift_jax.data.source.DocumentReader`.
      tokenizer: the tokenizer (``encode_batch``, ``eos_id``).
      cache: the cache to write.
      shard: the shard index: documents ``[shard * shard_docs, (shard + 1) * shard_docs)``,
        clipped to the split.
    """
    if cache.complete(shard):
        return
    first = shard * cache.shard_docs
    docs = range(first, min(first + cache.shard_docs, len(reader)))
    texts = [t.decode("utf-8", errors="replace") for t in reader.get(list(docs))]
    eos = np.asarray([tokenizer.eos_id], cache.dtype)
    ids = [np.concatenate([np.asarray(x).astype(cache.dtype), eos]) if text else eos[:0]
           for text, x in zip(texts, tokenizer.encode_batch(texts), strict=True)]
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    os.makedirs(cache.folder, exist_ok=True)
    tag = f"{os.getpid()}.{threading.get_ident()}.tmp"
    ids_tmp, offsets_tmp = cache.path(shard, f"ids.{tag}"), cache.path(shard, f"offsets.{tag}")
    with open(ids_tmp, "wb") as f:
        for x in ids:
            f.write(x.tobytes())
    with open(offsets_tmp, "wb") as f:
        np.save(f, offsets)
    os.replace(ids_tmp, cache.path(shard, "ids"))
    os.replace(offsets_tmp, cache.path(shard, "offsets.npy"))


def build_shards(reader, tokenizer, cache: ShardedIds, shards: list[int]) -> None:
    """Builds every shard of ``shards`` that is missing, in order (the builder's loop).

    Args:
      reader, tokenizer, cache: as :func:`build_shard`.
      shards: the shard indices to build.
    """
    for shard in shards:
        build_shard(reader, tokenizer, cache, shard)


def start_builder(reader, tokenizer, cache: ShardedIds, process_index: int,
                  process_count: int) -> multiprocessing.Process | None:
    """Starts a daemon process that builds this process's missing shards (``s ≡ process_index
    mod process_count``), or returns ``None`` when they are all cached.

    Args:
      reader, tokenizer, cache: as :func:`build_shard` (pickled into the new process).
      process_index, process_count: this process and the number of processes of the job.

    Returns:
      The started ``spawn`` process (running :func:`build_shards`), or ``None``.
    """
    mine = [s for s in range(process_index, cache.num_shards(len(reader)), process_count)
            if not cache.complete(s)]
    if not mine:
        return None
    log.info("data.id_cache: tokenizing %d shards of %d documents into %s in the background",
             len(mine), cache.shard_docs, cache.folder)
    builder = multiprocessing.get_context("spawn").Process(
        target=build_shards, args=(reader, tokenizer, cache, mine), daemon=True,
        name="gift_jax id cache")
    builder.start()
    return builder
