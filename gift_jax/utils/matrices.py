"""A parameter seen as a batch of matrices: the one matrix view of GIFT and PLUMAGE.

The convention is optax's (``optax.contrib.MuonDimensionNumbers`` / ``weight_dimension_numbers``):
``reduction_axis`` are the input axes of a kernel (the first axis of a Flax ``(in × out)``
kernel, the side GIFT whitens), ``output_axis`` the output axes, and every other axis is a batch
axis whose slices are independent matrices (e.g. the layer axis of ``nnx.scan``-stacked
kernels). An attention kernel ``(embed, heads, head_dim)`` is ``(reduction 0, output (1, 2))``;
the output projection ``(heads, head_dim, embed)`` is ``((0, 1), 2)``; a stack ``(L, in, out)``
is ``(1, 2)``. optax's own dimension-number records are accepted wherever ours are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MatrixDimensionNumbers", "MatrixView", "is_dimension_numbers"]


class MatrixDimensionNumbers(NamedTuple):
    """Which axes of a parameter form its matrix: input (reduction) and output axes."""

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1


def is_dimension_numbers(x: Any) -> bool:
    """Ours, or any record with ``reduction_axis`` and ``output_axis`` (optax's).

    Args:
      x: any value, e.g. a value of a ``dimension_numbers`` mapping.

    Returns:
      Whether ``x`` is a tuple (a NamedTuple) with ``reduction_axis`` and ``output_axis``.
    """
    return isinstance(x, tuple) and hasattr(x, "reduction_axis") and hasattr(x, "output_axis")


def _as_tuple(ax: Sequence[int] | int) -> tuple[int, ...]:
    return (ax,) if isinstance(ax, int) else tuple(ax)


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """Static view of one leaf as ``(batch, n_reduction, n_output)`` matrices (hashable)."""

    shape: tuple[int, ...]
    batch_axes: tuple[int, ...]
    reduction_axes: tuple[int, ...]
    output_axes: tuple[int, ...]

    @classmethod
    def of(cls, shape: Sequence[int], dims: Any, where: str) -> MatrixView:
        """The view of a leaf of ``shape`` through ``dims``; ``where`` names the leaf and the
        setting in the error raised when the axes are empty, repeated, overlapping or out of
        range.

        Args:
          shape: the leaf's shape.
          dims: a :class:`MatrixDimensionNumbers` or any record with ``reduction_axis`` and
            ``output_axis`` (an int or a sequence of ints each; negative axes count from the
            end).
          where: the prefix of the error message, naming the leaf and the setting.

        Returns:
          The view, its axes normalized to non-negative; every axis in neither set is a batch
          axis, in order.

        Raises:
          ValueError: the reduction or output axes are empty, repeated, overlapping or out of
            range for ``shape``.
        """
        shape = tuple(int(d) for d in shape)
        ndim = len(shape)
        red, out = _as_tuple(dims.reduction_axis), _as_tuple(dims.output_axis)
        norm = lambda axes: tuple(a % ndim for a in axes) if ndim else ()
        ok = (red and out and all(-ndim <= a < ndim for a in red + out)
              and len(set(norm(red))) == len(red) and len(set(norm(out))) == len(out)
              and not set(norm(red)) & set(norm(out)))
        if not ok:
            raise ValueError(
                f"{where}: dimension numbers (reduction_axis={dims.reduction_axis}, "
                f"output_axis={dims.output_axis}) do not fit shape {shape}: reduction and "
                "output axes must be non-empty, distinct, disjoint and in range")
        red, out = norm(red), norm(out)
        batch = tuple(a for a in range(ndim) if a not in red and a not in out)
        return cls(shape, batch, red, out)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.batch_axes)

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def n_reduction(self) -> int:
        return math.prod(self.shape[a] for a in self.reduction_axes)

    @property
    def n_output(self) -> int:
        return math.prod(self.shape[a] for a in self.output_axes)

    def layer_slice(self) -> MatrixView:
        """The view of one slice ``x[l]`` along the leaf's first axis, a batch axis (one layer
        of a leaf stacked over scanned layers): that axis dropped, the others renumbered.

        Returns:
          The slice's view; its matrices are the ``batch / shape[0]`` matrices of one slice,
          in the order :meth:`to_matrix` lists them within the slice.

        Raises:
          ValueError: the first axis is not a batch axis.
        """
        if not self.batch_axes or self.batch_axes[0] != 0:
            raise ValueError(f"a leaf of shape {self.shape} whose first axis is not a batch "
                             "axis has no per-layer slices")
        drop = lambda axes: tuple(a - 1 for a in axes if a != 0)
        return MatrixView(self.shape[1:], drop(self.batch_axes), drop(self.reduction_axes),
                          drop(self.output_axes))

    def _perm(self, reduction_first: bool) -> tuple[int, ...]:
        first, second = ((self.reduction_axes, self.output_axes) if reduction_first
                         else (self.output_axes, self.reduction_axes))
        return self.batch_axes + first + second

    def to_matrix(self, x: jax.Array, reduction_first: bool = True) -> jax.Array:
        """Leaf → ``(batch, n_reduction, n_output)`` (or ``(batch, n_output, n_reduction)``).

        Sizes are read from ``x``, so the view also serves arrays whose axes differ in length
        from the leaf it was made for (e.g. projected coordinates).

        Args:
          x: an array with the leaf's number of axes.
          reduction_first: put the reduction (input) axes in the rows; ``False``: the output
            axes.

        Returns:
          ``x`` with its batch axes flattened in front, then the row axes, then the column axes:
          shape ``(batch, n_reduction, n_output)``, or ``(batch, n_output, n_reduction)``.
        """
        rows = self.reduction_axes if reduction_first else self.output_axes
        size = lambda axes: math.prod(x.shape[a] for a in axes)
        return jnp.transpose(x, self._perm(reduction_first)).reshape(
            size(self.batch_axes), size(rows), -1)

    def from_matrix(self, y: jax.Array, reduction_first: bool = True,
                    shape: Sequence[int] | None = None) -> jax.Array:
        """Inverse of :meth:`to_matrix`, back to ``shape`` (default: the leaf's).

        Args:
          y: a ``(batch, rows, cols)`` array as :meth:`to_matrix` returns it (any shape whose
            size matches ``shape``).
          reduction_first: as given to :meth:`to_matrix`.
          shape: the leaf-layout shape to restore (e.g. a projected leaf's); ``None``: the
            view's ``shape``.

        Returns:
          ``y`` reshaped and transposed back to the leaf's axis order, of shape ``shape``.
        """
        shape = self.shape if shape is None else tuple(shape)
        perm = self._perm(reduction_first)
        inv = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
        return jnp.transpose(y.reshape(tuple(shape[a] for a in perm)), inv)
