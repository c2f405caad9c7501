"""Throughput of the data pipeline alone, to compare with the train step (``bench_data.py``).

Two numbers per tokenizer, both in tokens per second:

* :func:`pipeline_tokens_per_s` -- producing training batches with
  :func:`~gift_jax.data.batch_iterator` from an already tokenized source: what every step
  costs the host.
* :func:`tokenize_tokens_per_s` -- the one-time tokenization pass over a split
  (:func:`~gift_jax.data.tokenized.tokenize_split`): what every step would cost if the text
  were tokenized on the fly instead of once at prepare time.
"""

from __future__ import annotations

import io
import time

from gift_jax.data.pipeline import batch_iterator
from gift_jax.data.tokenized import tokenize_split


def pipeline_tokens_per_s(source, global_batch: int, seq_len: int, *, batches: int = 20,
                          seed: int = 0, split: str = "train") -> float:
    """Training tokens per second of ``batches`` batches of ``[global_batch, seq_len + 1]``
    (the first batch, which loads the stream, is not timed)."""
    it = batch_iterator(source, split, global_batch, seq_len, seed=seed)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return global_batch * seq_len * batches / (time.perf_counter() - t0)


def tokenize_tokens_per_s(source, tokenizer, split: str = "validation") -> tuple[float, int]:
    """``(tokens per second, tokens)`` of tokenizing every document of ``split`` of a byte
    :class:`~gift_jax.data.source.TokenSource` with ``tokenizer`` (reading the records
    included)."""
    t0 = time.perf_counter()
    n = tokenize_split(source, split, tokenizer, io.BytesIO())
    return n / (time.perf_counter() - t0), n
