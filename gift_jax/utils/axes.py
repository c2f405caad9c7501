"""Mesh-axis helpers shared by the collectives and the refresh spreading (pure ``jax.lax``).

``AxisName`` is a mesh axis or a tuple of axes (reduced as one group); ``None`` means a single
device wherever a function takes ``axis_name: AxisName | None``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from gift_jax.utils.tree_paths import leaf_path

AxisName = str | tuple[str, ...]


def axis_tuple(axis_name: AxisName) -> tuple[str, ...]:
    """``axis_name`` as a tuple of mesh axes.

    Args:
      axis_name: a mesh axis name or a tuple of them.

    Returns:
      The axes as a tuple (``(axis_name,)`` for a single name, the tuple itself otherwise).
    """
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_name_of(axes: tuple[str, ...]) -> AxisName:
    """The ``axis_name`` collectives take for ``axes``: the name of one axis, else the tuple.

    Args:
      axes: one or more mesh axis names, outermost first (must not be empty).

    Returns:
      ``axes[0]`` when there is one axis, else ``axes`` unchanged.
    """
    return axes if len(axes) > 1 else axes[0]


def axis_size(axis_name: AxisName) -> int:
    """Size of a bound (tuple of) mesh axis, with a clear error when it is not bound.

    Args:
      axis_name: a mesh axis or tuple of axes bound by the enclosing ``jax.shard_map``.

    Returns:
      The number of replicas along the axis (the product of the sizes for a tuple).

    Raises:
      ValueError: ``axis_name`` is not bound here (called outside ``shard_map``, or the mesh
        has no such axis).
    """
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
    over other, GSPMD-partitioned axes: a ``data=1`` sharded mesh).

    Args:
      x: a pytree of arrays to average over the replicas.
      axis_name: the mesh axis (or tuple of axes) to average over; ``None``: a single device.

    Returns:
      ``x`` averaged over the replicas of ``axis_name`` (``x`` itself for ``None`` or size 1).

    Raises:
      ValueError: ``axis_name`` is not bound here (from :func:`axis_size`).
    """
    if axis_name is None or axis_size(axis_name) == 1:
        return x
    return jax.lax.pmean(x, axis_name)


_GATHER_HAS_TO = "to" in inspect.signature(jax.lax.all_gather).parameters


def all_gather_invariant(x: jax.Array, axis_name: AxisName, tiled: bool = False) -> jax.Array:
    """``all_gather`` whose result is typed *invariant* over the axis (it is: every replica
    holds the same bytes), so outputs can leave ``shard_map`` as ``P()`` under ``check_vma``.
    On a JAX without ``all_gather(..., to=...)`` it is a plain ``all_gather``.

    Args:
      x: this replica's array, gathered along a new (or, ``tiled``, its existing) axis 0.
      axis_name: the bound mesh axis (or tuple of axes) to gather over.
      tiled: concatenate the replicas' arrays along axis 0 instead of stacking them on a new
        leading axis.

    Returns:
      The replicas' ``x`` in replica order: shape ``(n, *x.shape)``, or
      ``(n * x.shape[0], *x.shape[1:])`` when ``tiled`` (``n`` = the axis size).
    """
    if _GATHER_HAS_TO:
        return jax.lax.all_gather(x, axis_name, axis=0, tiled=tiled, to="invarying")
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=tiled)


