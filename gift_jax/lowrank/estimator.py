"""Pure math of the low-rank gradient estimators (PLUMAGE, GaLore, FLORA).

Everything here acts on one matrix in *oriented* layout: the projected side is the first
axis, so a gradient is ``G`` of shape ``(M, N)`` with ``M >= N`` and a projector is ``P`` of
shape ``(M, k)``. Functions are batch-free; the optimizer vmaps them over stacked layers.

PLUMAGE (Probabilistic Low rank Unbiased Min-vAriance Gradient Estimator, arXiv 2505.18313):
with ``G = U diag(σ) Vᵀ`` (σ descending), pick a random set ``S`` of exactly ``k`` singular
directions with inclusion probabilities ``p`` and estimate

    Ĝ = P D⁻¹ Pᵀ G,    P = U[:, S],  D = diag(p_S),

which is unbiased, ``E[Ĝ] = G``, with ``E‖Ĝ − G‖²_F = Σ_i σ_i² (1/p_i − 1)``. Minimising that
variance subject to ``Σ p_i = k`` and ``0 < p_i ≤ 1`` gives the KKT solution of
:func:`inclusion_probabilities`. GaLore (arXiv 2403.03507) is the biased deterministic choice
``S = {1..k}``, ``D = I``; FLORA (arXiv 2402.03293) replaces ``U[:, S]`` by a Gaussian matrix
with ``E[P Pᵀ] = I``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "expected_squared_error",
    "flora_projector",
    "galore_projector",
    "inclusion_probabilities",
    "lowrank_estimate",
    "plumage_projector",
    "projector_overlap",
    "realign_moments",
    "realignment_matrix",
    "systematic_indices",
    "systematic_sample",
    "transfer_bias_mass",
]


def inclusion_probabilities(sigma: jax.Array, k: int) -> jax.Array:
    """Minimum-variance inclusion probabilities for sampling ``k`` of ``len(sigma)`` directions.

    Solves ``min Σ_i σ_i²/p_i`` s.t. ``Σ_i p_i = k``, ``0 ≤ p_i ≤ 1`` (PLUMAGE, arXiv
    2505.18313). With σ sorted descending (1-indexed):

        r* = smallest r ∈ {0..k} with (k − r)·σ_{r+1} ≤ Σ_{j>r} σ_j
        p_i = 1                                  for i ≤ r*
        p_i = (k − r*)·σ_i / Σ_{j>r*} σ_j        for i > r*

    so the ``r*`` dominant directions are always kept and the rest are sampled in proportion
    to their singular value. Degenerate tails: if ``Σ_{j>r*} σ_j = 0`` (rank-deficient or zero
    gradient) the remaining mass ``k − r*`` is spread uniformly over the zero directions —
    any choice is unbiased there because ``G`` has no component along them.

    Args:
      sigma: singular values, shape ``(r,)``, sorted descending, non-negative.
      k: static number of directions to keep, ``1 <= k <= r``.

    Returns:
      ``p`` of shape ``(r,)``, float32, with ``Σ p = k`` (up to rounding) and ``0 ≤ p ≤ 1``.
    """
    sigma = jnp.maximum(jnp.asarray(sigma, jnp.float32), 0.0)
    (r,) = sigma.shape
    if not 1 <= k <= r:
        raise ValueError(f"k must satisfy 1 <= k <= len(sigma)={r}, got k={k}")
    # tail[r'] = Σ_{j >= r'} σ_j (0-indexed), tail[r] = 0.
    tail = jnp.concatenate([jnp.cumsum(sigma[::-1])[::-1], jnp.zeros((1,), jnp.float32)])
    cand = jnp.arange(k + 1)
    sigma_next = jnp.concatenate([sigma, jnp.zeros((1,), jnp.float32)])[cand]
    # Relative slack guards the comparison against rounding in the tail sums.
    ok = (k - cand) * sigma_next <= tail[cand] * (1.0 + 1e-6)
    r_star = jnp.argmax(ok)  # ok[k] is always true
    idx = jnp.arange(r)
    t = tail[r_star]
    remaining = (k - r_star).astype(jnp.float32)
    proportional = remaining * sigma / jnp.where(t > 0, t, 1.0)
    uniform = jnp.full((r,), remaining / jnp.maximum(r - r_star, 1).astype(jnp.float32))
    p_tail = jnp.where(t > 0, proportional, uniform)
    p = jnp.where(idx < r_star, 1.0, p_tail)
    return jnp.clip(p, 0.0, 1.0)


def systematic_sample(key: jax.Array, p: jax.Array, k: int) -> jax.Array:
    """Systematic ("wheel of fortune") sampling of exactly ``k`` distinct indices.

    With ``c = cumsum(p)`` and one uniform ``u ~ U[0, 1)``, index ``i`` is selected iff some
    pointer ``u + j`` (``j = 0..k−1``) falls in ``[c_{i−1}, c_i)``. Because every ``p_i ≤ 1``
    each interval holds at most one pointer, so the ``k`` indices are distinct, and
    ``P(i ∈ S) = p_i`` exactly (Madow 1949; used by PLUMAGE, arXiv 2505.18313).

    Float safety: the last entry of ``c`` is set to exactly ``k`` (a float32 cumsum that rounds
    below ``k`` would let the last pointer run off the end, and JAX silently clamps
    out-of-range gathers into a duplicate index); entries are capped at ``k``; and the sorted
    result is forced strictly increasing inside ``[0, r)`` so that rounding of ``u + j`` can
    never produce a duplicate (these corrections change probabilities only at the ~1e-7 level).

    Args:
      key: PRNG key (identical on every replica for replica-identical projections).
      p: inclusion probabilities, shape ``(r,)``, ``0 ≤ p ≤ 1``, ``Σ p ≈ k``.
      k: static number of indices.

    Returns:
      int32 indices, shape ``(k,)``, strictly increasing.
    """
    u = jax.random.uniform(key, (), jnp.float32)
    return systematic_indices(p, u, k)


def systematic_indices(p: jax.Array, u: jax.Array, k: int) -> jax.Array:
    """Deterministic core of :func:`systematic_sample` for a given offset ``u ∈ [0, 1)``.

    ``S = searchsorted(c, u + arange(k), side="right")`` with ``c = cumsum(p)``, its last
    entry set to exactly ``k``, then forced strictly increasing within ``[0, r)``.

    Args:
      p: inclusion probabilities, shape ``(r,)``, ``0 ≤ p ≤ 1``, ``Σ p ≈ k``.
      u: the pointer offset, a scalar in ``[0, 1)`` (:func:`systematic_sample` draws it).
      k: static number of indices, ``1 <= k <= r``.

    Returns:
      int32 indices, shape ``(k,)``, strictly increasing, index ``j`` in ``[j, r − k + j]``.
    """
    (r,) = p.shape
    c = jnp.cumsum(p.astype(jnp.float32))
    c = jnp.minimum(c, float(k)).at[-1].set(float(k))
    pointers = jnp.asarray(u, jnp.float32) + jnp.arange(k, dtype=jnp.float32)
    idx = jnp.searchsorted(c, pointers, side="right").astype(jnp.int32)
    j = jnp.arange(k, dtype=jnp.int32)
    # Strictly increasing and in range: idx_j ∈ [j, r − k + j].
    idx = jax.lax.cummax(idx - j) + j
    return jnp.clip(idx, j, r - k + j)


def plumage_projector(
    key: jax.Array, u: jax.Array, sigma: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
    """PLUMAGE projector from an SVD: ``P = U[:, S]`` and the kept probabilities ``p_S``.

    Args:
      key: sampling key.
      u: left singular vectors, shape ``(M, r)``.
      sigma: singular values, shape ``(r,)``, descending.
      k: static rank.

    Returns:
      ``(P, p_S)`` with shapes ``(M, k)`` and ``(k,)``; ``D = diag(p_S)``.
    """
    p = inclusion_probabilities(sigma, k)
    s = systematic_sample(key, p, k)
    return u[:, s], p[s]


def galore_projector(u: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """GaLore projector: top-``k`` left singular vectors, ``D = I`` (biased, deterministic).

    Args:
      u: left singular vectors, shape ``(M, r)``, columns by descending singular value.
      k: static rank, ``k <= r``.

    Returns:
      ``(P, p)``: ``u[:, :k]`` of shape ``(M, k)`` and ones of shape ``(k,)`` (float32).
    """
    return u[:, :k], jnp.ones((k,), jnp.float32)


def flora_projector(key: jax.Array, m: int, k: int) -> tuple[jax.Array, jax.Array]:
    """FLORA projector: ``P`` with i.i.d. ``N(0, 1/k)`` entries, so ``E[P Pᵀ] = I``.

    ``P Pᵀ G`` is then an unbiased estimate of ``G`` (arXiv 2402.03293); ``D = I``.

    Args:
      key: PRNG key of the draw (identical on every replica for replica-identical projections).
      m: static number of rows ``M`` (the projected side).
      k: static rank.

    Returns:
      ``(P, p)``: float32 ``P`` of shape ``(m, k)`` and ones of shape ``(k,)``.
    """
    p = jax.random.normal(key, (m, k), jnp.float32) / jnp.sqrt(jnp.float32(k))
    return p, jnp.ones((k,), jnp.float32)


def lowrank_estimate(g: jax.Array, proj: jax.Array, probs: jax.Array) -> jax.Array:
    """The low-rank estimate ``Ĝ = P D⁻¹ Pᵀ G`` with ``D = diag(probs)``.

    Zero probabilities (never sampled in exact arithmetic) contribute nothing.

    Args:
      g: the gradient ``G``, shape ``(n, m)``.
      proj: the sampled orthonormal directions ``P``, shape ``(n, k)``.
      probs: their inclusion probabilities, shape ``(k,)``.

    Returns:
      ``Ĝ`` of ``g``'s shape.
    """
    inv = jnp.where(probs > 0, 1.0 / jnp.where(probs > 0, probs, 1.0), 0.0)
    return proj @ (inv[:, None] * (proj.T @ g))


def expected_squared_error(sigma: jax.Array, p: jax.Array) -> jax.Array:
    """Closed-form variance of the PLUMAGE estimator: ``E‖Ĝ − G‖²_F = Σ_i σ_i² (1/p_i − 1)``.

    Directions with ``σ_i = 0`` contribute 0 whatever ``p_i``; ``σ_i > 0`` with ``p_i = 0``
    gives ``inf`` (the estimator would be biased there).

    Args:
      sigma: singular values ``σ`` of ``G``, shape ``(n,)`` (as :func:`inclusion_probabilities`
        takes them).
      p: inclusion probabilities ``p_i`` of the same shape.

    Returns:
      ``E‖Ĝ − G‖²_F``, an fp32 scalar (the sum over every entry: a batched ``sigma`` gives the
      total over the batch, not one value per matrix).
    """
    sigma = jnp.asarray(sigma, jnp.float32)
    terms = jnp.where(
        sigma > 0, sigma**2 * (1.0 / jnp.where(p > 0, p, 0.0) - 1.0), jnp.zeros_like(sigma)
    )
    return jnp.sum(terms)


def realignment_matrix(new_proj: jax.Array, old_proj: jax.Array) -> jax.Array:
    """``B = P₂ᵀ P₁`` (shape ``(k, k)``): maps coordinates in the old basis to the new one.

    A moment ``M`` with full-space meaning ``P₁ M`` has coordinates ``P₂ᵀ P₁ M = B M`` in the
    new basis (its orthogonal projection when ``P₂`` is orthonormal).

    Args:
      new_proj: the new projector ``P₂``, shape ``(M, k)``.
      old_proj: the old projector ``P₁``, shape ``(M, k)``.

    Returns:
      ``B``, shape ``(k, k)``.
    """
    return new_proj.T @ old_proj


def realign_moments(
    b: jax.Array, mu: jax.Array, nu: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Carry Adam moments across a projection change (PLUMAGE): ``M ← B M``, ``V ← (B∘B) V``.

    The second-moment rule is the diagonal of ``B diag(v) Bᵀ`` — exact when the coordinates
    are uncorrelated — and keeps ``V ≥ 0``.

    Args:
      b: the realignment matrix ``B`` of :func:`realignment_matrix`, shape ``(k, k)``.
      mu: the first moment ``M`` in the old coordinates, shape ``(k, N)``.
      nu: the second moment ``V`` in the old coordinates, shape ``(k, N)``.

    Returns:
      ``(B M, (B∘B) V)``, the moments in the new coordinates, shapes as ``mu`` and ``nu``.
    """
    return b @ mu, (b * b) @ nu


