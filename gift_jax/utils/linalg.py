"""Mapping matrix decompositions over a batch of layers without deadlocking XLA:CPU.

Every refresh (GIFT's factors, PLUMAGE's SVDs) decomposes one matrix per layer, batched over
a leading layer axis.  ``jax.vmap`` of ``cholesky``/``eigh``/``svd``/``qr`` lowers to one batched
LAPACK custom call, and on CPU jaxlib runs a batch of expensive matrices through
``ParallelBatchMap``: it schedules chunks on XLA's intra-op thread pool and *blocks the calling
pool thread* until they finish.  When every pool thread is inside such a call at once (two
batched decompositions in flight on a 2-core machine, or 8 simulated devices running the same
refresh), the chunks never get a thread and the process hangs at 0 % CPU.  We hit exactly that
(gdb: both ``tf_XLAEigen`` threads in ``jax::ParallelBatchMap`` → ``BlockingCounter::Wait``).
A batch of one runs inline, so on CPU :func:`map_matrices` uses ``lax.map`` (one matrix per
call); on GPU/TPU the batched solvers are safe and faster, so it is ``jax.vmap``.

Spreading a refresh over data-parallel replicas.  The inputs of a refresh (reduced statistics,
the reduced gradient) are identical on every replica, so every replica computing every
decomposition is R-fold redundant.  :func:`map_matrices_grouped` concatenates the layers whose
matrices have the same shapes, gives each replica a contiguous 1/R slice (padded by repeating
layers), and all-gathers the results: each replica decomposes ⌈T/R⌉ matrices instead of T,
and the results are bit-identical everywhere by construction (every replica holds the
gathered bytes of the one replica that computed them), at the cost of one all-gather of the
results (factors or projectors: n·r floats per layer for the rank-r forms).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gift_jax.utils.axes import AxisName, all_gather_invariant, axis_size

__all__ = ["map_matrices", "map_matrices_grouped", "map_matrices_sharded", "matmul_highest"]


def matmul_highest(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y`` at ``Precision.HIGHEST``: the package's fp32 reference math, not the reduced
    (bf16-pass / TF32) default of fp32 matmuls on GPU and TPU.

    Args:
      x, y: arrays that ``jnp.matmul`` accepts.

    Returns:
      Their product.
    """
    return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST)


def map_matrices(fn: Callable[..., Any], *xs: Any) -> Any:
    """``jax.vmap(fn)(*xs)`` over the leading axis, as ``lax.map`` on CPU (see module doc).

    ``None`` arguments are passed through unbatched, like ``in_axes=None``.

    Args:
      fn: the per-matrix function, called with one slice of each array argument (and the
        ``None`` ones as ``None``); it may return a pytree.
      *xs: arrays sharing a leading batch size T, or ``None``; at least one must be an array.

    Returns:
      ``fn``'s outputs stacked along a new leading axis of size T (same pytree structure).
    """
    if jax.default_backend() != "cpu":
        return jax.vmap(fn, in_axes=tuple(None if x is None else 0 for x in xs))(*xs)
    present = [i for i, x in enumerate(xs) if x is not None]

    def one(args):
        full = list(xs)
        for i, a in zip(present, args, strict=True):
            full[i] = a
        return fn(*full)

    return jax.lax.map(one, tuple(xs[i] for i in present))


def map_matrices_sharded(fn: Callable[..., Any], *xs: Any, axis_name: AxisName | None) -> Any:
    """:func:`map_matrices` with the batch split over the replicas of ``axis_name``.

    Must run inside ``shard_map`` (or another context binding ``axis_name``) with the same
    ``xs`` on every replica.  Replica i maps rows ``[i·c, (i+1)·c)`` of the batch padded to
    R·c rows (c = ⌈T/R⌉, padding repeats rows from the start), then the results are
    all-gathered and cut back to T.  ``axis_name=None`` or a size-1 axis maps locally.

    Args:
      fn: the per-matrix function, as for :func:`map_matrices`.
      *xs: arrays sharing a leading batch size T, or ``None``; at least one must be an array,
        and every replica must hold the same values.
      axis_name: the bound mesh axis (or tuple of axes) to spread the batch over; ``None``:
        map every row on this device.

    Returns:
      ``map_matrices(fn, *xs)``: every output leaf with leading axis T, identical on every
      replica (typed invariant over ``axis_name``).

    Raises:
      ValueError: ``axis_name`` is not bound here (from :func:`~gift_jax.utils.axes.axis_size`).
    """
    size = 1 if axis_name is None else axis_size(axis_name)
    if size == 1:
        return map_matrices(fn, *xs)
    total = next(x for x in xs if x is not None).shape[0]
    chunk = -(-total // size)
    rows = jnp.arange(size * chunk) % total
    start = jax.lax.axis_index(axis_name) * chunk
    mine = [None if x is None else jax.lax.dynamic_slice_in_dim(
        jnp.take(x, rows, axis=0), start, chunk) for x in xs]
    out = map_matrices(fn, *mine)
    return jax.tree.map(lambda y: all_gather_invariant(y, axis_name, tiled=True)[:total], out)


def _signature(args: Sequence[Any]) -> tuple:
    return tuple(None if a is None else (a.shape[1:], str(a.dtype)) for a in args)


def map_matrices_grouped(
    fn: Callable[..., Any],
    jobs: Mapping[Hashable, Sequence[Any]],
    axis_name: AxisName | None = None,
) -> dict[Hashable, Any]:
    """Map ``fn`` over the leading (layer) axis of every job, batching jobs of equal shapes.

    ``jobs[name]`` is a tuple of arguments, each an array with the job's own leading batch
    size or ``None`` (passed through).  Jobs whose arguments agree in shape past the batch
    axis (and in which are ``None``) are concatenated, mapped together with
    :func:`map_matrices_sharded` over ``axis_name`` (``None``: locally), and split back, so
    ``result[name]`` equals ``map_matrices(fn, *jobs[name])``.

    Args:
      fn: the per-matrix function, as for :func:`map_matrices`.
      jobs: ``{name: args}``; every job's arguments are arrays with that job's leading batch
        size, or ``None``, and at least one is an array.
      axis_name: the bound mesh axis (or tuple of axes) to spread each group's batch over, as
        in :func:`map_matrices_sharded`; ``None``: map locally.

    Returns:
      ``{name: outputs}`` for every job: ``fn``'s outputs stacked over that job's batch.

    Raises:
      ValueError: ``axis_name`` is not bound here (from :func:`~gift_jax.utils.axes.axis_size`).
    """
    groups: dict[tuple, list[Hashable]] = {}
    for name, args in jobs.items():
        groups.setdefault(_signature(args), []).append(name)
    out: dict[Hashable, Any] = {}
    for names in groups.values():
        sizes = [next(a for a in jobs[n] if a is not None).shape[0] for n in names]
        cols = zip(*(jobs[n] for n in names), strict=True)
        cat = [None if col[0] is None else jnp.concatenate(col, axis=0) for col in cols]
        res = map_matrices_sharded(fn, *cat, axis_name=axis_name)
        bounds = [0, *itertools.accumulate(sizes)]
        for n, lo, hi in zip(names, bounds[:-1], bounds[1:], strict=True):
            out[n] = jax.tree.map(lambda y, lo=lo, hi=hi: y[lo:hi], res)
    return out
