"""Streaming batches on grain: documents are read, tokenized and packed as training consumes
them, with no pass over the corpus before the first batch (``data.pipeline='stream'``).

Scheme (lanes). A global batch of ``B`` rows has ``B`` lanes. The documents of a split are
visited in a global order: position ``g = 0, 1, 2, ...`` is document ``perm_e(g mod D)`` of
epoch ``e = g // D`` (``D`` documents; ``perm_e`` is grain's index shuffle keyed by
``(seed, e)``; record order without shuffling). Lane ``j`` takes the positions ``j, j + B,
j + 2B, ...`` and concatenates their tokens, each document followed by the tokenizer's
``eos_id``; row ``j`` of batch ``k`` is the ``k``-th window of ``L = seq_len + 1`` tokens of lane
``j``. A document longer than a window continues in the lane's next window; an empty one
contributes nothing. So:

* batch ``k`` is a function of ``(corpus, tokenizer, seed, k, B, L)`` only: neither the number
  of processes nor the number of worker processes changes it;
* process ``p`` of ``P`` owns lanes ``[p B/P, (p+1) B/P)`` and reads only their documents (a
  ``1/P`` share, disjoint from the others'), and the processes' rows make up exactly the
  global batch;
* nothing needs the corpus's token count: ``D`` comes from the record count of the split
  (ArrayRecord / TFDS metadata), so the first batch costs the documents of its own windows.

Work per process. The process's documents, in the order it consumes them (local document
``i`` is lane ``i mod b`` of its ``b = B/P`` lanes, round ``i div b``), are read and tokenized in
chunks of :data:`CHUNK_DOCS` by a grain pipeline (``MapDataset.range(...).map(read and
tokenize)``), in ``workers`` worker processes (``mp_prefetch``: the chunks come back in order
whatever the worker count). The main process only packs: it hands each document's tokens to its
lane and cuts a batch when every lane holds a window.

Resume. :meth:`LaneBatches.state` is small and exact: per lane of this process, the round of
its first unconsumed document and how many of that document's tokens are consumed. It names
global lanes (``first_lane``), so the states of all processes concatenate into one global
state that does not depend on the process count. :func:`stream_batches` with a global state
re-reads from the earliest of its lanes' documents and drops what was consumed, so a resumed
iterator yields exactly the batches of an uninterrupted one (the trainer saves the global
state with each checkpoint).

Anchors: grain's ``MapDataset`` / ``mp_prefetch`` (maxtext's input pipeline), flax's lm1b example
(SentencePiece on the fly), levanter's lazily tokenized caches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from gift_jax.data import id_cache as id_cache_lib
from gift_jax.data.errors import DataError
from gift_jax.data.tokenized import stream_dtype

#: Documents read and tokenized together (one grain element; SentencePiece encodes a chunk in
#: threads). A ``text:DIR`` document is at most 32 Ki characters, so a chunk is at most 512 Ki:
#: what the workers read ahead at start-up (a few chunks each) stays well under a second of
#: tokenizing, time the first steps share the host's cores with.
CHUNK_DOCS = 16
#: Chunks read ahead per reader (the main process, or each worker): host memory stays a few
#: chunks per worker even when documents are whole books.
PREFETCH_CHUNKS = 2
#: Upper end of the local document index of an endless (training) stream.
_ENDLESS = 1 << 62


def default_workers() -> int:
    """The host's cores available to this process (the ``data.workers`` default)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _grain():
    try:
        import grain
    except ImportError:
        raise DataError("data.pipeline='stream' needs grain: pip install grain (part of the "
                        "'data' extra of gift_jax)") from None
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain reads absl flags; a script without absl.app
        flags.FLAGS.mark_as_parsed()
    return grain


@dataclasses.dataclass(frozen=True)
class LaneLayout:
    """Which global positions the local documents of one process are (see the module doc)."""

    lanes: int  # B: lanes of the global batch
    first: int  # p * B / P: this process's first lane
    local: int  # B / P: this process's lanes

    def position(self, i: int) -> int:
        """The global position of local document ``i``.

        Args:
          i: a local document index (lane ``i mod local`` of this process, round
            ``i div local``).

        Returns:
          ``round * lanes + first + lane``.
        """
        rounds, lane = divmod(i, self.local)
        return rounds * self.lanes + self.first + lane