def transfer_bias_mass(b_normalized: jax.Array, mass: jax.Array) -> jax.Array:
    """Per-row Adam bias-correction mass after a projection change.

    Adam's bias correction divides an EMA by its accumulated weight ``1 − βᵗ`` ("mass").
    A new direction ``i`` inherits the old moments only through the part of it that lies in
    the old subspace, so its mass becomes ``Σ_j B̃_ij² mass_j`` (clipped to ``[0, 1]``), with
    ``B̃`` built from unit-norm columns. A direction orthogonal to the old subspace restarts
    from zero mass, so its first bias-corrected step has the normal size instead of being
    ``1/(1 − β)`` times too small/large.

    Args:
      b_normalized: ``B̃ = P̃₂ᵀ P̃₁`` of the unit-norm columns of the new and old projectors,
        shape ``(k, k)``.
      mass: per-row mass ``1 − βᵗ`` in the old basis, shape ``(k,)``.

    Returns:
      The per-row mass in the new basis, shape ``(k,)``, in ``[0, 1]``.
    """
    return jnp.clip((b_normalized * b_normalized) @ mass, 0.0, 1.0)


def projector_overlap(new_proj: jax.Array, old_proj: jax.Array) -> jax.Array:
    """Mean squared cosine of the principal angles between ``span(P₁)`` and ``span(P₂)``.

    For orthonormal ``P₁, P₂`` (k columns each) the cosines are the singular values of
    ``P₂ᵀ P₁``, so the mean of their squares is ``‖P₂ᵀ P₁‖²_F / k``: 1 for the same subspace,
    0 for orthogonal ones.

    Args:
      new_proj: ``P₂``, shape ``(M, k)``, orthonormal columns.
      old_proj: ``P₁``, shape ``(M, k)``, orthonormal columns.

    Returns:
      A scalar in ``[0, 1]`` (for orthonormal inputs).
    """
    k = new_proj.shape[-1]
    return jnp.sum(jnp.square(new_proj.T @ old_proj)) / k
