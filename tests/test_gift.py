"""Tests of the GIFT stage (gift_jax.gift) inside jax.shard_map over 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from gift_jax.comm.stage import allreduce
from gift_jax.utils.tree_paths import leaf_path
from gift_jax.whitening.stage import (
    GiftDimensionNumbers,
    gift,
    refresh_due,
    select_layers,
)

D = 8  # devices
N, M, T = 32, 8, 64  # layer width in/out, tokens per device
KERNEL = "layers/0/mlp/down_proj/kernel"


def _mesh():
    return jax.make_mesh((D,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _params():
    return {
        "layers": {"0": {"mlp": {"down_proj": {"kernel": jnp.zeros((N, M)),
                                               "bias": jnp.zeros((M,))}}}},
        "embed": jnp.zeros((5, N)),
    }


PMEAN = optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda g, s, p=None: (jax.lax.pmean(g, "data"), s)
)


def _recording(axis=None):
    """An inner stage whose state is the (whitened) update it last saw; reduces nothing."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g)
    )


def _data(seed, decay=0.8, n=N, m=M):
    """Per-device inputs with a decaying spectrum, backprop δ, G = Xᵀδ, local A = XᵀX/T.

    Built with numpy: eager JAX ops would each compile, which dominates small tests."""
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    x = (rng.standard_normal((D, T, n)) * decay ** np.arange(n)) @ q.T
    delta = rng.standard_normal((D, T, m))
    g = np.einsum("dti,dto->dio", x, delta)
    a = np.einsum("dti,dtj->dij", x, x) / T
    return jnp.asarray(g, jnp.float32), jnp.asarray(a, jnp.float32)


def _sharded_step(tx, traces=None):
    """jit(shard_map(update)) on per-device grads (D, ...) and stats (D, ...) or None.

    Returns (per-device outputs (D, ...), state, per-device factors (D, ...))."""

    def body(g, st, stats):
        if traces is not None:
            traces.append(stats is not None)
        g = jax.tree.map(lambda x: x[0], g)
        kw = {} if stats is None else {"gift_stats": jax.tree.map(lambda x: x[0], stats)}
        out, st = tx.update(g, st, None, **kw)
        return jax.tree.map(lambda x: x[None], out), st, jax.tree.map(lambda x: x[None],
                                                                      st.member("factor"))

    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("data"), P(), P("data")),
                                 out_specs=(P("data"), P(), P("data")), check_vma=False))


def _init(tx):
    """Initial state replicated on the mesh (as a trainer places it)."""
    rep = jax.sharding.NamedSharding(_mesh(), P())
    return jax.jit(tx.init, out_shardings=rep)(_params())


def _kernel(out):
    return out["layers"]["0"]["mlp"]["down_proj"]["kernel"]


def _assert_replicas_identical(tree):
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        assert (leaf == leaf[:1]).all()


# One compiled stage shared by several tests (compilation dominates the test time).
TX = gift(PMEAN, rank=4, axis_name="data")
TRACES = []
STEP = _sharded_step(TX, TRACES)
# the real quantized all-reduce as the inner stage; GIFT takes its axis from it
TX8 = gift(allreduce("data", codec="fp8_e4m3"), rank=8)
STEP8 = _sharded_step(TX8)


def _grads(seed):
    g, a = _data(seed)
    rng = np.random.default_rng(seed + 1000)
    grads = {
        "layers": {"0": {"mlp": {"down_proj": {
            "kernel": g, "bias": jnp.asarray(rng.standard_normal((D, M)), jnp.float32)}}}},
        "embed": jnp.asarray(rng.standard_normal((D, 5, N)), jnp.float32),
    }
    return grads, {KERNEL: a}


