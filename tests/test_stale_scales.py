"""Stale synced per-tensor scales (``gift_jax.allreduce(scale_sync_every=K)``, issue #46 item
3): K = 1 is the fresh reduction, a sync step is the ``global_scale=True`` reduction bit for
bit, the scales stay constant between syncs, saturation is counted exactly on a hand-built
case, non-finite values stay NaN, replicas agree bit for bit; and the trainer's setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax as gj
from gift_jax.comm.stage import saturation_metrics
from gift_jax.training import ConfigError

R = 8  # devices (tests/conftest.py)


def _mesh():
    return jax.make_mesh((R,), ("data",))


def _run(tx, grads):
    """The stage over consecutive steps; per step ``(per-device outputs, state, per-device
    copies of the state)``."""
    mesh = _mesh()

    def body(g, st):
        out, st = tx.update(jax.tree.map(lambda x: x[0], g), st)
        every = jax.tree.map(lambda x: jnp.asarray(x)[None], st)  # each device's own copy
        return jax.tree.map(lambda x: x[None], out), st, every

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                                 out_specs=(P("data"), P(), P("data")), check_vma=False))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                 check_vma=False))
    state = init(jax.tree.map(lambda x: x[0], grads[0]))
    shard = NamedSharding(mesh, P("data"))
    out = []
    for g in grads:
        o, state, every = step(jax.device_put(g, shard), state)
        out.append(jax.device_get((o, state, every)))
    return out


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": (rng.standard_normal((R, 16, 32)) * (1 + t)).astype(np.float32),
             "b": rng.standard_normal((R, 7)).astype(np.float32)} for t in range(steps)]


def _equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True))


def test_k1_is_fresh_and_sync_steps_are_the_global_scale_reduction():
    grads = _grads(5)
    fresh = _run(gj.allreduce("data", "fp8_e4m3"), grads)
    k1 = _run(gj.allreduce("data", "fp8_e4m3", scale_sync_every=1), grads)
    assert all(_equal(a[0], b[0]) for a, b in zip(fresh, k1, strict=True))
    assert k1[0][1].scales is None  # K = 1: no scale state (the layout of before)
    stale = _run(gj.allreduce("data", "fp8_e4m3", scale_sync_every=3), grads)
    shared = _run(gj.allreduce("data", "fp8_e4m3", global_scale=True), grads)
    for t in range(5):
        # steps 0 and 3 sync: fresh scales pmax-shared, exactly the global_scale reduction
        assert _equal(stale[t][0], shared[t][0]) == (t % 3 == 0), t
    scales = [s[1].scales for s in stale]
    assert _equal(scales[0], scales[1]) and _equal(scales[0], scales[2])  # held between syncs
    assert not _equal(scales[2], scales[3])  # the gradients grew: step 3 synced anew
    assert all(np.all(s["w"] > 0) for s in scales)
    # the later steps' gradients are larger than step 0's: beyond the stale scales
    assert stale[1][1].saturation["w"][0] > 0 and stale[0][1].saturation["w"][0] == 0
    assert int(stale[4][1].scale_step) == 5


def test_saturation_counted_exactly_on_a_hand_built_case():
    """Step 0 syncs the senders' scale to 3.5/448 = 2⁻⁷ (replica r's spike 3.5 at position
    200 + r) and the mean's to 0.875/448 = 2⁻⁹ (the mean is B, |B| ≤ 0.875, the spikes /8);
    step 1 puts 5.0 at r+1 positions of replica r (36 sent values beyond 3.5; their means
    3.5/8 within range) and 1.5 at 10 positions of every replica (within the senders' range;
    10 means beyond 0.875)."""
    n = 256
    base = np.linspace(-0.875, 0.875, n - 64, dtype=np.float32)
    step0 = np.zeros((R, n), np.float32)
    step0[:, :n - 64] = base
    step0[:, 100:146] = 0.0  # where the hand-built values go
    for r in range(R):
        step0[r, 200 + r] = 3.5
    step1 = step0.copy()
    pos = 100
    for r in range(R):
        step1[r, pos:pos + r + 1] = 5.0
        pos += r + 1
    step1[:, 136:146] = 1.5
    grads = [{"w": step0.reshape(R, 16, 16)}, {"w": step1.reshape(R, 16, 16)}]
    res = _run(gj.allreduce("data", "fp8_e4m3", scale_sync_every=50), grads)
    want = np.float32([[2.0**-7], [2.0**-9]])
    np.testing.assert_array_equal(res[0][1].scales["w"], want)
    np.testing.assert_array_equal(res[1][1].scales["w"], want)  # held
    sat = res[1][1].saturation["w"]
    assert sat[0] == np.float32(36) / np.float32(R * n), sat
    assert sat[1] == np.float32(10) / np.float32(n), sat
    assert saturation_metrics(res[1][1]) == {"comm/saturation/w": float(sat[0]),
                                            "comm/saturation_mean/w": float(sat[1])}
    mean = res[1][0]["w"][0].reshape(-1)
    np.testing.assert_array_equal(mean[136:146], np.float32(0.875))  # clipped, not 1.5
    np.testing.assert_array_equal(mean[100:101], np.float32(3.5 / R))  # 5.0 clipped to 3.5
    assert np.all(res[0][1].saturation["w"] == 0)  # a sync step saturates nothing


def test_replicas_identical_and_non_finite_stays_nan():
    grads = _grads(4, seed=3)
    grads[2]["w"][5, 3, 4] = np.inf  # a replica's overflow on a step between syncs
    res = _run(gj.allreduce("data", "fp8_e5m2", scale_sync_every=4), grads)
    for out, _, every in res:
        for leaf in jax.tree.leaves(out):  # the reduced values: identical on every device
            assert all(leaf[i].tobytes() == leaf[0].tobytes() for i in range(R))
        replicated = (every.key, every.scales, every.scale_step, every.saturation)
        for leaf in jax.tree.leaves(replicated):
            assert all(leaf[i].tobytes() == leaf[0].tobytes() for i in range(R))
    assert np.isnan(res[2][0]["w"]).any()  # NaN everywhere it lands, never clipped garbage
    assert np.isfinite(res[2][0]["b"]).all() and np.isfinite(res[3][0]["w"]).all()
    np.testing.assert_array_equal(res[3][1].scales["w"], res[1][1].scales["w"])


def test_bad_settings_are_one_line():
    with pytest.raises(ValueError, match=r"scale_sync_every=0 must be an int >= 1"):
        gj.allreduce("data", scale_sync_every=0)
    with pytest.raises(ValueError, match="flat reduction"):
        gj.allreduce("data", scale_sync_every=4, intra_axis="intra")


def test_trainer_setting_validated():
    from trainer_kit import recipe_of, small_config

    recipe = recipe_of(small_config("fp8", **{"comm.scale_sync_every": 50}))
    assert recipe.comm.scale_sync_every == 50
    for value in (0, -3):
        with pytest.raises(ConfigError, match=rf"^comm.scale_sync_every={value} must be an "
                                              r"int >= 1$"):
            recipe_of(small_config("fp8", **{"comm.scale_sync_every": value}))
    with pytest.raises(ConfigError, match="comm.scale_sync_every=4 reuses per-tensor scales"):
        recipe_of(small_config("fp8", **{"comm.scale_sync_every": 4, "comm.codec": "mxfp8"}))
    with pytest.raises(ConfigError, match="set comm.reduce_in=after"):
        recipe_of(small_config("fp8", **{"comm.scale_sync_every": 4,
                                         "comm.reduce_in": "backward"}))


@pytest.mark.slow
def test_trainer_reports_saturation_replicas_identical():
    from trainer_kit import assert_replicas_identical, recipe_of, run, small_config

    config = small_config("gift_fp8", **{"comm.scale_sync_every": 3,
                                         "comm.codec": "fp8_e5m2"})
    result = run(config, stop_after=4)
    assert_replicas_identical((result.params, result.opt_state))
    metrics = recipe_of(config).method.state_metrics(result.opt_state)  # the diagnostics
    names = [k for k in metrics if k.startswith("comm/saturation/")]
    assert "comm/saturation/layers/0/mlp/down_proj/kernel" in names, sorted(metrics)
    assert all(0.0 <= metrics[k] <= 1.0 for k in names)
