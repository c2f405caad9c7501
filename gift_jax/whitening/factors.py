"""Whitening factors for GIFT (arXiv 2607.07494): pure functions, no state.

GIFT moves the gradient of a linear layer into near-isotropic coordinates before it is cast
to a low-precision format and communicated, using the input-side K-FAC factor

    A = E[x xᵀ]   (n×n, fp32, x the layer input flattened over batch and sequence).

A *whitener* is a matrix W with W Â Wᵀ = I for a damped model Â of A.  Flax kernels are
(in × out), so a kernel gradient G (n×m) is whitened on its FIRST axis, ``whiten(W, G) = W·G``,
and mapped back with ``unwhiten(W, G) = W⁻¹·G``.  (The artifact's torch layout (out×in) uses
``G·L⁻ᵀ`` and ``·Lᵀ``; transposed, that is ``L⁻¹·G`` and ``L·G`` here.)

Factor forms (each a small NamedTuple pytree; every leaf is fp32):

==============================  ====================================================  ========
form                            model Â of A and whitener W                           apply
==============================  ====================================================  ========
``DenseFactor`` (cholesky)      Â = A + εI = L Lᵀ,  W = L⁻¹ (as in the artifact)      O(n²m)
``DenseFactor`` (symmetric)     Â = A + εI,  W = Â^{-1/2}                              O(n²m)
``DiagFactor``                  Â = diag(A) + εI,  W = Â^{-1/2}                        O(nm)
``BlockDiagFactor``             Â = blockdiag_b(A) + εI (ragged last block)            O(nbm)
``LowRankIsotropicFactor``      Â = UΛUᵀ + ρ(I − UUᵀ) + εI,  W = Â^{-1/2}               O(nrm)
``LowRankDiagFactor``           Â = UΛUᵀ + D,  D = max(diag(A − UΛUᵀ), 0) + εI,        O(nrm)
                                W = (I + QSQᵀ)^{-1/2} D^{-1/2}
``KroneckerFactor``             two-sided K-FAC: W_A · G · W_Bᵀ (B = E[δ δᵀ])          sum
==============================  ====================================================  ========

Here (λ_i, u_i) are the top-r eigenpairs of A and ρ = (tr A − Σλ_i)/(n − r) is the mean of the
remaining eigenvalues (the isotropic remainder keeps the trace).  For the diagonal remainder,
D^{-1/2} U Λ^{1/2} = Q Σ Vᵀ (thin SVD, n×r) gives Â = D^{1/2}(I + Q S Qᵀ)D^{1/2} with S = Σ², so
W Â Wᵀ = I exactly and W, W⁻¹ = D^{1/2}(I + Q((1+S)^{1/2} − 1)Qᵀ) apply in O(n·r) per column.
A Cholesky factor of a low-rank-plus-diagonal matrix is dense, so low-rank forms use these
factored square roots instead; which square root is used matters because FP8 rounding error is
not rotation invariant, so it is a setting (``sqrt="cholesky" | "symmetric"``) for the dense and
block forms.

Damping ε: ``damping_mode="relative"`` (default) uses ε = damping · tr(A)/n (damping relative to
the mean eigenvalue, scale-free); ``"absolute"`` uses ε = damping (the artifact: 1e-3).

Robustness (:func:`make_factor`): non-finite statistics, or a factor that comes out non-finite
(e.g. a Cholesky breakdown of an ill-conditioned A), fall back first to 100× the damping, then to
the identity (the Euclidean frame for that layer); the returned status says which (0 ok,
1 larger damping, 2 identity) so the caller can count it.

Top-r eigenpairs: exact ``jnp.linalg.eigh`` (O(n³)) or, without an eigendecomposition of A,
randomized subspace iteration (:func:`subspace_iteration`) that needs only products A·Q (from A,
or from activations X: A·Q = Xᵀ(X·Q)/N) and can be warm-started from the previous factor's U.
``rank >= n`` always gives the exact full factor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gift_jax.utils.axes import cond
from gift_jax.utils.linalg import map_matrices, matmul_highest

__all__ = [
    "BlockDiagFactor",
    "DenseFactor",
    "DiagFactor",
    "FACTOR_KINDS",
    "KroneckerFactor",
    "LowRankDiagFactor",
    "LowRankIsotropicFactor",
    "absolute_damping",
    "block_diag_factor",
    "dense_factor",
    "dense_matrix",
    "diag_factor",
    "factor_is_finite",
    "identity_factor",
    "kronecker_factor",
    "lowrank_diag_factor",
    "lowrank_isotropic_factor",
    "make_factor",
    "second_moment",
    "subspace_iteration",
    "top_eigenpairs",
    "unwhiten",
    "whiten",
]

FACTOR_KINDS = (
    "full_cholesky",
    "full_symmetric",
    "diag",
    "block_diag",
    "lowrank_isotropic",
    "lowrank_diag",
)
_SQRTS = ("cholesky", "symmetric")
_DAMPING_MODES = ("relative", "absolute")
EIG_METHODS = ("eigh", "subspace")


# --------------------------------------------------------------------------------------------
# Factor pytrees.  Shapes are for one layer with input width n; stacked layers vmap over them.
# --------------------------------------------------------------------------------------------


class DenseFactor(NamedTuple):
    """Dense whitener: W (Cholesky ``L⁻¹`` or symmetric ``Â^{-1/2}``) and its inverse."""

    w: jax.Array  # (n, n) f32: W
    w_inv: jax.Array  # (n, n) f32: W⁻¹


class DiagFactor(NamedTuple):
    """Diagonal whitener W = diag(scale), scale_i = (A_ii + ε)^{-1/2}."""

    scale: jax.Array  # (n,) f32


class BlockDiagFactor(NamedTuple):
    """Block-diagonal whitener; n is padded to nb·b, padded rows/columns are identity."""

    w: jax.Array  # (nb, b, b) f32: per-block W
    w_inv: jax.Array  # (nb, b, b) f32: per-block W⁻¹


class LowRankIsotropicFactor(NamedTuple):
    """W = c_rest·I + U diag(c_top − c_rest) Uᵀ, i.e. U diag(c_top) Uᵀ + c_rest(I − UUᵀ).

    With c_top = (λ+ε)^{-1/2}, c_rest = (ρ+ε)^{-1/2}; W⁻¹ uses the reciprocals.
    """

    u: jax.Array  # (n, r) f32: orthonormal top eigenvectors of A
    c_top: jax.Array  # (r,) f32: (λ_i + ε)^{-1/2}
    c_rest: jax.Array  # () f32: (ρ + ε)^{-1/2}


class LowRankDiagFactor(NamedTuple):
    """W = (I + Q S Qᵀ)^{-1/2} D^{-1/2};  W⁻¹ = D^{1/2} (I + Q S Qᵀ)^{1/2}."""

    d_inv_sqrt: jax.Array  # (n,) f32: D^{-1/2}
    q: jax.Array  # (n, r) f32: orthonormal columns
    s: jax.Array  # (r,) f32: S ≥ 0


class KroneckerFactor(NamedTuple):
    """Two-sided K-FAC whitener G ↦ W_A · G · W_Bᵀ (input side A, output side B = E[δδᵀ])."""

    left: NamedTuple  # factor of A (acts on axis 0 of G)
    right: NamedTuple  # factor of B (acts on axis 1 of G)


# --------------------------------------------------------------------------------------------
# Statistics and damping.
# --------------------------------------------------------------------------------------------


def second_moment(x: jax.Array) -> jax.Array:
    """A = E[x xᵀ] = Xᵀ X / N in fp32 for inputs x (..., n) flattened over leading axes.

    Args:
      x: a layer's inputs, shape (..., n), any float dtype; the N rows are every index of the
        leading axes (batch, sequence, ...).

    Returns:
      A, shape (n, n), fp32.
    """
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return jnp.einsum("ti,tj->ij", x, x, precision=jax.lax.Precision.HIGHEST) / x.shape[0]


def absolute_damping(a: jax.Array, damping: float, mode: str = "relative") -> jax.Array:
    """ε = damping · tr(A)/n (``"relative"``) or ε = damping (``"absolute"``).

    Args:
      a: the statistic A (n × n); only its trace is read, and only in ``"relative"`` mode.
      damping: the damping coefficient (not checked here; :func:`make_factor` requires > 0).
      mode: ``"relative"`` (to the mean eigenvalue tr(A)/n) or ``"absolute"``.

    Returns:
      ε, a () fp32 (0 for an all-zero A in ``"relative"`` mode).

    Raises:
      ValueError: an unknown ``mode``.
    """
    if mode not in _DAMPING_MODES:
        raise ValueError(f"damping_mode must be one of {_DAMPING_MODES}, got {mode!r}")
    if mode == "absolute":
        return jnp.asarray(damping, jnp.float32)
    return damping * jnp.trace(a).astype(jnp.float32) / a.shape[-1]


def _sym(a: jax.Array) -> jax.Array:
    a = a.astype(jnp.float32)
    return 0.5 * (a + a.T)


_hi = matmul_highest


# --------------------------------------------------------------------------------------------
# Builders: A (n×n) and ε → factor.
# --------------------------------------------------------------------------------------------


def dense_factor(
    a: jax.Array,
    eps: jax.Array,
    sqrt: str = "cholesky",
    eig: tuple[jax.Array, jax.Array] | None = None,
) -> DenseFactor:
    """Full-A whitener of Â = A + εI: Cholesky W = L⁻¹ or symmetric W = Â^{-1/2}.

    ``eig = (λ, U)`` (ascending, of A itself) reuses an eigendecomposition for the symmetric
    root, so a retry with a larger ε costs no second ``eigh``.

    Args:
      a: the statistic A (n × n), symmetrised and cast to fp32 here.
      eps: the damping ε (a () array or float, already absolute).
      sqrt: ``"cholesky"`` (W = L⁻¹, W⁻¹ = L) or ``"symmetric"`` (W = Â^{-1/2}).
      eig: ``(λ (n,), U (n, n))`` as ``jnp.linalg.eigh(A)`` returns them, read by
        ``"symmetric"`` only; ``None`` computes them.

    Returns:
      A :class:`DenseFactor` ``(w, w_inv)``, each (n, n) fp32; not finite when the Cholesky
      factorisation of Â breaks down (:func:`make_factor` checks and retries).

    Raises:
      ValueError: an unknown ``sqrt``.
    """
    if sqrt not in _SQRTS:
        raise ValueError(f"sqrt must be one of {_SQRTS}, got {sqrt!r}")
    n = a.shape[-1]
    ad = _sym(a) + eps * jnp.eye(n, dtype=jnp.float32)
    if sqrt == "cholesky":
        chol = jnp.linalg.cholesky(ad)
        w = jax.scipy.linalg.solve_triangular(chol, jnp.eye(n, dtype=jnp.float32), lower=True)
        return DenseFactor(w=w, w_inv=chol)
    lam, u = jnp.linalg.eigh(_sym(a)) if eig is None else eig
    lam = jnp.maximum(lam + eps, eps)  # Â = A + εI with A PSD: clip rounding below ε
    return DenseFactor(w=_hi(u * lam**-0.5, u.T), w_inv=_hi(u * lam**0.5, u.T))


def diag_factor(a: jax.Array, eps: jax.Array) -> DiagFactor:
    """Diagonal whitener of Â = diag(A) + εI.

    Args:
      a: the statistic A (n × n); only its diagonal is read (negative entries clipped to 0).
      eps: the damping ε (already absolute).

    Returns:
      A :class:`DiagFactor` with ``scale`` = (diag(A) + ε)^{-1/2}, shape (n,), fp32.
    """
    return DiagFactor(scale=(jnp.maximum(jnp.diagonal(a).astype(jnp.float32), 0.0) + eps) ** -0.5)


def block_diag_factor(
    a: jax.Array, eps: jax.Array, block_size: int = 128, sqrt: str = "cholesky"
) -> BlockDiagFactor:
    """Block-diagonal whitener (blocks of ``block_size`` along the diagonal of A, the last one
    ragged: padded with identity rows/columns, which whiten to themselves up to 1/√(1+ε)).

    Args:
      a: the statistic A (n × n); entries outside the diagonal blocks are ignored.
      eps: the damping ε (already absolute), added to every block.
      block_size: the block width b (clamped to n).
      sqrt: the square root of each block, as :func:`dense_factor`.

    Returns:
      A :class:`BlockDiagFactor` ``(w, w_inv)``, each (nb, b, b) fp32 with nb = ⌈n/b⌉.

    Raises:
      ValueError: ``block_size < 1``, or an unknown ``sqrt``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = a.shape[-1]
    b = min(block_size, n)
    nb = -(-n // b)
    pad = nb * b - n
    ap = jnp.pad(_sym(a), ((0, pad), (0, pad)))
    ap = ap + jnp.diag(jnp.concatenate([jnp.zeros(n), jnp.ones(pad)]).astype(jnp.float32))
    idx = jnp.arange(nb)
    blocks = ap.reshape(nb, b, nb, b)[idx, :, idx, :]  # (nb, b, b)
    f = map_matrices(lambda blk: dense_factor(blk, eps, sqrt), blocks)
    return BlockDiagFactor(w=f.w, w_inv=f.w_inv)


def _residual_level(a: jax.Array, lam: jax.Array) -> jax.Array:
    """ρ = (tr A − Σ top λ)/(n − r), floored at 0 (mean of the discarded eigenvalues)."""
    n, r = a.shape[-1], lam.shape[-1]
    return jnp.maximum((jnp.trace(a) - jnp.sum(lam)) / max(n - r, 1), 0.0)


def lowrank_isotropic_factor(
    a: jax.Array, eps: jax.Array, u: jax.Array, lam: jax.Array
) -> LowRankIsotropicFactor:
    """Â^{-1/2} = U(Λ+ε)^{-1/2}Uᵀ + (ρ+ε)^{-1/2}(I − UUᵀ) from top eigenpairs (u, lam) of A.

    Args:
      a: the statistic A (n × n); only its trace is read (for ρ).
      eps: the damping ε (already absolute).
      u: the top eigenvectors of A, (n, r), orthonormal columns.
      lam: their eigenvalues, (r,) (negative values, from rounding, are clipped to 0).

    Returns:
      A :class:`LowRankIsotropicFactor` ``(u, c_top, c_rest)`` of shapes (n, r), (r,), (),
      fp32.
    """
    lam = jnp.maximum(lam.astype(jnp.float32), 0.0)
    rho = _residual_level(_sym(a), lam)
    return LowRankIsotropicFactor(
        u=u.astype(jnp.float32), c_top=(lam + eps) ** -0.5, c_rest=(rho + eps) ** -0.5
    )


def lowrank_diag_factor(
    a: jax.Array, eps: jax.Array, u: jax.Array, lam: jax.Array
) -> LowRankDiagFactor:
    """Factored W = (I + QSQᵀ)^{-1/2} D^{-1/2} for Â = UΛUᵀ + D (never forms an n×n matrix
    beyond reading diag(A)):  D = max(diag(A) − Σ λ_i u_i², 0) + ε,
    D^{-1/2} U Λ^{1/2} = Q Σ Vᵀ, S = Σ².

    Args:
      a: the statistic A (n × n); only its diagonal is read.
      eps: the damping ε (already absolute), added to D.
      u: the top eigenvectors of A, (n, r), orthonormal columns.
      lam: their eigenvalues, (r,) (negative values, from rounding, are clipped to 0).

    Returns:
      A :class:`LowRankDiagFactor` ``(d_inv_sqrt, q, s)`` of shapes (n,), (n, r), (r,), fp32.
    """
    lam = jnp.maximum(lam.astype(jnp.float32), 0.0)
    u = u.astype(jnp.float32)
    resid = jnp.diagonal(a).astype(jnp.float32) - jnp.sum(u * u * lam, axis=-1)
    d = jnp.maximum(resid, 0.0) + eps
    b = (d**-0.5)[:, None] * u * jnp.sqrt(lam)
    q, sig, _ = jnp.linalg.svd(b, full_matrices=False)
    return LowRankDiagFactor(d_inv_sqrt=d**-0.5, q=q, s=sig**2)


def identity_factor(kind: str, n: int, rank: int = 0, block_size: int = 128) -> NamedTuple:
    """The identity (Euclidean) whitener of the given kind and width: before the first refresh
    and the last-resort fallback.

    Args:
      kind: one of :data:`FACTOR_KINDS`.
      n: the input width (the factor's side).
      rank: r of the low-rank kinds (the basis is the first r unit vectors); ``rank >= n``
        gives the dense identity, as :func:`make_factor` builds a dense factor then.
      block_size: the block width of ``"block_diag"`` (clamped to n).

    Returns:
      The factor pytree of that kind (the same structure and shapes :func:`make_factor`
      returns) with W = W⁻¹ = I, fp32.

    Raises:
      ValueError: an unknown ``kind``.
    """
    eye = jnp.eye(n, dtype=jnp.float32)
    if kind in ("full_cholesky", "full_symmetric") or (kind.startswith("lowrank") and rank >= n):
        return DenseFactor(w=eye, w_inv=eye)
    if kind == "diag":
        return DiagFactor(scale=jnp.ones((n,), jnp.float32))
    if kind == "block_diag":
        b = min(block_size, n)
        nb = -(-n // b)
        e = jnp.broadcast_to(jnp.eye(b, dtype=jnp.float32), (nb, b, b))
        return BlockDiagFactor(w=e, w_inv=e)
    u = jnp.eye(n, rank, dtype=jnp.float32)
    if kind == "lowrank_isotropic":
        return LowRankIsotropicFactor(
            u=u, c_top=jnp.ones((rank,), jnp.float32), c_rest=jnp.ones((), jnp.float32)
        )
    if kind == "lowrank_diag":
        return LowRankDiagFactor(
            d_inv_sqrt=jnp.ones((n,), jnp.float32), q=u, s=jnp.zeros((rank,), jnp.float32)
        )
    raise ValueError(f"factor must be one of {FACTOR_KINDS}, got {kind!r}")


def kronecker_factor(left: NamedTuple, right: NamedTuple) -> KroneckerFactor:
    """Two-sided K-FAC factor from an input-side factor and an output-side factor.

    Args:
      left: the factor of A = E[x xᵀ] (n-wide; acts on axis 0 of G).
      right: the factor of B = E[δ δᵀ] (m-wide; acts on axis 1 of G).

    Returns:
      The :class:`KroneckerFactor`, which whitens G (n × m) to W_A · G · W_Bᵀ.
    """
    return KroneckerFactor(left=left, right=right)


# --------------------------------------------------------------------------------------------
# Top-r eigenpairs.
# --------------------------------------------------------------------------------------------


def subspace_iteration(
    matmul: Callable[[jax.Array], jax.Array],
    n: int,
    rank: int,
    key: jax.Array,
    *,
    init: jax.Array | None = None,
    oversample: int = 8,
    iters: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Top-``rank`` eigenpairs of a PSD A known only through ``matmul(Q) = A·Q`` (Halko,
    Martinsson & Tropp 2011, Alg. 4.4 + Rayleigh–Ritz).

    Q₀ = [init | Gaussian] (n × (rank+oversample)); Q ← qr(A·Q) ``iters`` times (plus one for
    the range); T = Qᵀ A Q; eigh(T) = V Θ Vᵀ; returns (Q V)[:, top], Θ[top], descending.  Cost
    (iters+2)·(n²·(r+p)) flops from A (or (iters+2)·2·N·n·(r+p) from activations X) + O(n(r+p)²),
    against O(n³) for eigh.  ``init`` (the previous factor's U) warm-starts it.

    Args:
      matmul: ``Q (n, k) ↦ A·Q (n, k)`` in fp32, for the PSD A (n × n).
      n: the width of A.
      rank: r, the number of eigenpairs wanted.
      key: PRNG key of the Gaussian start Q₀.
      init: (n, r₀) columns to put first in Q₀ (r₀ ≤ k), or ``None`` for a Gaussian Q₀.
      oversample: p, extra columns of Q (k = min(r + p, n)).
      iters: power iterations after the first product (0: the range of A·Q₀ only).

    Returns:
      ``(U, λ)``: U (n, min(r, k)) with orthonormal columns and λ (min(r, k),), descending,
      fp32.
    """
    k = min(rank + oversample, n)
    omega = jax.random.normal(key, (n, k), jnp.float32)
    if init is not None:
        omega = omega.at[:, : init.shape[1]].set(init.astype(jnp.float32))
    q, _ = jnp.linalg.qr(matmul(omega))
    for _ in range(iters):
        q, _ = jnp.linalg.qr(matmul(q))
    aq = matmul(q)
    t = _hi(q.T, aq)
    theta, v = jnp.linalg.eigh(0.5 * (t + t.T))
    order = jnp.argsort(-theta)[:rank]
    return _hi(q, v[:, order]), theta[order]


def top_eigenpairs(
    a: jax.Array,
    rank: int,
    method: str = "eigh",
    *,
    key: jax.Array | None = None,
    init: jax.Array | None = None,
    oversample: int = 8,
    iters: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Top-``rank`` eigenpairs (U (n×r), λ (r,), descending) of the symmetric A (n×n).

    Args:
      a: A (n × n), symmetrised and cast to fp32 here.
      rank: r, the number of eigenpairs (at most n are returned).
      method: ``"eigh"`` (exact, O(n³)) or ``"subspace"`` (:func:`subspace_iteration`).
      key: PRNG key of ``"subspace"``; ``None`` uses ``jax.random.key(0)``.
      init: ``"subspace"`` only: warm-start columns (n, r₀), e.g. the previous U, or ``None``.
      oversample, iters: ``"subspace"`` only, as :func:`subspace_iteration`.

    Returns:
      ``(U, λ)``: U (n, min(r, n)) and λ (min(r, n),), descending.

    Raises:
      ValueError: an unknown ``method``.
    """
    if method not in EIG_METHODS:
        raise ValueError(f"eig_method must be one of {EIG_METHODS}, got {method!r}")
    a = _sym(a)
    if method == "eigh":
        lam, u = jnp.linalg.eigh(a)
        return u[:, ::-1][:, :rank], lam[::-1][:rank]
    if key is None:
        key = jax.random.key(0)
    return subspace_iteration(
        lambda q: _hi(a, q), a.shape[-1], rank, key, init=init, oversample=oversample, iters=iters
    )


# --------------------------------------------------------------------------------------------
# Apply: W·G and W⁻¹·G on the first axis of G (n, m).
# --------------------------------------------------------------------------------------------


def _apply_blocks(blocks: jax.Array, g: jax.Array) -> jax.Array:
    nb, b, _ = blocks.shape
    n = g.shape[0]
    gp = jnp.pad(g, ((0, nb * b - n),) + ((0, 0),) * (g.ndim - 1))
    out = jnp.einsum(
        "kij,kj...->ki...", blocks, gp.reshape((nb, b) + g.shape[1:]),
        precision=jax.lax.Precision.HIGHEST,
    )
    return out.reshape((nb * b,) + g.shape[1:])[:n]


def _lowrank_apply(u, coef, base, g):
    """base·G + U diag(coef) Uᵀ G in O(n·r·m)."""
    return base * g + _hi(u, coef[:, None] * _hi(u.T, g))


def _apply(f: NamedTuple, g: jax.Array, inverse: bool) -> jax.Array:
    g = g.astype(jnp.float32)
    if isinstance(f, DenseFactor):
        return _hi(f.w_inv if inverse else f.w, g)
    if isinstance(f, DiagFactor):
        return (g / f.scale[:, None]) if inverse else (g * f.scale[:, None])
    if isinstance(f, BlockDiagFactor):
        return _apply_blocks(f.w_inv if inverse else f.w, g)
    if isinstance(f, LowRankIsotropicFactor):
        if inverse:
            return _lowrank_apply(f.u, 1.0 / f.c_top - 1.0 / f.c_rest, 1.0 / f.c_rest, g)
        return _lowrank_apply(f.u, f.c_top - f.c_rest, f.c_rest, g)
    if isinstance(f, LowRankDiagFactor):
        if inverse:
            h = _lowrank_apply(f.q, jnp.sqrt(1.0 + f.s) - 1.0, 1.0, g)
            return h / f.d_inv_sqrt[:, None]
        h = g * f.d_inv_sqrt[:, None]
        return _lowrank_apply(f.q, jax.lax.rsqrt(1.0 + f.s) - 1.0, 1.0, h)
    if isinstance(f, KroneckerFactor):
        return _apply(f.right, _apply(f.left, g, inverse).T, inverse).T
    raise TypeError(f"not a whitening factor: {type(f).__name__}")


def whiten(factor: NamedTuple, g: jax.Array) -> jax.Array:
    """W·G on the first (input) axis of the kernel gradient G (n, m); fp32.

    Args:
      factor: one matrix's factor (any form of this module, no batch axis; vmap for stacked
        layers).
      g: G (n, m), any float dtype (computed in fp32).

    Returns:
      W·G (n, m), fp32 (W_A · G · W_Bᵀ for a :class:`KroneckerFactor`).

    Raises:
      TypeError: ``factor`` is not a factor of this module.
    """
    return _apply(factor, g, inverse=False)


def unwhiten(factor: NamedTuple, g: jax.Array) -> jax.Array:
    """W⁻¹·G on the first (input) axis of G (n, m); fp32.

    Args:
      factor: one matrix's factor (any form of this module, no batch axis).
      g: G (n, m), e.g. a reduced whitened gradient, any float dtype (computed in fp32).

    Returns:
      W⁻¹·G (n, m), fp32 (W_A⁻¹ · G · W_B⁻ᵀ for a :class:`KroneckerFactor`).

    Raises:
      TypeError: ``factor`` is not a factor of this module.
    """
    return _apply(factor, g, inverse=True)


def dense_matrix(factor: NamedTuple, n: int) -> jax.Array:
    """The dense W (n×n) of a one-sided factor (for tests and diagnostics: O(n²) memory).

    Args:
      factor: a one-sided factor (not a :class:`KroneckerFactor`), no batch axis.
      n: its width.

    Returns:
      W, (n, n) fp32.
    """
    return whiten(factor, jnp.eye(n, dtype=jnp.float32))


def factor_is_finite(factor: NamedTuple) -> jax.Array:
    """True iff every leaf of the factor is finite.

    Args:
      factor: a factor pytree (any form, stacked or not).

    Returns:
      A () bool array (traceable: usable under ``jit``).
    """
    leaves = jax.tree.leaves(factor)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


# --------------------------------------------------------------------------------------------
# One entry point with fallback.
# --------------------------------------------------------------------------------------------


def _dense_kind(kind: str, n: int, rank: int, sqrt: str) -> str | None:
    """'cholesky' / 'symmetric' when ``kind`` resolves to a dense factor, else None."""
    if kind == "full_cholesky":
        return "cholesky"
    if kind == "full_symmetric":
        return "symmetric"
    if kind.startswith("lowrank") and rank >= n:
        return sqrt
    return None


def _build(
    kind, a, eps, *, rank, block_size, sqrt, eig_method, key, init, oversample, iters, eigenpairs
):
    n = a.shape[-1]
    dense = _dense_kind(kind, n, rank, sqrt)
    if dense is not None:
        return dense_factor(a, eps, dense, eig=eigenpairs)
    if kind == "diag":
        return diag_factor(a, eps)
    if kind == "block_diag":
        return block_diag_factor(a, eps, block_size, sqrt)
    if eigenpairs is None:
        eigenpairs = top_eigenpairs(
            a, rank, eig_method, key=key, init=init, oversample=oversample, iters=iters
        )
    u, lam = eigenpairs
    if kind == "lowrank_isotropic":
        return lowrank_isotropic_factor(a, eps, u, lam)
    if kind == "lowrank_diag":
        return lowrank_diag_factor(a, eps, u, lam)
    raise ValueError(f"factor must be one of {FACTOR_KINDS}, got {kind!r}")


def make_factor(
    a: jax.Array,
    kind: str = "lowrank_isotropic",
    *,
    rank: int = 32,
    damping: float = 1e-3,
    damping_mode: str = "relative",
    block_size: int = 128,
    sqrt: str = "cholesky",
    eig_method: str = "eigh",
    key: jax.Array | None = None,
    init: jax.Array | None = None,
    oversample: int = 8,
    iters: int = 2,
    fallback_factor: float = 100.0,
    eigenpairs: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[NamedTuple, jax.Array]:
    """Whitener of A (n×n) of the given ``kind`` (one of :data:`FACTOR_KINDS`), with fallback.

    Returns ``(factor, status)``: status 0 = built with ε; 1 = A was fine but the factor was not
    finite, rebuilt with ``fallback_factor``·ε; 2 = identity (A non-finite, or both failed).
    ``rank >= n`` for the low-rank kinds gives the exact dense factor (``sqrt`` chooses which).
    ``sqrt`` applies to ``"block_diag"`` and to the low-rank kinds at ``rank >= n``; the
    ``"full_*"`` kinds name their own square root, and low-rank forms (``rank < n``) are
    symmetric square roots.
    ``eigenpairs=(U, λ)`` reuses top eigenpairs computed by the caller (low-rank kinds).

    Args:
      a: the statistic A (n × n), any float dtype (computed in fp32).
      kind: the factor form, one of :data:`FACTOR_KINDS`.
      rank: r of the low-rank kinds.
      damping: the damping coefficient, > 0 (ε as :func:`absolute_damping`).
      damping_mode: ``"relative"`` (ε = damping · tr(A)/n) or ``"absolute"`` (ε = damping).
      block_size: the block width of ``"block_diag"``.
      sqrt: ``"cholesky"`` or ``"symmetric"``: the square root of ``"block_diag"`` and of the
        dense factor a low-rank kind gives at ``rank >= n`` (``"full_*"`` kinds name theirs).
      eig_method: ``"eigh"`` or ``"subspace"``, the eigensolver of the low-rank kinds.
      key: PRNG key of the ``"subspace"`` eigensolver (``None``: ``jax.random.key(0)``).
      init: warm-start columns (n, r₀) of the ``"subspace"`` eigensolver, or ``None``.
      oversample, iters: of the ``"subspace"`` eigensolver (:func:`subspace_iteration`).
      fallback_factor: the multiple of ε of the retry.
      eigenpairs: ``(U (n, r), λ (r,))``, descending, as :func:`top_eigenpairs` returns
        them; ``None`` computes them.  Ignored by the non-low-rank kinds and when
        ``rank >= n``.

    Returns:
      ``(factor, status)``: the factor pytree (fp32; the identity when ``status`` is 2) and a
      () int32 status as above; an A whose ε is not positive (e.g. all zeros under relative
      damping) gets status 2.

    Raises:
      ValueError: an unknown ``kind``, ``damping <= 0``, an unknown ``damping_mode``, or an
        unknown ``sqrt`` or ``eig_method`` where it is used.
    """
    if kind not in FACTOR_KINDS:
        raise ValueError(f"factor must be one of {FACTOR_KINDS}, got {kind!r}")
    if not damping > 0:
        raise ValueError(f"damping must be > 0, got {damping}")
    n = a.shape[-1]
    a = a.astype(jnp.float32)
    a_ok = jnp.all(jnp.isfinite(a))
    a_clean = jnp.where(a_ok, a, jnp.eye(n, dtype=jnp.float32))
    eps = absolute_damping(a_clean, damping, damping_mode)
    # one eigendecomposition serves the first try and the retry
    dense = _dense_kind(kind, n, rank, sqrt)
    if dense == "symmetric":
        eigenpairs = jnp.linalg.eigh(_sym(a_clean))
    elif dense is None and kind.startswith("lowrank") and eigenpairs is None:
        eigenpairs = top_eigenpairs(
            a_clean, rank, eig_method, key=key, init=init, oversample=oversample, iters=iters
        )
    else:
        eigenpairs = eigenpairs if dense is None else None
    kw = dict(
        rank=rank, block_size=block_size, sqrt=sqrt, eig_method=eig_method, key=key,
        init=init, oversample=oversample, iters=iters, eigenpairs=eigenpairs,
    )
    f1 = _build(kind, a_clean, eps, **kw)
    ok1 = a_ok & factor_is_finite(f1) & (eps > 0)

    def retry():
        f2 = _build(kind, a_clean, fallback_factor * eps, **kw)
        ok2 = a_ok & factor_is_finite(f2) & (eps > 0)
        ident = identity_factor(kind, n, rank, block_size)
        f = jax.tree.map(lambda x, y: jnp.where(ok2, x, y), f2, ident)
        return f, jnp.where(ok2, 1, 2).astype(jnp.int32)

    return cond(ok1, lambda: (f1, jnp.zeros((), jnp.int32)), retry)
