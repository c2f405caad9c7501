"""GIFT routing (gift(route_frame=...)): each layer through the transport with the smaller
measured round-trip error, decided on refresh steps, identical on every replica, no recompile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gift_jax.comm.stage import allreduce
from gift_jax.whitening.stage import gift, whitened_fraction
from tests.test_gift import KERNEL, D, _data, _kernel, _mesh, _params

CODEC = "fp8_e4m3"


def _per_device_step(tx, traces):
    """jit(shard_map(update)) with everything per device (leading axis D), so that each
    replica's state comes back; ``traces`` records (refresh?) per trace."""

    def body(g, st, stats):
        traces.append(stats is not None)
        g, st = jax.tree.map(lambda x: x[0], (g, st))
        kw = {} if stats is None else {"gift_stats": {KERNEL: stats[0]}}
        out, st = tx.update(g, st, None, **kw)
        return jax.tree.map(lambda x: x[None], (out, st))

    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("data"), out_specs=P("data"),
                                 check_vma=False))


def _per_device_init(tx):
    return jax.jit(jax.shard_map(lambda p: jax.tree.map(lambda x: x[None], tx.init(p)),
                                 mesh=_mesh(), in_specs=P(), out_specs=P("data"),
                                 check_vma=False))(_params())


def _grads(g):
    zeros = jax.tree.map(lambda x: jnp.zeros((D, *x.shape)), _params())
    zeros["layers"]["0"]["mlp"]["down_proj"]["kernel"] = g
    return zeros


def _use(st):
    """(D,) per-replica routing flag of the one selected matrix."""
    return np.asarray(st.use_whitening[KERNEL])[:, 0]


# Muon frame (rank-4 factor, FP8): the whitened transport wins by ~1.7x when the factor was
# built from the gradient's own input statistics, and loses by ~2x when it was built from a
# differently rotated input distribution (the inverse whitener then amplifies the rounding
# error into the gradient's directions).
TX = gift(allreduce("data", codec=CODEC), rank=4, ema=0.0, route_frame="muon")
TRACES: list[bool] = []
STEP = _per_device_step(TX, TRACES)
PLAIN = _per_device_step(gift(allreduce("data", codec=CODEC), rank=4, ema=0.0), [])


def test_routes_euclidean_when_whitening_is_worse_and_back_when_it_helps_without_recompiling():
    g, a_own = _data(0)
    _, a_rotated = _data(7)
    grads = _grads(g)
    st0 = _per_device_init(TX)
    assert _use(st0).all()  # before any refresh: the identity factor, labelled whitened
    TRACES.clear()

    out1, st1 = STEP(grads, st0, a_rotated)  # refresh: stale factor → Euclidean
    assert not _use(st1).any()
    err = np.asarray(st1.route_error[KERNEL])[:, :, 0]  # (D, [euclidean, whitened])
    assert (err == err[:1]).all() and err[0, 1] > 1.5 * err[0, 0]
    assert float(whitened_fraction(jax.tree.map(lambda x: x[0], st1))) == 0.0

    # an ordinary step routed Euclidean is exactly the plain FP8 all-reduce
    out_e, st_e = STEP(grads, st1, None)
    plain = jax.jit(jax.shard_map(
        lambda x: allreduce("data", codec=CODEC).update(x[0], allreduce(
            "data", codec=CODEC).init(x[0]))[0][None], mesh=_mesh(), in_specs=P("data"),
        out_specs=P("data"), check_vma=False))(g)
    np.testing.assert_array_equal(_kernel(out_e), plain)
    assert not _use(st_e).any()  # kept until the next refresh

    out2, st2 = STEP(grads, st_e, a_own)  # refresh: matching factor → whitened again
    assert _use(st2).all()
    err = np.asarray(st2.route_error[KERNEL])[:, :, 0]
    assert (err == err[:1]).all() and err[0, 1] < 0.8 * err[0, 0]
    # routed whitened: bit-identical to the always-whitening stage refreshed with the same A
    ref, _ = PLAIN(grads, _per_device_init(TX)._replace(use_whitening={}, route_error={}),
                   a_own)
    np.testing.assert_array_equal(_kernel(out2), _kernel(ref))
    out_w, st_w = STEP(grads, st2, None)
    assert _use(st_w).all()
    # flips in both directions: one trace per variant, the routing is data, not a new program
    assert TRACES == [True, False]
    assert STEP._cache_size() == 2
    del out1


