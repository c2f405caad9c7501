"""PLUMAGE communication on 8 simulated CPU devices: error feedback across projection changes
and the PLUMAGE + GIFT composition (issue #5, part 4)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import gift_jax as gj
from gift_jax import whitening as wh
from gift_jax.comm.stage import reset_error_feedback
from gift_jax.lowrank import scale_by_plumage
from gift_jax.whitening.stage import gift

D = 8
KERNEL = "mlp/down_proj/kernel"


def _mesh():
    return Mesh(np.array(jax.devices()[:D]), ("data",))


def _recorder():
    """Identity stage whose state is the tree it last saw (here: the reduced coordinates)."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g)
    )


def _step(opt, state, refresh):
    """jit(shard_map(update)) on per-device grads (and stats); updates stacked per device."""
    specs = gj.partition_specs(state, "data")

    def body(params, state, g, stats):
        first = lambda t: jax.tree.map(lambda x: x[0], t)
        kw = {"plumage_refresh": refresh}
        if stats is not None:
            kw["gift_stats"] = first(stats)
        u, state = opt.update(first(g), state, params, **kw)
        return jax.tree.map(lambda x: x[None], u), state

    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P(), specs, P("data"),
                                                               P("data")),
                                 out_specs=(P("data"), specs), check_vma=False))


def _residuals(comm_state):
    nodes = jax.tree.leaves(comm_state, is_leaf=lambda x: isinstance(x, gj.AllReduceState))
    return [r for s in nodes if isinstance(s, gj.AllReduceState)
            for r in jax.tree.leaves(s.residuals)]


def _max_abs(arrays):
    return max(float(np.abs(np.asarray(a)).max()) for a in arrays)


def _grads(rng, params, steps):
    """Per step, per device: a fixed per-device part plus small noise (systematic rounding)."""
    base = jax.tree.map(lambda x: rng.normal(size=(D,) + x.shape), params)
    return [jax.tree.map(lambda b: jnp.asarray(b + 0.05 * rng.normal(size=b.shape),
                                               jnp.float32), base) for _ in range(steps)]


def _assert_replicas_identical(tree):
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        assert np.array_equal(leaf.view(np.uint8), np.broadcast_to(leaf[:1], leaf.shape).view(
            np.uint8))


# ------------------------------------------------------------------- error feedback


def test_error_feedback_tracks_projected_coordinates_between_refreshes():
    """Σ_t communicated coordinates follows Σ_t D⁻¹Pᵀ mean(G_t) far better with EF."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((32, 16)), "b": jnp.zeros((16,))}
    grads = _grads(rng, params, 20)
    errors = {}
    for ef in (True, False):
        stage = gj.allreduce("data", codec="fp8_e5m2", error_feedback=ef)
        opt = scale_by_plumage(4, 100, communicate=optax.chain(stage, _recorder()))
        state = gj.init_on_mesh(opt, params, _mesh())
        step = _step(opt, state, False)
        sent = true = 0.0
        for g in grads:
            _, state = step(params, state, g, None)
            leaf = state.leaves["w"]
            p, d = np.asarray(leaf.projector[0]), np.asarray(leaf.probs[0])
            true = true + (p.T @ np.asarray(g["w"]).mean(0)) / d[:, None]
            sent = sent + np.asarray(state.comm_state[1]["w"])
        errors[ef] = np.linalg.norm(sent - true)
        if ef:
            assert _max_abs(_residuals(state.comm_state)) > 0
    assert errors[True] < 0.3 * errors[False], errors


def test_error_feedback_is_reset_by_resampling_only_when_it_happens():
    """A κ-resample (under lax.cond) zeroes the residuals before this step's communication:
    the step equals the same step from a state with zeroed residuals; other steps do not."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.zeros((32, 16)), "b": jnp.zeros((16,))}
    grads = _grads(rng, params, 4)
    stage = gj.allreduce("data", codec="fp8_e5m2", error_feedback=True)
    opt = scale_by_plumage(4, 100, resample_every=2, communicate=stage)
    state = gj.init_on_mesh(opt, params, _mesh())
    refresh, ordinary = _step(opt, state, True), _step(opt, state, False)
    _, state = refresh(params, state, grads[0], None)  # count 0 → 1
    assert _max_abs(_residuals(state.comm_state)) == 0.0
    _, state = ordinary(params, state, grads[1], None)  # count 1: residuals build up
    for t, resampled in ((2, True), (3, False)):  # count 2: resample; count 3: none
        assert _max_abs(_residuals(state.comm_state)) > 0
        _, state_next = ordinary(params, state, grads[t], None)
        cleared = state._replace(comm_state=reset_error_feedback(state.comm_state))
        _, from_cleared = ordinary(params, cleared, grads[t], None)
        same = all(np.array_equal(a, b) for a, b in zip(
            _residuals(state_next.comm_state), _residuals(from_cleared.comm_state), strict=True))
        assert same == resampled, t
        assert _max_abs(_residuals(state_next.comm_state)) > 0
        state = state_next


# -------------------------------------------------------------------- PLUMAGE + GIFT


def _gift_params():
    # down_proj (32 → 8): input side projected (GIFT-able); attn (8 → 32): output side.
    return {"mlp": {"down_proj": {"kernel": jnp.zeros((32, 8))}},
            "attn": {"kernel": jnp.zeros((8, 32))}, "b": jnp.zeros((8,))}


