"""The one matrix view of GIFT and PLUMAGE (utils.matrices), optax's dimension-number convention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers

from gift_jax.utils.matrices import MatrixDimensionNumbers, MatrixView, is_dimension_numbers


@pytest.mark.parametrize("reduction_first", [True, False])
def test_view_round_trip_and_orientation(reduction_first):
    x = jax.random.normal(jax.random.key(0), (3, 4, 5, 6))  # (heads?, in, batch, out) mixed
    view = MatrixView.of(x.shape, MatrixDimensionNumbers((1,), (0, 3)), "w")
    assert (view.batch_axes, view.batch, view.n_reduction, view.n_output) == ((2,), 5, 4, 18)
    m = view.to_matrix(x, reduction_first)
    assert m.shape == ((5, 4, 18) if reduction_first else (5, 18, 4))
    # batch slice 2, reduction index 1 = x[:, 1, 2, :] flattened in (axis 0, axis 3) order
    row = m[2, 1] if reduction_first else m[2, :, 1]
    np.testing.assert_array_equal(row, x[:, 1, 2, :].reshape(-1))
    np.testing.assert_array_equal(view.from_matrix(m, reduction_first), x)
    # sizes come from the array: a view serves projected coordinates of other lengths
    y = jnp.zeros((3, 2, 5, 6))
    assert view.to_matrix(y).shape == (5, 2, 18)
    assert view.from_matrix(view.to_matrix(y), shape=y.shape).shape == y.shape


def test_optax_records_accepted_and_bad_axes_named():
    assert is_dimension_numbers(MuonDimensionNumbers(0, 1))
    assert not is_dimension_numbers((0, 1))
    view = MatrixView.of((8, 2, 4), MuonDimensionNumbers(0, (1, 2)), "attn")
    assert (view.n_reduction, view.n_output) == (8, 8)
    for bad in [MatrixDimensionNumbers(0, 0), MatrixDimensionNumbers(0, 3),
                MatrixDimensionNumbers((), 1), MatrixDimensionNumbers((0, 0), 1)]:
        with pytest.raises(ValueError, match="where-it-is: dimension numbers .* do not fit"):
            MatrixView.of((4, 5), bad, "where-it-is")


def test_layer_slice_views_one_layer_of_a_stacked_leaf():
    """A stacked leaf (layers, heads, in, out): the slice's matrices are the stacked view's
    matrices of that layer, in the same order; a leaf whose first axis is not a batch axis
    has no layer slices."""
    x = jnp.arange(3 * 2 * 4 * 5, dtype=jnp.float32).reshape(3, 2, 4, 5)
    stacked = MatrixView.of(x.shape, MatrixDimensionNumbers(2, 3), "t")
    one = stacked.layer_slice()
    assert one.shape == (2, 4, 5) and one.batch == 2
    for layer in range(3):
        np.testing.assert_array_equal(one.to_matrix(x[layer]),
                                      stacked.to_matrix(x).reshape(3, 2, 4, 5)[layer])
        np.testing.assert_array_equal(one.from_matrix(one.to_matrix(x[layer])), x[layer])
    with pytest.raises(ValueError, match="first axis is not a batch axis"):
        MatrixView.of((4, 5), MatrixDimensionNumbers(0, 1), "t").layer_slice()
