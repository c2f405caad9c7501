"""Which leaves are projected, on which side, at which rank: static per-leaf layouts.

A leaf is viewed as a batch of matrices ``(batch, reduction, output)`` through dimension
numbers, exactly like ``optax.contrib.MuonDimensionNumbers`` (axes that are neither reduction
nor output are batch axes, e.g. a leading layer axis of stacked weights, and every batch
element gets its own projection). Like GaLore (and ``optax.contrib.galore``) the side with the
smaller optimizer state is projected: the reduction side if ``reduction >= output``, else the
output side. Internally every matrix is *oriented* so the projected side comes first:
``(batch, M, N)`` with ``M >= N``, projector ``(batch, M, k)``, moments ``(batch, k, N)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "LowRankDimensionNumbers",
    "LeafLayout",
    "mask_excluding",
    "resolve_layouts",
]


class LowRankDimensionNumbers(NamedTuple):
    """Axes that form the matrix of a parameter (same convention as optax's Muon/GaLore).

    Attributes:
      reduction_axis: input axis or axes (the first axis of a Flax kernel).
      output_axis: output axis or axes. Remaining axes are batch axes, each slice projected
        independently (e.g. ``(layers, d_in, d_out)`` stacked weights).

    Example: an attention kernel ``(embed, heads, head_dim)`` is
    ``LowRankDimensionNumbers(reduction_axis=0, output_axis=(1, 2))``; the output projection
    ``(heads, head_dim, embed)`` is ``LowRankDimensionNumbers((0, 1), 2)``.
    """

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


def _is_dim_nums(x: Any) -> bool:
    # Accept optax.contrib.MuonDimensionNumbers / GaLoreDimensionNumbers too.
    return isinstance(x, tuple) and hasattr(x, "reduction_axis") and hasattr(x, "output_axis")


def _axes(a: Sequence[int] | int, ndim: int) -> tuple[int, ...]:
    a = (a,) if isinstance(a, int) else tuple(a)
    return tuple(int(x) % ndim for x in a)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Static description of one projected leaf (hashable; computed from shapes only).

    ``perm`` transposes the leaf to ``batch + projected + other`` axes; the leaf is then
    reshaped to ``(batch, M, N)`` with ``M`` the projected (larger) side. ``side`` says which
    side that is: ``"reduction"`` (the input axis of a Flax kernel; the projected gradient
    ``(batch, k, N)`` then has the output side last) or ``"output"`` (then ``N`` is the input
    side) — what a stage acting on the communicated coordinates (e.g. GIFT whitening of the
    input side) needs to know.
    """

    shape: tuple[int, ...]
    perm: tuple[int, ...]
    batch: int
    m: int  # projected side (M >= N)
    n: int
    rank: int
    side: str  # "reduction" or "output": which side of the matrix M is
    batched: bool  # whether the leaf has batch axes (e.g. stacked layers)

    @property
    def moment_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.rank, self.n)

    @property
    def coord_shape(self) -> tuple[int, ...]:
        """Shape of the projected gradient handed to ``communicate``: ``(k, N)``, or
        ``(batch, k, N)`` for leaves with batch axes."""
        return self.moment_shape if self.batched else (self.rank, self.n)

    @property
    def projector_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.m, self.rank)

    def to_matrix(self, x: jax.Array) -> jax.Array:
        """Leaf → oriented ``(batch, M, N)``."""
        return jnp.transpose(x, self.perm).reshape(self.batch, self.m, self.n)

    def from_matrix(self, y: jax.Array) -> jax.Array:
        """Oriented ``(batch, M, N)`` → leaf shape."""
        permuted = tuple(self.shape[a] for a in self.perm)
        inv = tuple(sorted(range(len(self.perm)), key=lambda i: self.perm[i]))
        return jnp.transpose(y.reshape(permuted), inv)


