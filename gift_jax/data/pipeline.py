"""Deterministic, resumable, process-sliced batches of token windows.

Scheme. A sequence is a window of ``L = seq_len + 1`` consecutive tokens of a split's token
stream (length ``N``); the model trains on ``window[:-1] -> window[1:]``. Windows lie on a grid
of stride ``L``. Row ``j`` of global batch ``k`` is global window number ``c = k * B + j``
(``B = global_batch``), so batch ``k`` depends only on ``(seed, k)``: starting at
``start_step = s`` yields exactly batches ``s, s+1, ...`` of an uninterrupted run.

* Training (``shuffle=True``, the default for split ``"train"``): epoch ``e = c // W`` holds
  ``W = N // L - 1`` windows starting at ``o_e + L * perm_e(c % W)``, where the grid offset
  ``o_e`` in ``[0, L)`` and the permutation ``perm_e`` of ``[0, W)`` are derived from
  ``(seed, e)`` through ``np.random.SeedSequence``. ``perm_e`` is a keyed Feistel network with
  cycle walking: a true permutation evaluated per index in O(1) memory, so it scales to
  billions of windows. Every epoch sees every grid window once, on a shifted grid.
* Evaluation (``shuffle=False``, the default for other splits): the ``W = N // L`` windows at
  ``0, L, 2L, ...`` in order; with ``loop=False`` iteration stops before the first incomplete
  batch, so the same windows are evaluated every time.

Process ``p`` of ``P`` reads only rows ``[p * B / P, (p + 1) * B / P)`` of each global batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np

from gift_jax.data.errors import DataError

_ROUNDS = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(indices, n: int, keys) -> np.ndarray:
    """Applies the permutation of ``[0, n)`` keyed by ``keys`` (uint64 round keys) to indices.

    A balanced Feistel network on the smallest even number of bits (at least 2) that holds
    ``n - 1``, with cycle walking (re-applied until the value falls inside ``[0, n)``).

    Args:
      indices: indices in ``[0, n)`` (any integer array-like).
      n: the size of the permuted range.
      keys: the round keys, one Feistel round each (uint64 array-like).

    Returns:
      ``int64`` array of ``indices``' shape: the permuted indices, in ``[0, n)``.
    """
    x = np.asarray(indices, dtype=np.uint64).copy()
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.asarray(keys, dtype=np.uint64)

    def feistel(v: np.ndarray) -> np.ndarray:
        left, right = v >> np.uint64(half), v & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << np.uint64(half)) | right

    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # Cycle walking: re-apply until the value falls inside [0, n).
        x[todo] = feistel(x[todo])
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def _epoch_key(seed: int, epoch: int, length: int) -> tuple[int, np.ndarray]:
    """Grid offset in ``[0, length)`` and Feistel round keys of one epoch."""
    entropy = [seed % (1 << 64), epoch, 0x67696674]
    state = np.random.SeedSequence(entropy).generate_state(_ROUNDS + 1, np.uint64)
    return int(state[0] % np.uint64(length)), state[1:]


def windows_per_pass(num_tokens: int, length: int, *, shuffle: bool) -> int:
    """Number of windows in one pass (an epoch) over a stream of ``num_tokens`` tokens.

    Args:
      num_tokens: the stream's length ``N``.
      length: the window length ``L = seq_len + 1``.
      shuffle: whether the grid is shifted each epoch (training).

    Returns:
      ``W = N // L - 1`` when shuffled (and ``N // L >= 2``: one grid window is lost to the
      shift), else ``N // L``.
    """
    grid = num_tokens // length
    return grid - 1 if shuffle and grid >= 2 else grid


def window_starts(counters, num_tokens: int, length: int, *, seed: int, shuffle: bool):
    """Stream start positions of the global windows numbered ``counters`` (see module doc).

    Args:
      counters: global window numbers ``c = k * B + j`` (any integer array-like, >= 0).
      num_tokens: the stream's length ``N``.
      length: the window length ``L``.
      seed: the seed of the epochs' grid offsets and permutations (``shuffle`` only).
      shuffle: shifted, permuted grid per epoch (training), else the windows ``0, L, 2L, ...``
        in order, wrapping around.

    Returns:
      ``int64`` start positions, of ``counters``' shape.
    """
    counters = np.asarray(counters, dtype=np.int64)
    grid = num_tokens // length
    per_epoch = windows_per_pass(num_tokens, length, shuffle=shuffle)
    if not shuffle:
        return (counters % grid) * length
    epochs, within = np.divmod(counters, per_epoch)
    starts = np.empty_like(counters)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        offset, keys = _epoch_key(seed, int(epoch), length)
        if per_epoch == grid:
            offset = 0
        starts[sel] = offset + length * permute(within[sel], per_epoch, keys)
    return starts


def batch_iterator(
    source,
    split: str,
    global_batch: int,
    seq_len: int,
    *,
    seed: int = 0,
    start_step: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    loop: bool = True,
    shuffle: bool | None = None,
) -> Iterator[np.ndarray]:
    """Yields this process's ``int32 [global_batch // process_count, seq_len + 1]`` batches.

    Batch ``k`` (counting from 0, the first yielded is ``start_step``) is a function of
    ``(source, split, seed, k)`` only. ``shuffle`` defaults to ``split == "train"``; with
    ``loop=False`` iteration ends after the last complete batch of one pass (one epoch).

    Args:
      source: a :class:`~gift_jax.data.source.TokenSource` or
        :class:`~gift_jax.data.tokenized.TokenizedSource` (``num_tokens`` and ``read``).
      split: the split to read.
      global_batch: rows of a global batch ``B`` (over all processes).
      seq_len: the model's sequence length; a row holds ``seq_len + 1`` tokens.
      seed: the seed of the training order (``shuffle`` only).
      start_step: the first batch ``k`` to yield (resuming).
      process_index, process_count: this process ``p`` and the number ``P`` of processes; it
        yields rows ``[p * B / P, (p + 1) * B / P)``.
      loop: ``True``: endless (epoch after epoch); ``False``: one pass, stopping before the
        first incomplete batch.
      shuffle: permuted, shifted grid (training); ``None``: ``split == "train"``.

    Returns:
      An iterator of ``int32 [global_batch // process_count, seq_len + 1]`` batches (the
      settings are checked at the call, not at the first ``next``).

    Raises:
      DataError: a non-positive ``global_batch`` or ``seq_len``, ``process_index`` outside
        ``[0, process_count)``, ``global_batch`` not divisible by ``process_count``, a split
        shorter than one window, with ``loop=False`` a split of fewer than ``global_batch``
        windows, or an unknown or empty split.
    """
    if global_batch < 1 or seq_len < 1:
        raise DataError(f"global_batch={global_batch} and seq_len={seq_len} must be positive")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must lie in [0, {process_count})")
    if global_batch % process_count:
        raise DataError(
            f"global_batch={global_batch} is not divisible by process_count={process_count}; "
            "use a global batch that is a multiple of the number of processes"
        )
    if shuffle is None:
        shuffle = split == "train"
    length = seq_len + 1
    num_tokens = source.num_tokens(split)
    if num_tokens < length:
        raise DataError(f"seq_len={seq_len} is too long for split {split!r} ({num_tokens} tokens)")
    local = global_batch // process_count
    rows = process_index * local + np.arange(local, dtype=np.int64)
    steps: Iterable[int] = itertools.count(start_step)
    if not loop:
        num_batches = windows_per_pass(num_tokens, length, shuffle=shuffle) // global_batch
        if num_batches == 0:
            raise DataError(
                f"split {split!r} ({num_tokens} tokens) holds fewer than global_batch="
                f"{global_batch} windows of seq_len+1={length}; lower global_batch or seq_len"
            )
        steps = range(start_step, num_batches)

    def batches() -> Iterator[np.ndarray]:
        for step in steps:
            counters = step * global_batch + rows
            starts = window_starts(counters, num_tokens, length, seed=seed, shuffle=shuffle)
            yield source.read(split, starts, length)

    return batches()  # Not a generator function itself, so bad settings raise at the call.
