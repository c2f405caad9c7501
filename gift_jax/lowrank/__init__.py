"""Low-rank gradient estimators as Optax stages: PLUMAGE (unbiased, min-variance), GaLore, FLORA.

PLUMAGE: "Probabilistic Low rank Unbiased Min-vAriance Gradient Estimator" (arXiv 2505.18313).
``estimator`` holds the pure math, ``layout`` the per-leaf matrix views, ``transform`` the
Optax transformations.
"""

from gift_jax.lowrank.estimator import (
    expected_squared_error,
    flora_projector,
    galore_projector,
    inclusion_probabilities,
    lowrank_estimate,
    plumage_projector,
    projector_overlap,
    realign_moments,
    realignment_matrix,
    systematic_indices,
    systematic_sample,
    transfer_bias_mass,
)
from gift_jax.lowrank.transform import (
    AdaptiveRefresh,
    LeafState,
    PlumageState,
    PlumageTransformation,
    ProjectionAroundAllReduce,
    find_plumage_state,
    plumage,
    refresh_due,
    scale_by_plumage,
)
from gift_jax.lowrank.views import LeafLayout, LowRankDimensionNumbers, mask_excluding

__all__ = [
    "AdaptiveRefresh",
    "LeafLayout",
    "LeafState",
    "LowRankDimensionNumbers",
    "PlumageState",
    "PlumageTransformation",
    "ProjectionAroundAllReduce",
    "expected_squared_error",
    "find_plumage_state",
    "flora_projector",
    "galore_projector",
    "inclusion_probabilities",
    "lowrank_estimate",
    "mask_excluding",
    "plumage",
    "plumage_projector",
    "projector_overlap",
    "realign_moments",
    "realignment_matrix",
    "refresh_due",
    "scale_by_plumage",
    "systematic_indices",
    "systematic_sample",
    "transfer_bias_mass",
]