def _normal(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _np_chol_w(a, damping=1e-3):
    """L⁻¹ for A + εI = L Lᵀ, ε relative (numpy, float64)."""
    a = np.asarray(a, np.float64)
    return np.linalg.inv(np.linalg.cholesky(a + damping * np.trace(a) / len(a) * np.eye(len(a))))


def _np_sym_w(a, damping=1e-3):
    """(A + εI)^{-1/2}, ε relative (numpy, float64)."""
    lam, u = np.linalg.eigh(np.asarray(a, np.float64))
    return (u * (lam + damping * lam.mean()) ** -0.5) @ u.T


def _np_lowrank_w(f, *index):
    """Dense W = U diag(c_top) Uᵀ + c_rest (I − UUᵀ) of a LowRankIsotropicFactor, in numpy."""
    u, ct, cr = (np.asarray(x, np.float64)[index] for x in (f.u, f.c_top, f.c_rest))
    return (u * ct) @ u.T + cr * (np.eye(u.shape[0]) - u @ u.T)


def test_gift_over_pmean_equals_pmean_and_no_statistics_work_on_ordinary_steps():
    grads, stats = _grads(0)
    ref = jax.tree.map(lambda x: x.mean(0), grads)
    state = _init(TX)
    TRACES.clear()
    out, state, factors = STEP(grads, state, stats)  # refresh
    assert int(state.refreshes) == 1 and int(state.count) == 0
    out2, state, _ = STEP(grads, state, None)  # ordinary step, same factors
    assert int(state.count) == 1
    ref = jax.device_get(ref)
    for o in jax.device_get((out, out2)):
        dp, rp = o["layers"]["0"]["mlp"]["down_proj"], ref["layers"]["0"]["mlp"]["down_proj"]
        # fp32 rounding through W and W⁻¹ (cond(W) ≤ √(1+1/damping) ≈ 32)
        err = np.linalg.norm(dp["kernel"][0] - rp["kernel"]) / np.linalg.norm(rp["kernel"])
        assert err < 2e-5, err
        np.testing.assert_array_equal(dp["bias"][0], rp["bias"])  # not selected: untouched
        np.testing.assert_array_equal(o["embed"][0], ref["embed"])
        _assert_replicas_identical(o)
    _assert_replicas_identical(factors)
    # the factors are not the identity any more
    assert np.abs(_np_lowrank_w(factors[KERNEL], 0, 0) - np.eye(N)).max() > 0.1
    # jit without recompilation: one trace per variant over repeated calls
    for _ in range(2):
        _, state, _ = STEP(grads, state, stats)
        _, state, _ = STEP(grads, state, None)
    assert TRACES == [True, False], TRACES
    assert int(state.refreshes) == 3 and int(state.count) == 1
    # no statistics work in the ordinary variant (and the check can fail: refresh has it)
    ordinary = str(jax.make_jaxpr(STEP)(grads, state, None))
    refresh = str(jax.make_jaxpr(STEP)(grads, state, stats))
    for prim in ("eigh", "cholesky", "qr", "triangular_solve"):
        assert prim not in ordinary
    assert "eigh" in refresh
    stats_psum = lambda txt: [ln for ln in txt.splitlines()
                              if "psum" in ln and f"f32[1,{N},{N}] = psum" in ln]
    assert not stats_psum(ordinary) and stats_psum(refresh)  # stats reduced only on refresh


def test_fp8_whitened_frame_error_well_below_euclidean_replicas_identical():
    grads, stats = _grads(1)
    ref = np.asarray(_kernel(grads)).mean(0)
    # the reference frame: the symmetric whitener A^{-1/2} of the reduced A (numpy, float64)
    lam, u = np.linalg.eigh(np.asarray(stats[KERNEL], np.float64).mean(0))
    frame = (u * (lam + 1e-3 * lam.mean()) ** -0.5) @ u.T

    def werr(out):
        k = np.asarray(_kernel(out))[0]
        return np.linalg.norm(frame @ (k - ref)) / np.linalg.norm(frame @ ref)

    euclid_out, _, _ = STEP8(grads, _init(TX8), None)  # identity factor = Euclidean FP8
    gift_out, st, factors = STEP8(grads, _init(TX8), stats)
    euclid, gifted = werr(euclid_out), werr(gift_out)
    assert gifted < 0.5 * euclid, (gifted, euclid)
    # Euclidean-frame error is not the claim; both are FP8-sized
    assert np.linalg.norm(np.asarray(_kernel(gift_out))[0] - ref) / np.linalg.norm(ref) < 0.2
    _assert_replicas_identical((gift_out, factors))


def test_non_finite_statistics_fall_back_counted():
    grads, stats = _grads(15)
    bad = {KERNEL: stats[KERNEL].at[3, 0, 0].set(jnp.inf)}
    out, st, _ = STEP(grads, _init(TX), bad)
    assert int(st.identity_fallbacks) == 1 and int(st.damped_fallbacks) == 0
    out, st_np = jax.device_get((out, st))
    for leaf in jax.tree.leaves(out):
        assert np.isfinite(leaf).all()
    np.testing.assert_allclose(_kernel(out)[0], np.asarray(_kernel(grads)).mean(0), rtol=1e-6,
                               atol=1e-6)
    # the EMA was not poisoned, and a later good refresh recovers
    assert np.isfinite(st_np.whitened[KERNEL].stats).all()
    _, st, factors = STEP(grads, st, stats)
    st, factors = jax.device_get((st, factors))
    assert int(st.refreshes) == 2 and int(st.identity_fallbacks) == 1
    np.testing.assert_allclose(st.whitened[KERNEL].stats[0], np.asarray(stats[KERNEL]).mean(0),
                               rtol=1e-5, atol=1e-6)
    assert np.abs(_np_lowrank_w(factors[KERNEL], 0, 0) - np.eye(N)).max() > 0.1


def test_ema_of_statistics():
    """The artifact's EMA (``ema_scheme="artifact"``): the first statistic as is, then 0.95 /
    0.05 per refresh, and no bias-correction state; the default's EMA is
    tests/test_gift_ema.py's."""
    tx = gift(PMEAN, rank=4, axis_name="data", ema_scheme="artifact")
    step = _sharded_step(tx)
    grads, stats = _grads(4)
    st0 = _init(tx)
    assert st0.stats_count is None and not st0.member("stats_weight")
    _, st, _ = step(grads, st0, stats)
    a1 = np.asarray(stats[KERNEL]).mean(0)
    np.testing.assert_allclose(np.asarray(st.whitened[KERNEL].stats)[0], a1, rtol=1e-5, atol=1e-6)
    stats2 = {KERNEL: 2.0 * np.asarray(stats[KERNEL])}
    _, st, _ = step(grads, st, stats2)
    np.testing.assert_allclose(np.asarray(st.whitened[KERNEL].stats)[0], 0.95 * a1 + 0.05 * 2 * a1,
                               rtol=1e-5, atol=1e-6)


def test_identity_before_first_refresh_single_device():
    tx = gift(_recording(), rank=4)
    g = jax.tree.map(lambda x: x[0], _grads(5)[0])
    out, st = jax.jit(tx.update)(g, tx.init(_params()))
    jax.tree.map(np.testing.assert_array_equal, st.inner_state, g)
    jax.tree.map(np.testing.assert_array_equal, out, g)


def _whitened(tx, g, stats, params=None, **kw):
    state = tx.init(params if params is not None else g)
    _, st = jax.jit(lambda g, s, st: tx.update(g, s, params, gift_stats=st, **kw))(
        g, state, stats)
    return st


def test_stacked_layers_and_attention_dimension_numbers():
    L, H, K = 3, 4, 8  # layers, heads, head_dim; embed = N
    grads = {
        "layers": {"mlp": {"down_proj": {"kernel": _normal(6, (L, N, M))}},
                   "attn": {"q": {"kernel": _normal(6, (L, N, H, K))},
                            "o": {"kernel": _normal(6, (L, H, K, N))}}},
    }
    dims = {
        "*/mlp/down_proj": GiftDimensionNumbers(1, 2),
        "*/attn/q": GiftDimensionNumbers(1, (2, 3)),
        "*/attn/o": GiftDimensionNumbers((1, 2), 3),
    }
    _, a = _data(6)
    _, ao = _data(9, n=H * K)
    stats = {"layers/mlp/down_proj/kernel": a[:L], "layers/attn/q/kernel": a[:L],
             "layers/attn/o/kernel": ao[:L]}
    tx = gift(_recording(), layers=["*/mlp/down_proj", "*/attn/*"], rank=4,
              dimension_numbers=dims)
    st, grads = jax.device_get((_whitened(tx, grads, stats), grads))
    w, fs = st.inner_state, st.member("factor")
    for l in range(L):
        np.testing.assert_allclose(
            w["layers"]["mlp"]["down_proj"]["kernel"][l],
            _np_lowrank_w(fs["layers/mlp/down_proj/kernel"], l)
            @ grads["layers"]["mlp"]["down_proj"]["kernel"][l], rtol=1e-4, atol=1e-4)
        q = grads["layers"]["attn"]["q"]["kernel"][l].reshape(N, H * K)
        np.testing.assert_allclose(
            w["layers"]["attn"]["q"]["kernel"][l].reshape(N, H * K),
            _np_lowrank_w(fs["layers/attn/q/kernel"], l) @ q, rtol=1e-4, atol=1e-4)
        o = grads["layers"]["attn"]["o"]["kernel"][l].reshape(H * K, N)
        np.testing.assert_allclose(
            w["layers"]["attn"]["o"]["kernel"][l].reshape(H * K, N),
            _np_lowrank_w(fs["layers/attn/o/kernel"], l) @ o, rtol=1e-4, atol=1e-4)
    # per-layer factors differ (built from each layer's own statistics)
    u = fs["layers/mlp/down_proj/kernel"].u
    assert np.abs(u[0] - u[1]).max() > 1e-2


def test_two_sided_kfac():
    g, a = _data(10)
    _, b = _data(11, n=M)
    grads = {"mlp": {"down_proj": {"kernel": g[0]}}}
    tx = gift(_recording(), layers=["mlp/down_proj"], factor="full_cholesky", two_sided=True)
    st = _whitened(tx, grads, {"mlp/down_proj/kernel": a[0]},
                   gift_output_stats={"mlp/down_proj/kernel": b[0]})
    wa, wb = _np_chol_w(a[0]), _np_chol_w(b[0])
    want = wa @ np.asarray(g[0], np.float64) @ wb.T
    got = np.asarray(st.inner_state["mlp"]["down_proj"]["kernel"], np.float64)
    # fp32 triangular solves with cond(A + εI) ≈ 1.5e4 (and B alike): the error is relative to
    # the whole result (entries up to ~80), measured 3.7e-5; an elementwise atol of 1e-3
    # failed on some CPUs. A wrong factor, side or transpose gives an O(1) error.
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-4


def test_projected_factor_for_plumage():
    """R = Mᵀ G (k × m) is whitened with the factor of MᵀAM."""
    k = 6
    g, a = _data(12)
    proj = _normal(13, (N, k)) / np.sqrt(N)
    r = {"mlp": {"down_proj": {"kernel": proj.T @ g[0]}}}
    tx = gift(_recording(), layers=["mlp/down_proj"], factor="full_symmetric")
    state = tx.init(r).with_input_widths({"mlp/down_proj/kernel": N})  # the projecting hook
    assert state.whitened["mlp/down_proj/kernel"].stats.shape == (1, N, N)
    assert state.whitened["mlp/down_proj/kernel"].factor.w.shape == (1, k, k)  # k from the shapes
    _, st = jax.jit(lambda r, s, a, m: tx.update(  # no params: every width is in the shapes
        r, s, gift_stats={"mlp/down_proj/kernel": a},
        gift_projection={"mlp/down_proj/kernel": m}))(r, state, a[0], proj)
    pm = np.asarray(proj, np.float64)
    w = _np_sym_w(pm.T @ np.asarray(a[0], np.float64) @ pm)
    np.testing.assert_allclose(st.inner_state["mlp"]["down_proj"]["kernel"],
                               w @ np.asarray(r["mlp"]["down_proj"]["kernel"]), rtol=1e-3,
                               atol=1e-4)
    with pytest.raises(ValueError, match="gift_projection"):
        tx.update(r, state, gift_stats={"mlp/down_proj/kernel": a[0]})
    with pytest.raises(ValueError, match="no layer receives projected"):
        tx.update(r, tx.init(r), gift_stats={"mlp/down_proj/kernel": jnp.eye(k)},
                  gift_projection={"mlp/down_proj/kernel": proj})


def test_subspace_eigensolver_close_to_eigh():
    g, a = _data(14, decay=0.6)
    grads = {"mlp": {"down_proj": {"kernel": g[0]}}}
    stats = {"mlp/down_proj/kernel": a[0]}
    tx = gift(_recording(), ["mlp/down_proj"], rank=4, eig_method="subspace", eig_iters=3)
    st = jax.device_get(_whitened(tx, grads, stats))
    assert st.whitened["mlp/down_proj/kernel"].basis.shape == (1, N, 4)
    # exact rank-4 isotropic whitener from numpy's eigh
    lam, u = np.linalg.eigh(np.asarray(a[0], np.float64))
    lam, u = lam[::-1], u[:, ::-1]
    eps = 1e-3 * lam.mean()
    rho = lam[4:].mean()
    w = (u[:, :4] * (lam[:4] + eps) ** -0.5) @ u[:, :4].T + (rho + eps) ** -0.5 * (
        np.eye(N) - u[:, :4] @ u[:, :4].T)
    x = w @ np.asarray(g[0], np.float64)
    y = st.inner_state["mlp"]["down_proj"]["kernel"]
    assert np.linalg.norm(x - y) / np.linalg.norm(x) < 1e-2


def test_bad_settings_and_inputs():
    p = _params()
    with pytest.raises(ValueError, match="layers"):
        gift(PMEAN, layers=["*/attn/nothing"]).init(p)
    with pytest.raises(ValueError, match="dimension_numbers"):
        gift(PMEAN, layers=["layers/0/mlp/down_proj"]).init(
            {"layers": {"0": {"mlp": {"down_proj": {"kernel": jnp.zeros((2, N, M))}}}}})
    with pytest.raises(ValueError, match="dimension_numbers"):
        gift(PMEAN, dimension_numbers={"*/mlp/down_proj": GiftDimensionNumbers(0, 5)}).init(p)
    with pytest.raises(ValueError, match="damping"):
        gift(PMEAN, damping=0.0)
    with pytest.raises(TypeError, match="refresh_every"):  # the host's schedule, not the stage's
        gift(PMEAN, refresh_every=50)
    with pytest.raises(ValueError, match="factor"):
        gift(PMEAN, factor="cholesky")
    with pytest.raises(ValueError, match="ema"):
        gift(PMEAN, ema=1.0)
    tx = gift(_recording(), rank=4)
    st = tx.init(p)
    with pytest.raises(ValueError, match="gift_stats"):
        tx.update(p, st, gift_stats={KERNEL: jnp.eye(N + 1)})
    with pytest.raises(ValueError, match="gift_stats"):
        tx.update(p, st, gift_stats={"layers/0/mlp/up_proj/kernel": jnp.eye(N)})


def test_selection_rule():
    sel = select_layers(_params(), ["*/mlp/down_proj"])
    assert list(sel) == [KERNEL]  # the module pattern picks the kernel, not the bias
    with pytest.raises(ValueError, match="dimension_numbers"):
        select_layers(_params(), ["layers/*/mlp/down_proj/bias"])
    assert leaf_path((jax.tree_util.DictKey("a"), jax.tree_util.GetAttrKey("value"))) == "a"
    assert refresh_due(100, 50) and not refresh_due(101, 50)


def test_converges_with_sgd_through_the_fp8_stage():
    """sgd on least squares, gradients reduced by gift(fp8 pmean) (the compiled STEP8), with
    a refresh every 10 steps: converges like plain sgd."""
    w_true = np.asarray(_normal(16, (N, M)))
    x = np.asarray(_normal(17, (D, T, N))) * 0.9 ** np.arange(N)
    y = x @ w_true
    a = np.einsum("dti,dtj->dij", x, x) / T
    w = w_exact = np.zeros((N, M), np.float32)
    zeros = {"layers": {"0": {"mlp": {"down_proj": {"bias": np.zeros((D, M), np.float32)}}}},
             "embed": np.zeros((D, 5, N), np.float32)}
    state = _init(TX8)
    loss = lambda w: float(np.mean((x @ w - y) ** 2))
    l0 = loss(w)
    for i in range(40):
        g = np.einsum("dti,dto->dio", x, x @ w - y) / T  # per-device gradients
        grads = {**zeros}
        grads["layers"] = {"0": {"mlp": {"down_proj": {
            "bias": zeros["layers"]["0"]["mlp"]["down_proj"]["bias"],
            "kernel": g.astype(np.float32)}}}}
        out, state, _ = STEP8(grads, state, {KERNEL: a} if refresh_due(i, 10) else None)
        w = w - 0.5 * np.asarray(_kernel(out))[0]
        w_exact = w_exact - 0.5 * np.einsum("dti,dto->io", x, x @ w_exact - y) / (D * T)
    # as good as exact fp32 sgd (the ill-conditioned tail converges slowly for both)
    assert loss(w) < 0.05 * l0 and loss(w) < 1.1 * loss(w_exact) + 1e-3 * l0, (
        loss(w), loss(w_exact), l0)
    assert int(state.refreshes) == 4


# ------------------------------------------------------------------------------------------
# Capture of input statistics from Flax NNX models (gift_jax.whitening.capture).
# ------------------------------------------------------------------------------------------

from flax import nnx  # noqa: E402
from nnx_toys import DF, DM, NL, ListModel, ScanModel  # noqa: E402

from gift_jax.whitening.capture import find_linear_layers, with_input_stats  # noqa: E402


def _loss(model, x):
    return jnp.mean(model(x) ** 2)


_X = _normal(40, (2, 5, DM))  # (batch, seq, d_model)


def _np_block(mlp, x):
    """numpy reference of one residual MLP block: (hidden activation, block output)."""
    h = np.maximum(x @ mlp["up_proj"]["kernel"] + mlp["up_proj"]["bias"], 0.0)
    return h, x + h @ mlp["down_proj"]["kernel"] + mlp["down_proj"]["bias"]


def _second_moment(h):
    h = h.reshape(-1, h.shape[-1])
    return h.T @ h / h.shape[0]


def test_capture_list_model_matches_manual_and_restores_model():
    model = ListModel(nnx.Rngs(0))
    before = nnx.graphdef(model)
    refresh_loss = with_input_stats(_loss, ["*/mlp/down_proj"])
    step = nnx.jit(lambda m, x: nnx.value_and_grad(refresh_loss, has_aux=True)(m, x))
    (loss, stats), grads = step(model, _X)
    assert sorted(stats) == ["layers/0/mlp/down_proj/kernel", "layers/1/mlp/down_proj/kernel"]
    p = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    x = np.asarray(_X)
    for i in range(2):
        h, x = _np_block(p["layers"][i]["mlp"], x)
        np.testing.assert_allclose(stats[f"layers/{i}/mlp/down_proj/kernel"], _second_moment(h),
                                   rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(loss, np.mean(x**2), rtol=1e-5)
    assert nnx.graphdef(model) == before and type(model.layers[0].mlp.down_proj) is nnx.Linear
    # gradients are those of the plain loss (the capture is stop_gradient'ed)
    g_plain = nnx.jit(nnx.grad(_loss))(model, _X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads, g_plain)
    # the keys are exactly the GIFT stage's selection on the gradient tree
    tx = gift(_recording(), ["*/mlp/down_proj"], rank=4)
    state = tx.init(grads)
    assert sorted(state.member("stats")) == sorted(stats)
    _, state = jax.jit(lambda g, s, st: tx.update(g, s, gift_stats=st))(grads, state, stats)
    assert int(state.refreshes) == 1 and int(state.identity_fallbacks) == 0


def test_capture_scan_stacked_layers_and_no_statistics_in_plain_variant():
    model = ScanModel(nnx.Rngs(1))
    refresh_loss = with_input_stats(_loss, ["layers/mlp/down_proj"])
    (loss, stats), grads = nnx.jit(nnx.value_and_grad(refresh_loss, has_aux=True))(model, _X)
    a = stats["layers/mlp/down_proj/kernel"]
    assert a.shape == (NL, DF, DF)
    p = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))["layers"]["mlp"]
    x = np.asarray(_X)
    for layer in range(NL):
        h, x = _np_block(jax.tree.map(lambda v, layer=layer: v[layer], p), x)
        np.testing.assert_allclose(a[layer], _second_moment(h), rtol=1e-4, atol=1e-6)
    # the stage takes the stacked statistic with dimension numbers (layer axis = batch axis)
    tx = gift(_recording(), ["*/mlp/down_proj"], rank=4,
              dimension_numbers={"*/mlp/down_proj": GiftDimensionNumbers(1, 2)})
    _, st = jax.jit(lambda g, s, st: tx.update(g, s, gift_stats=st))(grads, tx.init(grads), stats)
    assert st.whitened["layers/mlp/down_proj/kernel"].factor.u.shape == (NL, DF, 4)
    # the ordinary variant does no statistics work: no (d_ff × d_ff) dot in its jaxpr
    graphdef, state = nnx.split(model)

    def jaxpr_of(fn):
        return str(jax.make_jaxpr(lambda s, x: nnx.grad(fn, has_aux=fn is not _loss)(
            nnx.merge(graphdef, s), x))(state, _X))

    square = f"f32[{DF},{DF}] = dot_general"
    assert square not in jaxpr_of(_loss)
    assert square in jaxpr_of(refresh_loss)  # the check can fail


