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
from collections.abc import Callable
from typing import Any

import jax

from gift_jax.utils.matrices import MatrixDimensionNumbers, MatrixView, is_dimension_numbers
from gift_jax.utils.tree_paths import leaf_path, matches

__all__ = [
    "LowRankDimensionNumbers",
    "LeafLayout",
    "mask_excluding",
    "resolve_layouts",
]


#: Axes that form the matrix of a parameter: ``reduction_axis`` (input axes, the first axis of a
#: Flax kernel) and ``output_axis``; the rest are batch axes, each slice projected independently.
#: The matrix view shared with GIFT (:mod:`gift_jax.utils.matrices`, optax's Muon/GaLore
#: convention; optax's own records are accepted too).
LowRankDimensionNumbers = MatrixDimensionNumbers


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Static description of one projected leaf (hashable; computed from shapes only).

    The leaf is viewed (``view``) as ``(batch, M, N)`` with ``M`` the projected (larger) side.
    ``side`` says which side that is: ``"reduction"`` (the input axis of a Flax kernel; the
    projected gradient ``(batch, k, N)`` then has the output side last) or ``"output"`` (then
    ``N`` is the input side) — what a stage acting on the communicated coordinates (e.g. GIFT
    whitening of the input side) needs to know.
    """

    view: MatrixView
    rank: int
    side: str  # "reduction" or "output": which side of the matrix M is

    @property
    def shape(self) -> tuple[int, ...]:
        return self.view.shape

    @property
    def batch(self) -> int:
        return self.view.batch

    @property
    def batched(self) -> bool:
        """Whether the leaf has batch axes (e.g. stacked layers)."""
        return bool(self.view.batch_axes)

    @property
    def m(self) -> int:
        """The projected side (``M >= N``)."""
        v = self.view
        return v.n_reduction if self.side == "reduction" else v.n_output

    @property
    def n(self) -> int:
        v = self.view
        return v.n_output if self.side == "reduction" else v.n_reduction

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

    def layer_slice(self) -> LeafLayout:
        """The layout of one slice ``x[l]`` of a leaf stacked over scanned layers (its first
        axis, a batch axis, dropped; the same rank and projected side).

        Returns:
          The slice's :class:`LeafLayout`.

        Raises:
          ValueError: the leaf's first axis is not a batch axis.
        """
        return LeafLayout(self.view.layer_slice(), self.rank, self.side)

    def to_matrix(self, x: jax.Array) -> jax.Array:
        """Leaf → oriented ``(batch, M, N)``.

        Args:
          x: an array with the leaf's axes (sizes may differ, see
            :meth:`gift_jax.utils.matrices.MatrixView.to_matrix`).

        Returns:
          ``x`` as ``(batch, M, N)``: batch axes flattened in front, the projected side first.
        """
        return self.view.to_matrix(x, reduction_first=self.side == "reduction")

    def from_matrix(self, y: jax.Array) -> jax.Array:
        """Oriented ``(batch, M, N)`` → leaf shape.

        Args:
          y: a ``(batch, M, N)`` array, e.g. a back-projected update.

        Returns:
          ``y`` reshaped and transposed to the leaf's shape and axis order.
        """
        return self.view.from_matrix(y, reduction_first=self.side == "reduction")


def _make_layout(shape: tuple[int, ...], dn: Any, rank: int, path: str) -> LeafLayout | None:
    view = MatrixView.of(shape, dn, f"weight_dimension_numbers for {path}")
    # GaLore convention: project the larger side, for the smaller optimizer state
    side = "reduction" if view.n_reduction >= view.n_output else "output"
    if rank >= min(view.n_reduction, view.n_output):
        return None  # a rank-n projection is exact: keep the leaf dense
    return LeafLayout(view, rank, side)


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

    Returns:
      A pytree with the structure of ``params``: a :class:`LeafLayout` per projected leaf,
      ``None`` per dense one.

    Raises:
      ValueError: a ``rank``, ``mask`` or ``weight_dimension_numbers`` tree without the
        structure of ``params``; a rank that is not an int ``>= 1``; a leaf of other than 2
        dims that the mask selects without dimension numbers; dimension numbers that do not fit
        the leaf's shape.
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

    if is_dimension_numbers(weight_dimension_numbers):
        dns = [weight_dimension_numbers if len(x.shape) >= 2 else None for _, x in leaves]
    else:
        dns = per_leaf(
            weight_dimension_numbers,
            "weight_dimension_numbers",
            is_leaf=lambda x: x is None or is_dimension_numbers(x),
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


def mask_excluding(*patterns: str) -> Callable[[Any], Any]:
    """A mask callable: project every leaf with ``ndim >= 2`` whose path matches none of
    ``patterns`` (the package's one pattern language, :func:`gift_jax.utils.tree_paths.matches`:
    case-sensitive ``fnmatch`` on ``/``-joined paths, for the leaf or its module), e.g.
    ``mask_excluding("embed/*", "lm_head/*")`` keeps the embedding and output head dense.
    Leaves with more than 2 dims still need dimension numbers.

    Patterns were case-insensitive substrings before: ``"embed"`` now selects only a leaf or
    module whose whole path is ``embed``; write ``"embed/*"`` (or ``"*embed*"``).

    Args:
      *patterns: path patterns of the leaves to keep dense.

    Returns:
      ``params → tree of bools`` (True: project the leaf).
    """
    patterns = tuple(patterns)

    def mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: len(x.shape) >= 2 and not matches(leaf_path(p), patterns), params)

    return mask
