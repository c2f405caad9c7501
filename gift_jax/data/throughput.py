"""Throughput of the data pipeline alone, to compare with the train step (``bench_data.py``).

Two numbers per tokenizer, both in tokens per second:

* :func:`pipeline_tokens_per_s` -- producing training batches with
  :func:`~gift_jax.data.batch_iterator` from an already tokenized source: what every step
  costs the host.
* :func:`tokenize_tokens_per_s` -- the one-time tokenization pass over a split
  (:func:`~gift_jax.data.tokenized.tokenize_split`): what every step would cost if the text
  were tokenized on the fly instead of once at prepare time.

and for the streaming pipeline (``bench_stream.py``): :func:`stream_tokens_per_s` (steady
state, reading and tokenizing included, with a given worker count) and
:func:`process_tree_rss` (the host memory of the pipeline's processes).
"""

from __future__ import annotations

import io
import os
import time

from gift_jax.data.pipeline import batch_iterator
from gift_jax.data.stream import stream_batches
from gift_jax.data.tokenized import tokenize_split


def pipeline_tokens_per_s(source, global_batch: int, seq_len: int, *, batches: int = 20,
                          seed: int = 0, split: str = "train") -> float:
    """Training tokens per second of ``batches`` batches of ``[global_batch, seq_len + 1]``
    (the first batch, which loads the stream, is not timed).

    Args:
      source: a token source (byte-level or tokenized).
      global_batch, seq_len: the batch shape (:func:`~gift_jax.data.batch_iterator`).
      batches: the number of timed batches.
      seed: the batch order's seed.
      split: the split to read.

    Returns:
      ``global_batch * seq_len * batches`` over the timed seconds.
    """
    it = batch_iterator(source, split, global_batch, seq_len, seed=seed)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return global_batch * seq_len * batches / (time.perf_counter() - t0)


def tokenize_tokens_per_s(source, tokenizer, split: str = "validation") -> tuple[float, int]:
    """``(tokens per second, tokens)`` of tokenizing every document of ``split`` of a byte
    :class:`~gift_jax.data.source.TokenSource` with ``tokenizer`` (reading the records
    included).

    Args:
      source: a byte-level :class:`~gift_jax.data.source.TokenSource`.
      tokenizer: the tokenizer to time.
      split: the split to tokenize.

    Returns:
      ``(tokens per second, tokens)``: the rate and the split's tokenized length.
    """
    t0 = time.perf_counter()
    n = tokenize_split(source, split, tokenizer, io.BytesIO())
    return n / (time.perf_counter() - t0), n


def stream_tokens_per_s(source, global_batch: int, seq_len: int, *, workers: int,
                        batches: int = 20, seed: int = 0, split: str = "train",
                        id_cache: str = "") -> tuple[float, int]:
    """``(training tokens per second, peak bytes)`` of ``batches`` batches of the streaming
    pipeline with ``workers`` worker processes, after its first batch (start-up excluded).
    Peak bytes: the largest resident memory of this process and its workers together, sampled
    after every batch (:func:`process_tree_rss`). ``id_cache``: read the ids from this
    (complete) cache where it has them.

    Args:
      source: a byte-level :class:`~gift_jax.data.source.TokenSource` or a
        :class:`~gift_jax.data.tokenized.TokenizedSource` (see
        :func:`~gift_jax.data.stream_batches`).
      global_batch, seq_len: the batch shape.
      workers: the pipeline's worker processes.
      batches: the number of timed batches.
      seed: the stream's seed.
      split: the split to read.
      id_cache: a local id-cache directory; ``""``: none.

    Returns:
      ``(tokens per second, peak bytes)``: ``global_batch * seq_len * batches`` over the timed
      seconds, and the peak resident memory.
    """
    it = stream_batches(source, split, global_batch, seq_len, seed=seed, workers=workers,
                        id_cache=id_cache)
    next(it)
    peak = process_tree_rss()
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
        peak = max(peak, process_tree_rss())
    return global_batch * seq_len * batches / (time.perf_counter() - t0), peak


def process_tree_rss(pid: int | None = None) -> int:
    """Resident bytes of process ``pid`` (default: this one) and all its descendants, from
    ``/proc`` (0 where it is unavailable).

    Args:
      pid: the root process; ``None``: this process.

    Returns:
      The sum of the processes' resident set sizes, in bytes.
    """
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))  # field 4: ppid
        rss[int(entry)] = int(fields[21]) * page  # field 24: rss in pages
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total
