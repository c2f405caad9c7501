"""Tests of the whitening factors (gift_jax.whitening): pure math, jitted."""

import functools

import jax
import numpy as np
import pytest

from gift_jax import whitening as wh

N, M, RANK = 48, 12, 6


def _anisotropic_stats(n=N, tokens=512, decay=0.8, seed=0):
    """A = XᵀX/T for inputs with a geometrically decaying spectrum (random rotation); numpy,
    since eager JAX ops would each compile (that dominates small tests)."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    x = (rng.standard_normal((tokens, n)) * (decay ** np.arange(n)) @ q.T).astype(np.float32)
    return x, (x.T.astype(np.float64) @ x / tokens).astype(np.float32)


_G = np.random.default_rng(1).standard_normal((N, M)).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("kind", "sqrt", "block_size", "rank"))
def _case(a, g, kind, sqrt="cholesky", block_size=16, rank=RANK):
    """One compiled program per factor setting: factor, W·g, W⁻¹·W·g, W⁻¹·g, dense W."""
    f, status = wh.make_factor(a, kind, rank=rank, damping=1e-4, sqrt=sqrt,
                               block_size=block_size)
    w = wh.whiten(f, g)
    return dict(f=f, status=status, w=w, back=wh.unwhiten(f, w), inv=wh.unwhiten(f, g),
                dense=wh.dense_matrix(f, a.shape[-1]))


def _run(a, kind, sqrt="cholesky", block_size=16, rank=RANK, g=_G):
    return jax.device_get(_case(a, g, kind, sqrt, block_size, rank))


ALL = [
    ("full_cholesky", "cholesky", 16),
    ("full_symmetric", "symmetric", 16),
    ("diag", "cholesky", 16),
    ("block_diag", "cholesky", 16),
    ("block_diag", "symmetric", 20),  # ragged last block: 48 = 20 + 20 + 8
    ("lowrank_isotropic", "cholesky", 16),
    ("lowrank_diag", "cholesky", 16),
]


@pytest.mark.parametrize("kind,sqrt,block", ALL)
def test_whiten_unwhiten_roundtrip(kind, sqrt, block):
    _, a = _anisotropic_stats()
    r = _run(a, kind, sqrt, block)
    assert int(r["status"]) == 0
    w, back = r["w"], r["back"]
    assert w.shape == _G.shape and w.dtype == np.float32 and np.isfinite(w).all()
    # fp32 rounding bound, scaled by the conditioning of the factor (‖W‖‖W⁻¹‖)
    cond = np.linalg.cond(r["dense"].astype(np.float64), 2)
    err = np.linalg.norm(back - _G) / np.linalg.norm(_G)
    assert err < 50 * N * 6e-8 * cond, (err, cond)
    assert not np.allclose(w, _G, atol=1e-3)  # it did something
    # the O(n·r) / blocked applies equal the dense matrix of the same factor
    wd = r["dense"].astype(np.float64)
    np.testing.assert_allclose(w, wd @ _G, rtol=1e-3, atol=1e-4 * np.abs(wd @ _G).max())
    inv = np.linalg.solve(wd, _G.astype(np.float64))
    np.testing.assert_allclose(r["inv"], inv, rtol=1e-3, atol=1e-4 * np.abs(inv).max())


def _np_eigh_desc(a):
    lam, u = np.linalg.eigh(np.asarray(a, np.float64))
    return lam[::-1], u[:, ::-1]


@pytest.mark.parametrize("kind,sqrt", [("full_cholesky", "cholesky"),
                                       ("full_symmetric", "symmetric")])
def test_full_factor_whitens(kind, sqrt):
    _, a = _anisotropic_stats(decay=0.9)  # cond(A + εI) ~ 1e4: fp32 eigh/Cholesky accurate
    w = _run(a, kind, sqrt)["dense"].astype(np.float64)
    eps = 1e-4 * np.trace(a) / N
    white = w @ (a + eps * np.eye(N)) @ w.T
    np.testing.assert_allclose(white, np.eye(N), atol=2e-3)
    if kind == "full_cholesky":  # L⁻¹ is lower triangular
        assert np.abs(np.triu(w, 1)).max() == 0.0
    else:
        np.testing.assert_allclose(w, w.T, atol=1e-4 * np.abs(w).max())


def test_block_diag_whitens_its_blocks():
    _, a = _anisotropic_stats()
    w = _run(a, "block_diag", "symmetric", 20)["dense"].astype(np.float64)
    eps = 1e-4 * np.trace(a) / N
    for lo, hi in [(0, 20), (20, 40), (40, 48)]:  # ragged last block
        blk = w[lo:hi, lo:hi] @ (a[lo:hi, lo:hi] + eps * np.eye(hi - lo)) @ w[lo:hi, lo:hi].T
        np.testing.assert_allclose(blk, np.eye(hi - lo), atol=2e-3)
    assert np.abs(w[:20, 20:]).max() == 0.0 and np.abs(w[40:, :40]).max() == 0.0


@pytest.mark.parametrize("kind", ["lowrank_isotropic", "lowrank_diag"])
def test_lowrank_whitens_top_subspace(kind):
    _, a = _anisotropic_stats(decay=0.5)  # clear gap after the top r
    w = _run(a, kind)["dense"].astype(np.float64)
    _, u = _np_eigh_desc(a)
    u_top = u[:, :RANK]
    white = u_top.T @ w @ a @ w.T @ u_top
    # on the top-r subspace W A Wᵀ ≈ I up to the damping and the remainder's share there
    # (isotropic: exactly λ/(λ+ε); diagonal remainder: D leaks into the top subspace)
    np.testing.assert_allclose(white, np.eye(RANK), atol=0.02 if kind.endswith("isotropic")
                               else 0.1)


def test_lowrank_isotropic_formula():
    """A^{-1/2} = U(Λ+ε)^{-1/2}Uᵀ + (ρ+ε)^{-1/2}(I − UUᵀ), built densely here."""
    _, a = _anisotropic_stats()
    lam, u = _np_eigh_desc(a)
    eps = 1e-4 * np.trace(a) / N
    rho = np.sum(lam[RANK:]) / (N - RANK)
    ur = u[:, :RANK]
    ref = (ur * (lam[:RANK] + eps) ** -0.5) @ ur.T + (rho + eps) ** -0.5 * (
        np.eye(N) - ur @ ur.T)
    np.testing.assert_allclose(_run(a, "lowrank_isotropic")["dense"], ref, rtol=2e-3,
                               atol=2e-3 * np.abs(ref).max())


def test_lowrank_diag_exactly_whitens_its_model():
    """W Â Wᵀ = I for Â = UΛUᵀ + D (D the floored diagonal remainder + ε)."""
    _, a = _anisotropic_stats()
    lam, u = _np_eigh_desc(a)
    lam, u = lam[:RANK], u[:, :RANK]
    eps = 1e-4 * np.trace(a) / N
    d = np.maximum(np.diag(a) - np.sum(u * u * lam, 1), 0) + eps
    a_hat = (u * lam) @ u.T + np.diag(d)
    w = _run(a, "lowrank_diag")["dense"].astype(np.float64)
    np.testing.assert_allclose(w @ a_hat @ w.T, np.eye(N), atol=2e-3)


def test_rank_at_least_width_is_exact_full():
    _, a = _anisotropic_stats()
    r = _run(a, "lowrank_isotropic", "symmetric", rank=N)
    assert isinstance(r["f"], wh.DenseFactor) and int(r["status"]) == 0
    np.testing.assert_allclose(r["dense"], _run(a, "full_symmetric", "symmetric")["dense"],
                               rtol=1e-5, atol=1e-5)


def test_kronecker_two_sided():
    _, a = _anisotropic_stats()
    _, b = _anisotropic_stats(n=M, seed=3)
    fa = _run(a, "full_cholesky")["f"]
    fb = _run(b, "full_cholesky", g=_G.T)["f"]

    @jax.jit
    def both(fa, fb, g):
        k = wh.kronecker_factor(fa, fb)
        return wh.whiten(k, g), wh.unwhiten(k, wh.whiten(k, g))

    w, back = jax.device_get(both(fa, fb, _G))
    ref = fa.w.astype(np.float64) @ _G @ fb.w.T.astype(np.float64)
    np.testing.assert_allclose(w, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(back, _G, rtol=1e-3, atol=1e-3)


def test_damping_modes_and_bad_settings():
    a = 4.0 * np.eye(8, dtype=np.float32)
    assert float(wh.absolute_damping(a, 1e-3, "relative")) == pytest.approx(4e-3)
    assert float(wh.absolute_damping(a, 1e-3, "absolute")) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="damping_mode"):
        wh.absolute_damping(a, 1e-3, "weird")
    with pytest.raises(ValueError, match="damping"):
        wh.make_factor(a, "diag", damping=0.0)
    with pytest.raises(ValueError, match="factor"):
        wh.make_factor(a, "nope")
    with pytest.raises(ValueError, match="sqrt"):
        wh.dense_factor(a, 1e-3, "qr")
    with pytest.raises(ValueError, match="eig_method"):
        wh.top_eigenpairs(a, 2, "lanczos")


@pytest.mark.parametrize("kind", ["full_cholesky", "lowrank_isotropic", "lowrank_diag", "diag"])
def test_non_finite_statistics_fall_back_to_identity(kind):
    _, a = _anisotropic_stats()
    a[3, 3] = np.nan
    r = _run(a, kind)
    assert int(r["status"]) == 2
    np.testing.assert_allclose(r["w"], _G, atol=1e-6)


def test_zero_and_indefinite_statistics():
    r = _run(np.zeros((N, N), np.float32), "full_cholesky")
    assert int(r["status"]) == 2 and np.isfinite(r["dense"]).all()
    # slightly indefinite A breaks Cholesky at ε (relative 1e-4: ε ≈ 0.75e-4 < 2e-3), so the
    # factor is rebuilt with 100ε... which is still too small: identity; a larger dip is
    # what 100ε rescues:
    a = np.eye(N, dtype=np.float32)
    a[-1, -1] = -5e-5  # ε ≈ 1e-4·(N−1)/N ≈ 1e-4 > 5e-5: fine at ε
    assert int(_run(a, "full_cholesky")["status"]) == 0
    a[-1, -1] = -2e-3  # ε < 2e-3 < 100ε: rescued by the larger damping
    r = _run(a, "full_cholesky")
    assert int(r["status"]) == 1 and np.isfinite(r["dense"]).all()
    a[-1, -1] = -1.0  # hopeless: identity
    assert int(_run(a, "full_cholesky")["status"]) == 2


def test_subspace_iteration_matches_eigh():
    _, a = _anisotropic_stats(n=64, decay=0.85)
    lam_ex, u_ex = _np_eigh_desc(a)
    lam_ex, u_ex = lam_ex[:8], u_ex[:, :8]

    @jax.jit
    def solve(a, key, init):
        cold = wh.top_eigenpairs(a, 8, "subspace", key=key, iters=3)
        warm = wh.top_eigenpairs(a, 8, "subspace", key=key, init=init, iters=0)
        return cold, warm

    (u, lam), (_, lam2) = jax.device_get(solve(a, jax.random.key(0), u_ex.astype(np.float32)))
    np.testing.assert_allclose(lam, lam_ex, rtol=1e-3)
    # subspace angle: ‖(I − U Uᵀ) U_ex‖ small
    assert np.linalg.norm(u_ex - u @ (u.T @ u_ex), 2) < 1e-2
    # a warm start from the exact basis needs no iterations at all
    np.testing.assert_allclose(lam2, lam_ex, rtol=1e-4)


def test_subspace_iteration_from_activations_without_retracing():
    """A·Q = Xᵀ(X Q)/T: never forms A; the jitted solver traces once."""
    x, a = _anisotropic_stats(n=32)
    traces = []

    @jax.jit
    def solve(x, key):
        traces.append(1)
        return wh.subspace_iteration(lambda q: x.T @ (x @ q) / x.shape[0], 32, 4, key, iters=3)

    _, lam = solve(x, jax.random.key(0))
    solve(2 * x, jax.random.key(1))
    assert len(traces) == 1
    np.testing.assert_allclose(lam, _np_eigh_desc(a)[0][:4], rtol=1e-3)