def test_capture_bad_patterns():
    model = ListModel(nnx.Rngs(0))
    with pytest.raises(ValueError, match="match no"):
        find_linear_layers(model, ["*/attn/q_proj"])
    with pytest.raises(ValueError, match="only nnx.Linear"):
        find_linear_layers(model, ["layers/0/mlp"])


@pytest.mark.parametrize("factor", ["lowrank_isotropic", "full_cholesky"])
def test_distributed_refresh_equals_replicated_and_gathers_factors(factor):
    """Spreading the factor builds over the 8 replicas (5 layers of equal width in one group:
    a stacked (3, N, M) leaf and two plain ones) gives the factors of every replica building
    all of them (up to fp32 rounding: XLA compiles a one-matrix map differently from a
    five-matrix one), bit-identical across replicas, and the refresh HLO all-gathers them."""
    params = {"stack": jnp.zeros((3, N, M)), "b": jnp.zeros((N, M)), "c": jnp.zeros((N, 16))}
    rng = np.random.default_rng(21)
    stats = {}
    for name, lead in (("stack", (3,)), ("b", ()), ("c", ())):
        x = rng.standard_normal((D, *lead, T, N)) * 0.8 ** np.arange(N)
        stats[name] = jnp.asarray(np.einsum("...ti,...tj->...ij", x, x) / T, jnp.float32)
    grads = {k: _normal(22, (D, *v.shape)) for k, v in params.items()}
    dims = {"stack": GiftDimensionNumbers(reduction_axis=1, output_axis=2)}
    rep = jax.sharding.NamedSharding(_mesh(), P())

    def run(distribute):
        tx = gift(PMEAN, layers=["stack", "b", "c"], rank=4, factor=factor, axis_name="data",
                  dimension_numbers=dims, distribute_refresh=distribute)

        def body(g, st, s):
            g, s = jax.tree.map(lambda x: x[0], (g, s))
            out, st = tx.update(g, st, None, gift_stats=s)
            return jax.tree.map(lambda x: x[None], (out, st.member("factor")))

        fn = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("data"), P(), P("data")),
                                   out_specs=P("data"), check_vma=False))
        state = jax.jit(tx.init, out_shardings=rep)(params)
        hlo = fn.lower(grads, state, stats).compile().as_text()
        return jax.device_get(fn(grads, state, stats)), hlo

    (out_d, fac_d), hlo_d = run(True)
    (out_r, fac_r), hlo_r = run(False)
    _assert_replicas_identical((out_d, fac_d))
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, fac_d, fac_r)
    jax.tree.map(close, out_d, out_r)
    assert "all-gather" in hlo_d and "all-gather" not in hlo_r


