"""Tests of the fidelity metrics (gift_jax.whitening.fidelity)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gift_jax import whitening as wh
from gift_jax.whitening import fidelity as fd


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _fp8(x):
    scale = jnp.max(jnp.abs(x)) / 448.0
    return (x / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale


def test_basic_metrics_known_values():
    ref = jnp.array([3.0, 4.0])
    approx = jnp.array([3.0, 5.0])
    assert float(fd.relative_l2(approx, ref)) == pytest.approx(1 / 5)
    assert float(fd.max_abs_error(approx, ref)) == pytest.approx(1.0)
    assert float(fd.cosine(approx, ref)) == pytest.approx(29 / (5 * np.sqrt(34)), rel=1e-6)
    assert float(fd.cosine(-ref, ref)) == pytest.approx(-1.0)
    assert float(fd.relative_l2(ref, ref)) == 0.0


def test_whitened_error_uses_the_factor():
    a = jnp.diag(jnp.array([100.0, 1.0, 0.01, 0.01]))
    f, _ = wh.make_factor(a, "full_symmetric", damping=1e-6)
    ref = jnp.ones((4, 2))
    err = jnp.zeros((4, 2)).at[2, 0].set(0.01)  # an error along a low-variance input direction
    e_w = float(fd.whitened_relative_l2(ref + err, ref, f))
    e_euc = float(fd.relative_l2(ref + err, ref))
    # W = diag(λ^{-1/2}): the error is amplified 10×, the reference mostly shrinks
    expected = (0.01 * 10) / np.sqrt(2 * (0.01 + 1 + 100 + 100))
    assert e_w == pytest.approx(expected, rel=1e-4)
    assert e_w > 1.3 * e_euc


def test_adam_normalise_is_one_fresh_adam_step():
    import optax

    g = _normal(0, (6, 5))
    tx = optax.adam(1.0, b1=0.9, b2=0.999, eps=1e-8)
    upd, _ = tx.update(g, tx.init(g))
    np.testing.assert_allclose(-upd, fd.adam_normalise(g, 1e-8), rtol=1e-5, atol=1e-6)


def test_polar_and_newton_schulz():
    g = _normal(1, (16, 8))
    p = fd.polar(g)
    np.testing.assert_allclose(p.T @ p, np.eye(8), atol=1e-5)
    ns = jax.jit(fd.newton_schulz)(g)
    # Muon's NS is a rough polar factor: singular values in ~[0.7, 1.2]
    s = jnp.linalg.svd(ns, compute_uv=False)
    assert float(s.min()) > 0.5 and float(s.max()) < 1.3
    assert float(fd.cosine(ns, p)) > 0.95
    np.testing.assert_allclose(fd.polar(g.T), p.T, atol=1e-5)
    with pytest.raises(ValueError, match="method"):
        fd.polar(g, "qr")


def test_reference_frames_use_full_precision_matmuls():
    # GPU/TPU would otherwise run these fp32 dots in bf16 passes / TF32 (CPU: the same bits)
    g = jnp.ones((6, 4), jnp.float32)
    for fn, args in ((fd.newton_schulz, (g,)), (fd.polar, (g,)), (fd.cosine, (g, g)),
                     (lambda a, r: fd.fidelity_report(a, r), ({"w": g}, {"w": g}))):
        text = jax.jit(fn).lower(*args).as_text()
        assert text.count("dot_general") > 0
        assert text.count("dot_general") == text.count("precision = [HIGHEST, HIGHEST]"), fn


def test_report_per_leaf_and_aggregate_jitted():
    ref = {"w": _normal(2, (16, 8)), "b": _normal(3, (8,))}
    approx = jax.tree.map(_fp8, ref)
    a = wh.second_moment(_normal(4, (64, 16)) * 0.7 ** jnp.arange(16))
    f, _ = wh.make_factor(a, "full_symmetric")
    rep = jax.jit(lambda x, y, f: fd.fidelity_report(x, y, {"w": f}))(approx, ref, f)
    assert set(rep) == {"w", "b", "aggregate"}
    for k in ("relative_l2", "cosine", "max_abs_error", "adam_relative_l2", "muon_relative_l2",
              "whitened_relative_l2"):
        assert k in rep["w"]
    assert "muon_relative_l2" not in rep["b"] and "whitened_relative_l2" not in rep["b"]
    np.testing.assert_allclose(rep["w"]["relative_l2"], fd.relative_l2(approx["w"], ref["w"]),
                               rtol=1e-6)
    # aggregate = metric of the concatenated gradient
    cat = lambda t: jnp.concatenate([t["b"].ravel(), t["w"].ravel()])
    np.testing.assert_allclose(rep["aggregate"]["relative_l2"],
                               fd.relative_l2(cat(approx), cat(ref)), rtol=1e-5)
    np.testing.assert_allclose(rep["aggregate"]["cosine"], fd.cosine(cat(approx), cat(ref)),
                               rtol=1e-6)
    assert float(rep["aggregate"]["max_abs_error"]) == pytest.approx(
        float(fd.max_abs_error(cat(approx), cat(ref))))
    np.testing.assert_allclose(rep["aggregate"]["whitened_relative_l2"],
                               rep["w"]["whitened_relative_l2"], rtol=1e-5)
    # FP8 e4m3 has 3 mantissa bits: relative error a few percent, not zero
    assert 1e-3 < float(rep["aggregate"]["relative_l2"]) < 0.1
    assert float(rep["aggregate"]["cosine"]) > 0.99


def test_report_bad_inputs():
    ref = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="tree"):
        fd.fidelity_report({"v": jnp.ones((2, 2))}, ref)
    f, _ = wh.make_factor(jnp.eye(2), "diag")
    with pytest.raises(ValueError, match="unknown"):
        fd.fidelity_report(ref, ref, {"x": f})
