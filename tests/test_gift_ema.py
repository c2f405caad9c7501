"""GIFT's statistics EMA (issue #46 item 1) at the stage level, over 8 simulated CPU devices:
the bias-corrected per-step EMA (exact from the first fold, the closed-form weighted average,
its weight), statistics folded without a refresh (``gift_refresh=False``: no
eigendecomposition, factors kept), the artifact's scheme on request, bad settings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gift_jax.whitening.stage import fold_statistics, gift

D, N, M, T = 8, 16, 4, 32
KERNEL = "layers/0/mlp/down_proj/kernel"
H = 10.0  # half-life of the tests' stage, in steps

PMEAN = optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda g, s, p=None: (jax.lax.pmean(g, "data"), s))


def _mesh():
    return jax.make_mesh((D,), ("data",))


def _params():
    return {"layers": {"0": {"mlp": {"down_proj": {"kernel": jnp.zeros((N, M))}}}}}


def _data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((D, T, N)) * 0.7 ** np.arange(N)
    g = np.einsum("dti,dto->dio", x, rng.standard_normal((D, T, M)))
    a = np.einsum("dti,dtj->dij", x, x) / T
    grads = {"layers": {"0": {"mlp": {"down_proj": {"kernel": g.astype(np.float32)}}}}}
    return grads, {KERNEL: a.astype(np.float32)}


def _step(tx, mode):
    """jit(shard_map(update)); ``mode``: ``"ordinary"``, ``"refresh"`` or ``"fold"``."""

    def body(g, st, stats):
        g = jax.tree.map(lambda x: x[0], g)
        kw = {}
        if mode != "ordinary":
            kw["gift_stats"] = jax.tree.map(lambda x: x[0], stats)
        if mode == "fold":
            kw["gift_refresh"] = False
        _, st = tx.update(g, st, None, **kw)
        return st

    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("data"), P(), P("data")),
                                 out_specs=P(), check_vma=False))


def _put(x):
    return jax.device_put(x, NamedSharding(_mesh(), P("data")))


TX = gift(PMEAN, rank=4, axis_name="data", stats_half_life=H)
STEPS = {mode: _step(TX, mode) for mode in ("ordinary", "refresh", "fold")}


def _init():
    return jax.jit(TX.init, out_shardings=NamedSharding(_mesh(), P()))(_params())


def _walk(schedule, stats_of):
    """Runs ``schedule`` (a mode per step) from a fresh state; ``stats_of(t)``: step t's
    per-device statistics. Returns the state after every step."""
    grads, _ = _data(0)
    st, out = _init(), []
    for t, mode in enumerate(schedule):
        st = STEPS[mode](_put(grads), st, _put(stats_of(t)))
        out.append(jax.device_get(st))
    return out


def test_constant_statistic_is_exact_from_the_first_fold():
    _, stats = _data(1)
    states = _walk(["refresh", "ordinary", "fold", "ordinary", "ordinary", "refresh", "fold"],
                   lambda t: stats)
    first = states[0].whitened[KERNEL].stats
    np.testing.assert_allclose(first[0], stats[KERNEL].mean(0), rtol=1e-6, atol=1e-7)
    for st in states:  # bias-corrected: no shrinkage towards zero, bit for bit
        assert st.whitened[KERNEL].stats.tobytes() == first.tobytes()
    # the weight is the mass of the steps covered (first fold: 1 step; then 2, 3, 1)
    for st, steps in zip([states[0], states[2], states[5], states[6]], [1, 3, 6, 7],
                         strict=True):
        np.testing.assert_allclose(st.whitened[KERNEL].stats_weight, 1 - 2 ** (-steps / H),
                                   rtol=1e-6)
    assert [int(s.stats_count) for s in states] == [0, 1, 0, 1, 2, 0, 0]
    assert [int(s.count) for s in states] == [0, 1, 2, 3, 4, 0, 1]
    assert [int(s.refreshes) for s in states] == [1, 1, 1, 1, 1, 2, 2]


def test_weighted_average_over_irregular_folds():
    """Folds at steps 0 (refresh), 3 (statistics only) and 5 (refresh) of A, 2A, 4A: the EMA
    is Σ wᵢ Aᵢ / Σ wᵢ with wᵢ = (1 − βᵢ)·∏_{j>i} βⱼ, βᵢ = 2^(−Δᵢ/h), Δ = (1, 3, 2)."""
    _, stats = _data(2)
    scale = {0: 1.0, 3: 2.0, 5: 4.0}
    states = _walk(["refresh", "ordinary", "ordinary", "fold", "ordinary", "refresh"],
                   lambda t: {KERNEL: stats[KERNEL] * scale.get(t, 0.0)})
    beta = 2.0 ** (-np.array([1.0, 3.0, 2.0]) / H)
    w = (1 - beta) * np.array([beta[1] * beta[2], beta[2], 1.0])
    a = stats[KERNEL].astype(np.float64).mean(0)
    want = (w[0] * a + w[1] * 2 * a + w[2] * 4 * a) / w.sum()
    np.testing.assert_allclose(states[-1].whitened[KERNEL].stats[0], want, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(states[-1].whitened[KERNEL].stats_weight, w.sum(), rtol=1e-6)
    # the artifact's EMA would still hold 0.95² of the first statistic after its 3 folds
    artifact = 0.95**2 * a + 0.95 * 0.05 * 2 * a + 0.05 * 4 * a
    assert np.abs(artifact - want).max() > 0.1 * np.abs(want).max()


def test_statistics_step_folds_without_refactorizing():
    grads, stats = _data(3)
    st = STEPS["refresh"](_put(grads), _init(), _put(stats))
    before = jax.device_get(st)
    st = jax.device_get(STEPS["fold"](_put(grads), st, _put({KERNEL: 3 * stats[KERNEL]})))
    for x, y in zip(jax.tree.leaves(before.whitened[KERNEL].factor),
                    jax.tree.leaves(st.whitened[KERNEL].factor), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # factors kept
    assert not np.array_equal(st.whitened[KERNEL].stats, before.whitened[KERNEL].stats)
    assert int(st.refreshes) == 1 and int(st.count) == 1 and int(st.stats_count) == 0
    args = (_put(grads), st, _put(stats))
    fold = str(jax.make_jaxpr(STEPS["fold"])(*args))
    refresh = str(jax.make_jaxpr(STEPS["refresh"])(*args))
    for prim in ("eigh", "cholesky", "qr", "triangular_solve"):
        assert prim not in fold, prim
    assert "eigh" in refresh
    assert f"f32[1,{N},{N}] = psum" in fold  # the statistic is reduced over the replicas


def test_fold_statistics_function_and_artifact_rule():
    """:func:`fold_statistics` on one device, both schemes, two-sided included."""
    art = gift(PMEAN, rank=4, ema_scheme="artifact", two_sided=True)
    bc = gift(PMEAN, rank=4, stats_half_life=H, two_sided=True)
    a = np.eye(N, dtype=np.float32) * 2.0
    b = np.eye(M, dtype=np.float32) * 3.0
    sel = art.settings.select(_params())
    for tx in (art, bc):
        st = tx.init(_params())
        st, finite, step_a = fold_statistics(tx.settings, st, sel, {KERNEL: a}, {KERNEL: b})
        assert bool(finite[KERNEL][0])
        np.testing.assert_array_equal(st.whitened[KERNEL].stats[0], a)  # the first as is
        np.testing.assert_array_equal(st.whitened[KERNEL].out_stats[0], b)
        st, _, _ = fold_statistics(tx.settings, st, sel, {KERNEL: 3 * a}, {KERNEL: 3 * b})
        got = np.asarray(st.whitened[KERNEL].stats[0])
        if tx is art:
            np.testing.assert_allclose(got, 0.95 * a + 0.05 * 3 * a, rtol=1e-6)
        else:  # two folds one step apart: weights β(1−β) and (1−β)
            beta = 2 ** (-1 / H)
            np.testing.assert_allclose(got, (beta * a + 3 * a) / (1 + beta), rtol=1e-6)
        # a non-finite statistic keeps the EMA (and, bias-corrected, the weight)
        kept, finite, _ = fold_statistics(tx.settings, st, sel,
                                          {KERNEL: np.full_like(a, np.nan)}, {KERNEL: b})
        assert not bool(finite[KERNEL][0])
        np.testing.assert_array_equal(kept.whitened[KERNEL].stats, st.whitened[KERNEL].stats)
        if tx is bc:
            np.testing.assert_array_equal(kept.whitened[KERNEL].stats_weight,
                                          st.whitened[KERNEL].stats_weight)


def test_bad_settings_and_arguments():
    for kw, match in (({"ema_scheme": "adam"}, "ema_scheme must be one of"),
                      ({"stats_half_life": 0}, "stats_half_life must be a number of steps > 0"),
                      ({"stats_half_life": float("inf")}, "stats_half_life"),
                      ({"stats_half_life": True}, "stats_half_life"),
                      ({"ema": 0.9}, r"ema=0.9 is the per-fold decay of ema_scheme='artifact'"),
                      ({"ema": 1.0, "ema_scheme": "artifact"}, r"ema must be in \[0, 1\)")):
        with pytest.raises(ValueError, match=match):
            gift(PMEAN, **kw)
    g = jax.tree.map(lambda x: x[0], _data(4)[0])
    with pytest.raises(ValueError, match="gift_refresh must be a Python bool"):
        TX.update(g, TX.init(_params()), gift_stats={KERNEL: np.eye(N)}, gift_refresh="no")
