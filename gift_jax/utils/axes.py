"""Mesh-axis helpers shared by the collectives and the refresh spreading (pure ``jax.lax``).

``AxisName`` is a mesh axis or a tuple of axes (reduced as one group); ``None`` means a single
device wherever a function takes ``axis_name: AxisName | None``.
"""

from __future__ import annotations

import inspect

import jax

AxisName = str | tuple[str, ...]


def axis_size(axis_name: AxisName) -> int:
    """Size of a bound (tuple of) mesh axis, with a clear error when it is not bound."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: call the collective inside "
            "jax.shard_map over a mesh that has this axis (or pass axis_name=None for a "
            "single device)"
        ) from e


def pmean(x, axis_name: AxisName | None):
    """``jax.lax.pmean`` over the replicas of ``axis_name``; the identity for ``None`` or a
    size-1 axis (where XLA's SPMD partitioner refuses an all-reduce of a value that is split
    over other, GSPMD-partitioned axes: a ``data=1`` sharded mesh)."""
    if axis_name is None or axis_size(axis_name) == 1:
        return x
    return jax.lax.pmean(x, axis_name)


_GATHER_HAS_TO = "to" in inspect.signature(jax.lax.all_gather).parameters


def all_gather_invariant(x: jax.Array, axis_name: AxisName, tiled: bool = False) -> jax.Array:
    """``all_gather`` whose result is typed *invariant* over the axis (it is: every replica
    holds the same bytes), so outputs can leave ``shard_map`` as ``P()`` under ``check_vma``."""
    if _GATHER_HAS_TO:
        return jax.lax.all_gather(x, axis_name, axis=0, tiled=tiled, to="invarying")
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=tiled)


def as_varying(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Type a per-device value as varying over the axis (for ``check_vma=True``)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, axis_name)
    return x
