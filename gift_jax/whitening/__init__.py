"""GIFT (arXiv 2607.07494): whiten selected layers' gradients with their input-side K-FAC
factor around the quantized all-reduce.

``factors`` (pure math: factor forms, whiten/unwhiten; re-exported here) → ``stage`` (the
``gift`` Optax stage) ; ``capture`` (K-FAC statistics from a model) ; ``fidelity`` (round-trip
error metrics).
"""

from gift_jax.whitening import factors as _factors
from gift_jax.whitening.factors import *  # noqa: F403  (the pure math, as gift_jax.whitening.X)

__all__ = list(_factors.__all__)