def _make_layout(shape: tuple[int, ...], dn: Any, rank: int, path: str) -> LeafLayout | None:
    ndim = len(shape)
    red, out = _axes(dn.reduction_axis, ndim), _axes(dn.output_axis, ndim)
    if not red or not out or set(red) & set(out) or len(set(red)) != len(red) or len(
        set(out)
    ) != len(out):
        raise ValueError(
            f"weight_dimension_numbers for {path} (shape {shape}): reduction axes {red} and "
            f"output axes {out} must be non-empty, distinct and disjoint"
        )
    batch_axes = tuple(a for a in range(ndim) if a not in red and a not in out)
    size = lambda axes: math.prod(shape[a] for a in axes)
    m_red, n_out = size(red), size(out)
    if m_red >= n_out:  # GaLore convention: project the larger side → smaller state
        perm, m, n, side = batch_axes + red + out, m_red, n_out, "reduction"
    else:
        perm, m, n, side = batch_axes + out + red, n_out, m_red, "output"
    if rank >= n:
        return None  # a rank-n projection is exact: keep the leaf dense
    return LeafLayout(shape, perm, size(batch_axes), m, n, rank, side, bool(batch_axes))


def resolve_layouts(
    params: Any,
    rank: int | Any,
    weight_dimension_numbers: Any,
    mask: Any,
) -> Any:
    """Per-leaf :class:`LeafLayout` (projected) or ``None`` (dense), same structure as params.

    Rules, per leaf:
      * ``mask`` False → dense.
      * dimension numbers given → projected through them.
      * no dimension numbers: a 2-D leaf is projected with ``(0, 1)``; other leaves are dense,
        unless the mask explicitly selects them (then ``ValueError``: say how to flatten it).
      * ``rank >= min(M, N)`` → dense (the projection would be exact).

    Args:
      params: pytree of arrays (or shape-dtype structs).
      rank: int, or a pytree of ints / callable returning one (per-leaf rank).
      weight_dimension_numbers: None, one :class:`LowRankDimensionNumbers` (applied to every
        leaf with ``ndim >= 2``), a pytree of them (``None`` leaves: default rule), or a callable.
      mask: None, a pytree of bools, or a callable returning one.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    n = len(leaves)

    def per_leaf(spec, name, is_leaf=None):
        if spec is None:
            return [None] * n
        tree = spec(params) if callable(spec) else spec
        flat = treedef.flatten_up_to(tree) if is_leaf is None else jax.tree.leaves(
            tree, is_leaf=is_leaf
        )
        if len(flat) != n:
            raise ValueError(f"{name} must have the structure of params ({n} leaves), got {tree}")
        return flat

    if _is_dim_nums(weight_dimension_numbers):
        dns = [weight_dimension_numbers if len(x.shape) >= 2 else None for _, x in leaves]
    else:
        dns = per_leaf(
            weight_dimension_numbers,
            "weight_dimension_numbers",
            is_leaf=lambda x: x is None or _is_dim_nums(x),
        )
    masks = per_leaf(mask, "mask")
    ranks = [rank] * n if isinstance(rank, int) else per_leaf(rank, "rank")

    layouts = []
    for (path, x), dn, mk, rk in zip(leaves, dns, masks, ranks, strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        shape = tuple(x.shape)
        if mk is not None and not mk:
            layouts.append(None)
            continue
        if dn is None:
            if len(shape) == 2:
                dn = LowRankDimensionNumbers()
            elif mk is None:
                layouts.append(None)
                continue
            else:
                raise ValueError(
                    f"mask selects {name} of shape {shape} for projection, but only 2-D leaves "
                    "have default dimension numbers; pass weight_dimension_numbers "
                    "(LowRankDimensionNumbers(reduction_axis, output_axis)) for it or mask it out"
                )
        if not isinstance(rk, int) or isinstance(rk, bool) or rk < 1:
            raise ValueError(f"rank for {name} must be an int >= 1, got {rk!r}")
        layouts.append(_make_layout(shape, dn, rk, name))
    return jax.tree.unflatten(treedef, layouts)


def mask_excluding(*substrings: str) -> Callable[[Any], Any]:
    """A mask callable: project every leaf with ``ndim >= 2`` whose path contains none of
    ``substrings`` (case-insensitive), e.g. ``mask_excluding("embed", "lm_head")`` keeps the
    embedding and output head dense. Leaves with more than 2 dims still need dimension numbers.
    """
    subs = tuple(s.lower() for s in substrings)

    def mask(params):
        def f(path, x):
            name = jax.tree_util.keystr(path).lower()
            return len(x.shape) >= 2 and not any(s in name for s in subs)

        return jax.tree_util.tree_map_with_path(f, params)

    return mask