def test_error_feedback_residual_reexpressed_across_refresh():
    """Refresh 1 (factor W₁) leaves each replica a residual e in the W₁ frame; refresh 2 with a
    very different A and a zero gradient then sends exactly what is owed, mean_r W₁⁻¹e_r (up
    to its own FP8 rounding), not W₂⁻¹e_r (the old residual read in the new frame)."""
    tx = gift(allreduce("data", codec="fp8_e4m3", error_feedback=True), rank=N,
              factor="full_cholesky")
    g, a1 = _data(30, decay=0.7)
    _, a2 = _data(31, decay=0.95)
    params = _params()
    zeros = jax.tree.map(lambda x: jnp.zeros((D, *x.shape)), params)
    grads = jax.tree.map(lambda z: z, zeros)
    grads["layers"]["0"]["mlp"]["down_proj"]["kernel"] = g

    def body(g, st, stats):
        g, stats = jax.tree.map(lambda x: x[0], (g, stats))
        st = jax.tree.map(lambda x: x[0], st)
        out, st = tx.update(g, st, None, gift_stats={KERNEL: stats})
        return jax.tree.map(lambda x: x[None], (out, st))

    step = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P("data"),
                                 check_vma=False))
    init = jax.jit(jax.shard_map(lambda p: jax.tree.map(lambda x: x[None], tx.init(p)),
                                 mesh=_mesh(), in_specs=P(), out_specs=P("data"),
                                 check_vma=False))
    _, st = step(grads, init(params), a1)
    e = np.asarray(_kernel(st.inner_state.residuals[0]))[:, 0]  # (D, N, M) in the W₁ frame
    w1 = np.asarray(st.whitened[KERNEL].factor.w, np.float64)[0, 0]
    assert np.abs(e).max() > 0
    out, st2 = step(zeros, st, a2)
    got = np.asarray(_kernel(out))[0]
    owed = np.linalg.solve(w1, e.mean(0))  # mean_r W₁⁻¹ e_r
    w2 = np.asarray(st2.whitened[KERNEL].factor.w, np.float64)[0, 0]
    stale = np.linalg.solve(w2, e.mean(0))
    rel = lambda x: np.linalg.norm(x - owed) / np.linalg.norm(owed)
    assert rel(got) < 0.15, rel(got)
    assert rel(stale) > 3 * rel(got), (rel(stale), rel(got))