@dataclasses.dataclass
class ReadChunk:
    """Local chunk ``c`` → ``[(i, tokens of local document i + EOS)]`` for its documents; run
    in grain's worker processes (pickled with the reader and the tokenizer)."""

    reader: Any  # DocumentReader of the split
    layout: LaneLayout
    tokenizer: Any
    shuffle: bool
    seed: int
    endless: bool
    cache: Any = None  # id_cache.ShardedIds: ids of documents already tokenized (or None)

    def __post_init__(self):
        self._order = None

    def _global_order(self):
        if self._order is None:  # built lazily, in the worker
            docs = _grain().MapDataset.range(len(self.reader))
            if self.shuffle:
                docs = docs.shuffle(seed=self.seed)
            self._order = docs.repeat(None) if self.endless else docs
        return self._order

    def __call__(self, chunk: int) -> tuple[list[int], list[int], bytes]:
        order, n = self._global_order(), len(self.reader)
        local = range(chunk * CHUNK_DOCS, (chunk + 1) * CHUNK_DOCS)
        pairs = [(i, self.layout.position(i)) for i in local]
        pairs = [(i, g) for i, g in pairs if self.endless or g < n]
        docs = [order[g] for _, g in pairs]
        found = [None if self.cache is None else self.cache.get(d) for d in docs]
        missing = [d for d, ids in zip(docs, found, strict=True) if ids is None]
        texts = [t.decode("utf-8", errors="replace")
                 for t in (self.reader.get(missing) if missing else [])]
        dtype = stream_dtype(self.tokenizer.vocab_size)  # halves what workers send back
        eos = np.asarray([self.tokenizer.eos_id], dtype)
        fresh = iter([np.concatenate([tokens.astype(dtype), eos]) if text else eos[:0]
                      for text, tokens in zip(texts, self.tokenizer.encode_batch(texts)
                                              if texts else [], strict=True)])
        ids = [next(fresh) if cached is None else cached for cached in found]
        return ([i for i, _ in pairs], [int(t.size) for t in ids],
                b"".join(np.asarray(t, dtype).tobytes() for t in ids))


def unpack_chunk(chunk: tuple[list[int], list[int], bytes], dtype) -> list[tuple[int, np.ndarray]]:
    """``[(i, tokens of local document i + EOS)]`` of a chunk as :class:`ReadChunk` returns it:
    the documents' indices, their token counts and their tokens as one ``bytes`` (one
    pickled object per chunk: grain would put each array of a list in a shared-memory segment
    of its own, and leave those in flight behind when the iterator stops).

    Args:
      chunk: ``(indices, lengths, payload)``.
      dtype: the token dtype of ``payload``.

    Returns:
      One ``(index, tokens)`` pair per document, the tokens a read-only view of ``payload``.
    """
    indices, lengths, payload = chunk
    tokens = np.frombuffer(payload, dtype)
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return [(i, tokens[a:b]) for i, a, b in zip(indices, bounds[:-1], bounds[1:], strict=True)]