def _input_stats(rng, n=32, tokens=64):
    x = rng.normal(size=(D, tokens, n)) * 0.8 ** np.arange(n)
    return {KERNEL: jnp.asarray(np.einsum("dti,dtj->dij", x, x) / tokens, jnp.float32)}


def _gift_opt(inner, refresh_stage, k=4, **kw):
    comm = gift(inner, layers=["mlp/down_proj"], factor="full_symmetric")
    return scale_by_plumage(k, 100, communicate=optax.chain(comm, _recorder()),
                            communicate_refresh=refresh_stage, **kw)


def _gift_state(state):
    return optax.tree.get(state.comm_state, "GiftState")


def test_gift_refresh_resets_residuals_and_builds_projected_factor():
    rng = np.random.default_rng(2)
    params = _gift_params()
    grads = _grads(rng, params, 4)
    stage = functools.partial(gj.allreduce, "data", codec="fp8_e4m3", error_feedback=True)
    opt = _gift_opt(stage(), stage())
    state = gj.init_on_mesh(opt, params, _mesh())
    # A in the layer's coordinates
    assert _gift_state(state).whitened[KERNEL].stats.shape == (1, 32, 32)
    refresh, ordinary = _step(opt, state, True), _step(opt, state, False)
    stats_at = {0: _input_stats(rng), 3: _input_stats(rng)}
    for t in range(4):  # refresh, ordinary, ordinary, refresh
        is_refresh, stats = t in stats_at, stats_at.get(t)
        u, state = (refresh if is_refresh else ordinary)(params, state, grads[t], stats)
        _assert_replicas_identical(u)
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(u))
        res = _max_abs(_residuals(state.comm_state))
        assert (res == 0.0) if is_refresh else (res > 0), (t, res)
        if is_refresh:  # the full-space refresh slot keeps its own (consistent) residuals
            assert _max_abs(_residuals(state.refresh_comm_state)) > 0
    gs = _gift_state(state)
    assert int(gs.refreshes) == 2
    # The last refresh's factor is that of MᵀĀM, M = P·D⁻¹ of the *new* projection.
    a = np.asarray(stats_at[3][KERNEL]).mean(0)
    m = np.asarray(state.leaves["mlp"]["down_proj"]["kernel"].projector[0]) / np.asarray(
        state.leaves["mlp"]["down_proj"]["kernel"].probs[0])[None, :]
    ema = np.asarray(gs.whitened[KERNEL].stats[0])
    assert np.all(np.isfinite(ema)) and not np.allclose(ema, a)  # EMA of two refreshes
    want, _ = wh.make_factor(jnp.asarray(m.T @ ema @ m), "full_symmetric", damping=1e-3)
    got = jax.tree.map(lambda x: np.asarray(x)[0], gs.whitened[KERNEL].factor)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-3, atol=1e-5)


def test_gift_composition_is_exact_in_fp32():
    """Whiten → fp32 all-reduce → unwhiten of the coordinates changes nothing (to rounding)."""
    rng = np.random.default_rng(3)
    params = _gift_params()
    grads = _grads(rng, params, 3)
    fp32 = functools.partial(gj.allreduce, "data", codec="fp32")
    with_gift = _gift_opt(fp32(), fp32())
    plain = scale_by_plumage(4, 100, communicate=fp32())
    outs = []
    for opt, gifted in ((with_gift, True), (plain, False)):
        state = gj.init_on_mesh(opt, params, _mesh())
        refresh, ordinary = _step(opt, state, True), _step(opt, state, False)
        us = []
        for t in range(3):
            stats = _input_stats(np.random.default_rng(t)) if gifted and t == 0 else None
            u, state = (refresh if t == 0 else ordinary)(params, state, grads[t], stats)
            us.append(u)
        outs.append(us)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)


# ------------------------------------------------------------------------ validation


def _local_opt(layers=("mlp/down_proj",), refresh_stage=True, mask=None):
    comm = gift(gj.allreduce(None), layers=list(layers))
    return scale_by_plumage(4, 100, communicate=comm, mask=mask,
                            communicate_refresh=gj.allreduce(None) if refresh_stage else None)


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": ("attn",)}, "output side of GIFT layer 'attn/kernel'"),
    ({"mask": {"mlp": {"down_proj": {"kernel": False}}, "attn": {"kernel": True},
               "b": False}}, "'mlp/down_proj/kernel'.*not projected"),
    ({"refresh_stage": False}, "communicate_refresh"),
])
def test_gift_composition_bad_settings_name_the_layer(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _local_opt(**kwargs).init(_gift_params())


def test_gift_stats_required_on_refresh_and_refused_otherwise():
    opt = _local_opt()
    params = _gift_params()
    state = opt.init(params)
    stats = {KERNEL: jnp.eye(32)}
    with pytest.raises(ValueError, match="need gift_stats"):
        opt.update(params, state, params, plumage_refresh=True)
    with pytest.raises(ValueError, match="only accepted on refresh steps"):
        opt.update(params, state, params, plumage_refresh=False, gift_stats=stats)
    _, no_params = opt.update(params, state, None, plumage_refresh=True, gift_stats=stats)
    assert int(_gift_state(no_params).refreshes) == 1  # the widths came through the hook
    with pytest.raises(ValueError, match="communicate_refresh needs communicate"):
        scale_by_plumage(4, communicate_refresh=gj.allreduce(None))