def as_varying(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Type a per-device value as varying over the axis (for ``check_vma=True``).

    Args:
      x: a value inside ``jax.shard_map``.
      axis_name: the mesh axis (or tuple of axes) it is to vary over.

    Returns:
      ``x`` typed as varying over ``axis_name`` (``jax.lax.pcast``, or ``jax.lax.pvary`` on
      older JAX); ``x`` unchanged on a JAX that has neither.
    """
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axis_name, to="varying")
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, axis_name)
    return x


# ---- shard_map's check_vma=True: values typed by the mesh axes they vary over -------------
#
# Under ``jax.shard_map(..., check_vma=True)`` (JAX's default) every value's type records the
# manual mesh axes it varies over (``jax.typeof(x).mat.varying``); JAX's autodiff uses it: the
# gradient of a parameter passed in replicated (``in_specs=P()``), and so typed invariant, is
# summed over the devices by autodiff itself. Under ``check_vma=False`` nothing is tracked
# and every set is empty.


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes the type of ``x`` (an array, tracer or ``ShapeDtypeStruct``) varies
    over; empty outside ``shard_map`` and under ``check_vma=False``.

    Args:
      x: an array, tracer or ``jax.ShapeDtypeStruct``.

    Returns:
      The names of the manual mesh axes its type varies over.
    """
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # JAX before the ManualAxisType record


def vma_checked(axis_name: AxisName) -> bool:
    """Whether the enclosing ``shard_map`` tracks how values vary over ``axis_name``
    (``check_vma=True``): the replica index varies over its axis exactly then. ``False`` for
    an axis that is not bound here (the collectives name that error themselves).

    Args:
      axis_name: a mesh axis or tuple of axes (all of them must be tracked).

    Returns:
      Whether every axis of ``axis_name`` is bound and tracked by ``check_vma``.
    """
    try:
        return all(a in varying_axes(jax.lax.axis_index(a)) for a in axis_tuple(axis_name))
    except NameError:
        return False


def cast_varying(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``x`` typed as varying over ``axes`` as well (a no-op where it already does).

    Args:
      x: a value inside ``jax.shard_map``.
      axes: the manual mesh axes it must vary over (in addition to those it already does).

    Returns:
      ``x``, typed as varying over ``axes`` too.
    """
    missing = tuple(sorted(axes - varying_axes(x)))
    return as_varying(x, missing) if missing else x


def cond(pred: Any, true_fn: Callable, false_fn: Callable, *operands: Any) -> Any:
    """``jax.lax.cond`` whose branches may differ in the mesh axes their outputs vary over
    (one branch returns a constant, the other a value computed from per-replica data): each
    output is typed as varying over the union of both branches' axes (and the predicate's),
    which is what ``check_vma=True`` asks of a ``cond``. Without tracking it is
    ``jax.lax.cond``.

    Args:
      pred: the scalar boolean predicate.
      true_fn, false_fn: the branches, called with ``*operands``; their outputs must have the
        same tree structure, shapes and dtypes.
      *operands: the branches' arguments.

    Returns:
      The output of ``true_fn`` if ``pred`` else of ``false_fn``; under tracking each leaf is
      typed as varying over the axes of that leaf in either branch and of the predicate.
    """
    shapes = jax.eval_shape(true_fn, *operands), jax.eval_shape(false_fn, *operands)
    leaves = [jax.tree.leaves(s) for s in shapes]
    if not any(varying_axes(x) for side in leaves for x in side) and not varying_axes(pred):
        return jax.lax.cond(pred, true_fn, false_fn, *operands)
    axes = [varying_axes(a) | varying_axes(b) | varying_axes(pred)
            for a, b in zip(*leaves, strict=True)]

    def typed(fn):
        def branch(*args):
            out, treedef = jax.tree.flatten(fn(*args))
            return treedef.unflatten([cast_varying(x, ax) for x, ax in zip(out, axes,
                                                                           strict=True)])
        return branch

    return jax.lax.cond(pred, typed(true_fn), typed(false_fn), *operands)


class NotPerDeviceError(ValueError):
    """A stage that reduces over data-parallel devices was given a gradient that JAX's
    autodiff has already summed over them (``shard_map(check_vma=True)``, replicated
    parameters)."""


def require_per_device(tree: Any, axis_name: AxisName | None, stage: str) -> None:
    """Refuse (:class:`NotPerDeviceError`, one line) a gradient tree that does not vary over
    ``axis_name`` under ``check_vma=True``: autodiff of parameters passed in replicated has
    summed it over the devices in full precision already, and reducing it again would multiply
    it by the number of replicas (and compress nothing: the sum has crossed the wire). Under
    ``check_vma=False`` nothing is tracked and nothing is checked.

    Args:
      tree: the gradient pytree the stage is about to reduce.
      axis_name: the data-parallel axis (or tuple of axes) the stage reduces over; ``None``
        (a single device): nothing is checked.
      stage: the stage's name, which the error message starts with (e.g. ``"gift_jax.gift"``).

    Raises:
      NotPerDeviceError: a leaf of ``tree`` does not vary over every axis of ``axis_name``
        (the message names the first such leaf's path and counts the others).
    """
    if axis_name is None or not vma_checked(axis_name):
        return
    axes = frozenset(axis_tuple(axis_name))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    summed = [leaf_path(p) for p, x in flat if not axes <= varying_axes(x)]
    if summed:
        n = axis_size(axis_name)
        name = axis_name if len(axes) > 1 else next(iter(axes))
        raise NotPerDeviceError(
            f"{stage}: the gradient of {summed[0]!r}"
            f"{f' (and {len(summed) - 1} more)' if len(summed) > 1 else ''} does not vary "
            f"over {name!r}: inside jax.shard_map(check_vma=True) JAX's autodiff has already "
            f"summed it over the {n} devices in fp32, and reducing it again would multiply it "
            f"by {n}. Differentiate per device: params = jax.lax.pcast(params, {name!r}, "
            "to='varying') before jax.grad (or shard_map(..., check_vma=False))")