def _cause(error: Exception) -> str:
    """``Type: message`` of the error a worker raised: the last such line of grain's report
    (it wraps the worker's traceback in its own error), else the error itself."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
    return named[-1] if named else f"{type(error).__name__}: {lines[0] if lines else ''}"


class LaneBatches:
    """Iterator of this process's ``int32 [b, L]`` batches from a stream of tokenized chunks
    (see the module doc); :meth:`state` is where it stands, for :func:`stream_batches`."""

    def __init__(self, chunks: Iterator, layout: LaneLayout, length: int,
                 resume: list[tuple[int, int]] | None, first_doc: int, describe: str,
                 loop: bool, builder=None, dtype=np.uint16):
        self._chunks, self._layout, self._length = chunks, layout, length
        self._dtype = dtype
        self._local = layout.local
        self._describe, self._loop = describe, loop
        self._lanes: list[deque] = [deque() for _ in range(self._local)]  # [i, tokens, offset]
        self._held = np.zeros(self._local, np.int64)  # tokens each lane holds
        self._next_doc = first_doc
        # on resume, per local lane: (first unconsumed local document, its tokens consumed)
        self._resume = resume
        self._resume_until = max(f for f, _ in resume) if resume else -1
        self._done = self._closed = False
        self._emitted = 0
        self._builder = builder  # the id cache's background process, if any

    def close(self) -> None:
        """Stops the reading workers at once and the id cache's builder (shards it finished
        stay cached); the iterator yields nothing after it."""
        _close_iterator(self._chunks)
        self._chunks = iter(())
        self._done = self._closed = True
        if self._builder is not None and self._builder.is_alive():
            self._builder.terminate()
            self._builder.join()
        self._builder = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown: nothing left to stop
            pass

    def __iter__(self) -> LaneBatches:
        return self

    def state(self) -> dict:
        """``{"first_lane": j, "lanes": [[round, tokens consumed], ...]}``: for each of this
        process's lanes (global lanes ``j, j + 1, ...``), the round of its first unconsumed
        document and how many of its tokens were consumed (JSON-able; see the module doc)."""
        lanes = []
        for lane, queue in enumerate(self._lanes):
            if queue:
                first, consumed = queue[0][0], queue[0][2]
            else:  # its next document is the first of this lane not read yet ...
                first, consumed = self._next_doc + (lane - self._next_doc) % self._local, 0
                if self._resume is not None and first <= self._resume[lane][0]:
                    first, consumed = self._resume[lane]  # ... or the resumed position
            lanes.append([int(first // self._local), int(consumed)])
        return {"first_lane": self._layout.first, "lanes": lanes}

    def _pull(self) -> bool:
        try:
            chunk = next(self._chunks)
        except StopIteration:
            return False
        except DataError:
            raise
        except Exception as e:  # a worker process that died or raised
            raise DataError(f"{self._describe}: a data worker failed ({_cause(e)}); rerun "
                            "with --config.data.workers=0 to see it in the main process"
                            ) from None
        for i, tokens in unpack_chunk(chunk, self._dtype):
            lane = i % self._local
            self._next_doc = max(self._next_doc, i + 1)
            offset = 0
            if self._resume is not None:
                first, consumed = self._resume[lane]
                if i < first:
                    continue  # consumed before the checkpoint
                offset = consumed if i == first else 0
            if tokens.size > offset:
                self._lanes[lane].append([i, tokens, offset])
                self._held[lane] += tokens.size - offset
        return True

    def __next__(self) -> np.ndarray:
        if self._closed:
            raise StopIteration
        while not self._done and self._held.min() < self._length:
            self._done = not self._pull()
        if self._held.min() < self._length:
            if not self._emitted:
                raise DataError(
                    f"{self._describe} has too few tokens for one batch: every one of its "
                    f"{self._layout.lanes} rows (lanes) needs a window of {self._length} "
                    "tokens of its own documents; use a smaller global batch or seq_len"
                    + ("" if self._loop else ", or loop over the split"))
            raise StopIteration
        self._emitted += 1
        if self._next_doc > self._resume_until:
            self._resume = None  # every lane is past its saved position
        out = np.empty((self._local, self._length), np.int32)
        for lane, queue in enumerate(self._lanes):
            filled = 0
            while filled < self._length:
                entry = queue[0]
                _, tokens, offset = entry
                take = min(self._length - filled, tokens.size - offset)
                out[lane, filled:filled + take] = tokens[offset:offset + take]
                filled += take
                if offset + take == tokens.size:
                    queue.popleft()
                else:
                    entry[2] = offset + take
            self._held[lane] -= self._length
        return out


def stream_batches(
    source,
    split: str,
    global_batch: int,
    seq_len: int,
    *,
    seed: int = 0,
    shuffle: bool | None = None,
    loop: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    workers: int = 0,
    state: dict | str | None = None,
    id_cache: str = "",
    shard_docs: int = id_cache_lib.SHARD_DOCS,
) -> LaneBatches:
    """This process's ``int32 [global_batch // process_count, seq_len + 1]`` batches of
    ``split`` by the lane scheme of the module doc, read and tokenized by ``workers`` grain
    worker processes (0: in this process).

    ``source``: a :class:`~gift_jax.data.source.TokenSource` (byte tokens) or a
    :class:`~gift_jax.data.tokenized.TokenizedSource` (its tokenizer; nothing is tokenized
    ahead). ``shuffle`` defaults to ``split == "train"``; ``loop=False`` ends at the first
    batch a lane cannot fill (a fixed, bounded set of windows: evaluation). ``state``: a
    :meth:`LaneBatches.state` (or its JSON) to resume from. ``id_cache``: a local directory
    where a background process caches the split's ids per shard while the iterator runs, and
    from which the readers take the ids of shards already cached
    (:mod:`gift_jax.data.id_cache`, ``shard_docs`` documents per shard; ``""``: tokenize
    every document). Bad settings raise
    :class:`DataError`.

    Args:
      source: a :class:`~gift_jax.data.source.TokenSource` (byte tokens) or a
        :class:`~gift_jax.data.tokenized.TokenizedSource` (its tokenizer; nothing is tokenized
        ahead).
      split: the split to read.
      global_batch: rows (lanes) ``B`` of a global batch.
      seq_len: the model's sequence length; a row holds ``seq_len + 1`` tokens.
      seed: the seed of the documents' order per epoch (``shuffle`` only).
      shuffle: visit documents in a shuffled order per epoch; ``None``: ``split == "train"``.
      loop: ``True``: endless (epoch after epoch); ``False``: one pass, ending at the first
        batch a lane cannot fill (a fixed, bounded set of windows: evaluation).
      process_index, process_count: this process ``p`` of ``P``; it owns lanes
        ``[p B/P, (p+1) B/P)``.
      workers: grain worker processes that read and tokenize (0: in this process).
      state: a global position (:func:`global_state` of the processes'
        :meth:`LaneBatches.state`, or its JSON) to resume from; ``None``: from the start.
      id_cache: a local directory where a background process caches the split's ids per shard
        while the iterator runs (training, ``loop=True``, only), and from which the readers
        take the ids of shards already cached (:mod:`gift_jax.data.id_cache`); ``""``:
        tokenize every document.
      shard_docs: documents per id-cache shard.

    Returns:
      A :class:`LaneBatches` iterator of ``int32 [global_batch // process_count, seq_len + 1]``
      batches (call its ``close()`` to stop the id cache's builder).

    Raises:
      DataError: a non-positive ``global_batch`` or ``seq_len``, ``process_index`` outside
        ``[0, process_count)``, ``global_batch`` not divisible by ``process_count``, a bad
        ``workers``, ``grain`` missing, an unknown or empty split, a ``state`` that is not
        ``{"lanes": [[round, tokens consumed], ...]}`` with ints ``>= 0`` (or its JSON) or
        holds another number of lanes than ``global_batch``, or an ``id_cache`` on object
        storage.
    """
    if global_batch < 1 or seq_len < 1:
        raise DataError(f"global_batch={global_batch} and seq_len={seq_len} must be positive")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must lie in [0, {process_count})")
    if global_batch % process_count:
        raise DataError(f"global_batch={global_batch} is not divisible by process_count="
                        f"{process_count}; use a global batch that is a multiple of the number "
                        "of processes")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise DataError(f"data.workers={workers!r} must be an int >= 0 (0: read and tokenize "
                        "in the main process)")
    grain = _grain()
    shuffle = split == "train" if shuffle is None else shuffle
    tokenizer = getattr(source, "tokenizer", None)
    byte_source = source.source if tokenizer is not None else source
    if tokenizer is None:
        from gift_jax.data.tokenizer import ByteTokenizer

        tokenizer = ByteTokenizer()
    reader = byte_source.reader(split)
    if len(reader) == 0:
        raise DataError(f"split {split!r} of {source.name} has no documents")
    local = global_batch // process_count
    layout = LaneLayout(global_batch, process_index * local, local)
    resume = None
    if state is not None:
        lanes = _saved_lanes(state)
        if len(lanes) != global_batch:
            raise DataError(
                f"the saved data position holds {len(lanes)} lanes, this run reads "
                f"{global_batch} (train.global_batch_size); resume with the global batch it "
                "was saved with")
        resume = [(r * local + lane, consumed) for lane, (r, consumed)
                  in enumerate(lanes[layout.first:layout.first + local])]
    first_doc = min(f for f, _ in resume) if resume else 0
    if loop:
        stop = _ENDLESS // CHUNK_DOCS
    else:  # the last local document whose position is in the split
        rounds = -(-len(reader) // global_batch)
        stop = -(-rounds * local // CHUNK_DOCS)
    cache = builder = None
    if id_cache:
        folder = id_cache_lib.cache_folder(id_cache, tokenizer, byte_source, split, len(reader))
        cache = id_cache_lib.ShardedIds(folder, stream_dtype(tokenizer.vocab_size), shard_docs)
        if loop:  # training; a bounded evaluation reads the cache, builds none
            builder = id_cache_lib.start_builder(reader, tokenizer, cache, process_index,
                                                 process_count)
    read = ReadChunk(reader, layout, tokenizer, shuffle, seed, endless=loop, cache=cache)
    chunks = grain.MapDataset.range(first_doc // CHUNK_DOCS, max(stop, 1)).map(read)
    chunks = chunks.to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                      prefetch_buffer_size=PREFETCH_CHUNKS))
    if workers:
        chunks = chunks.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    start = (first_doc // CHUNK_DOCS) * CHUNK_DOCS
    return LaneBatches(iter(chunks), layout, seq_len + 1, resume, start,
                       f"split {split!r} of {source.name}", loop, builder,
                       stream_dtype(tokenizer.vocab_size))


def _close_iterator(chunks) -> None:
    """Stops a grain iterator's prefetching and its worker processes now.

    Newer grain iterators have ``close()``; the multiprocessing iterator of grain 0.2.12 has
    none, and its pool is stopped by closing the generator it iterates inside the pool's
    context (otherwise the workers run on until the process exits, and the interpreter waits
    for them).

    Args:
      chunks: the iterator of chunks (``to_iter_dataset``, possibly ``mp_prefetch``).
    """
    close = getattr(chunks, "close", None)
    if callable(close):
        close()
        return
    inner = getattr(chunks, "_iterator", None)
    if inner is not None and callable(getattr(inner, "close", None)):
        inner.close()


def _saved_lanes(state: dict | str) -> list[tuple[int, int]]:
    """The ``[round, tokens consumed]`` pairs of a saved position (``stream_batches``'s
    ``state``), checked: a dict (or its JSON) whose ``"lanes"`` is a list of pairs of ints
    ``>= 0``.

    Args:
      state: the saved position.

    Returns:
      The ``(round, tokens consumed)`` of every global lane, in lane order.

    Raises:
      DataError: anything else, naming what was expected.
    """
    expected = ('expected {"lanes": [[round, tokens consumed], ...]} with ints >= 0 '
                "(global_state of the processes' LaneBatches.state(), or its JSON)")
    if isinstance(state, str):
        try:
            state = json.loads(state)
        except json.JSONDecodeError as e:
            raise DataError(f"the saved data position is not valid JSON ({e}); {expected}"
                            ) from None
    lanes = state.get("lanes") if isinstance(state, dict) else None
    if not isinstance(lanes, (list, tuple)):
        raise DataError(f"the saved data position {_short(state)} has no list of lanes; "
                        f"{expected}")
    out = []
    for i, entry in enumerate(lanes):
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 2
              and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0
                      for v in entry))
        if not ok:
            raise DataError(f"the saved data position's lane {i} is {_short(entry)}; {expected}")
        out.append((int(entry[0]), int(entry[1])))
    return out


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def global_state(states: list[dict]) -> dict:
    """One global position from the :meth:`LaneBatches.state` of every process.

    Args:
      states: the states of all processes, in any order.

    Returns:
      ``{"lanes": [[round, tokens consumed], ...]}`` with one entry per global lane, in lane
      order (what :func:`stream_batches` takes as ``state``).
    """
    states = sorted(states, key=lambda s: s["first_lane"])
    return {"lanes": [lane for s in states for lane in s["lanes"]]}