def test_route_frames_decide_by_their_own_error_adam_keeps_euclidean():
    """Adam frame: G/(|G|+ε) is the sign of every element FP8 keeps, so the Euclidean
    transport's error is ~0 and whitening (which unwhitens rounding errors into small
    elements, flipping signs) loses: the layer is routed Euclidean; in the whitened frame the
    same gradient and factor are routed whitened."""
    g, a = _data(0)
    for frame, want in (("adam", False), ("whitened", True)):
        tx = gift(allreduce("data", codec=CODEC), rank=4, route_frame=frame)
        _, st = _per_device_step(tx, [])(_grads(g), _per_device_init(tx), a)
        assert (_use(st) == want).all(), frame


def test_bad_route_settings():
    with pytest.raises(ValueError, match=r"route_frame must be one of \('off', 'euclidean', "
                                         r"'whitened', 'adam', 'muon'\), got 'sgd'"):
        gift(allreduce("data"), route_frame="sgd")
    with pytest.raises(ValueError, match="must be a gift_jax.allreduce stage"):
        gift(optax_identity(), route_frame="adam")


def optax_identity():
    import optax

    return optax.identity()


def test_off_keeps_the_state_structure():
    """route_frame='off' adds no state leaves (old checkpoints restore)."""
    st = gift(allreduce("data"), rank=4).init(_params())
    assert st.use_whitening == {} and st.route_error == {}
    assert whitened_fraction(st) is None


def test_config_route_frame_validated_and_resolved_to_the_optimizer():
    from gift_jax.training.config import ConfigError, validate_config
    from gift_jax.training.method import route_frame
    from tests.test_training import small_config

    with pytest.raises(ConfigError, match=r"^gift\.route_frame='sgd' is not supported; allowed: "
                                          r"off, euclidean, whitened, adam, muon, optimizer$"):
        validate_config(small_config("gift_fp8", **{"gift.route_frame": "sgd"}), 8)
    assert route_frame(small_config("gift_fp8")) == "adam"  # configs/base.py: "optimizer"
    assert route_frame(small_config("gift_fp8", "muon")) == "muon"
    assert route_frame(small_config("gift_fp8", **{"gift.route_frame": "off"})) == "off"


def test_checkpoint_predating_route_frame_resumes_only_at_off():
    """A config written before gift.route_frame existed completes to 'off' (always whiten),
    today's behaviour; configs/base.py's new-run default is 'optimizer'."""
    import json
    import runpy

    from gift_jax.training.config import (
        TRAINER_DEFAULTS,
        apply_overrides,
        complete_config,
        config_differences,
        to_json,
    )
    from tests.test_training import ROOT

    assert TRAINER_DEFAULTS["gift"]["route_frame"] == "off"
    config = complete_config(runpy.run_path(str(ROOT / "configs" / "tiny.py"))["get_config"]())
    old = json.loads(to_json(config))
    del old["gift.route_frame"]
    changed = apply_overrides(config, [("gift.route_frame", "off")])
    assert config_differences(json.dumps(old), changed) == []
    assert config_differences(json.dumps(old), apply_overrides(
        config, [("gift.route_frame", "adam")])) == [
        "gift.route_frame: <absent> (checkpoint) != 'adam' (now)"]


@pytest.mark.slow
def test_trainer_logs_the_routing_and_stays_replica_identical():
    from gift_jax.whitening.stage import GiftState
    from tests.test_training import assert_replicas_identical, run, small_config

    config = small_config("gift_fp8", **{"train.diagnostics_every": 2,
                                         "gift.layers": ("*/mlp/down_proj", "*/attn/o_proj")})
    result = run(config, stop_after=3)
    assert result.summary["skipped_steps"] == 0
    assert_replicas_identical(result.params)
    (gs,) = [s for s in jax.tree.leaves(result.opt_state, is_leaf=lambda x: isinstance(
        x, GiftState)) if isinstance(s, GiftState)]
    assert sorted(gs.use_whitening) == ["layers/0/attn/o_proj/kernel",
                                        "layers/0/mlp/down_proj/kernel"]
    diag = [h for h in result.history if "gift/whitened_fraction" in h]
    assert diag and all(0.0 <= h["gift/whitened_fraction"] <= 1.0 for h in diag)
    assert "gift/whitened/layers/0/mlp/down_proj/kernel" in diag[0]
