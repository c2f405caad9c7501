"""The Optax stage inside jax.shard_map: per-device gradients, optax.chain, replica identity,
error feedback, stochastic rounding, no recompilation, build-time validation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax as gj

N = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def _problem():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (32, 16)) * 0.1, "b": jnp.zeros((16,))}
    x = jax.random.normal(k2, (N, 64, 32))
    y = jax.random.normal(k3, (N, 64, 16))
    return params, x, y


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _train_step(mesh, tx, check_vma=False, pcast=False):
    """A data-parallel step: per-device gradients → the chain (our stage first) → params
    (``pcast``: the parameters marked varying over 'data' before ``jax.grad``)."""

    def step(params, opt_state, x, y):
        local = jax.lax.pcast(params, "data", to="varying") if pcast else params
        grads = jax.grad(_loss)(local, x[0], y[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(params, opt_state, x, y):
        specs = gj.partition_specs(opt_state, "data")
        return jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                             out_specs=(P(), specs), check_vma=check_vma)(params, opt_state,
                                                                          x, y)

    return jax.jit(run)


def _init(mesh, tx, params):
    return gj.init_on_mesh(tx, params, mesh, "data")


@pytest.mark.parametrize("codec", ["fp32", "fp8_e4m3"])
def test_chain_with_adamw_trains_and_replicas_agree(mesh, codec):
    params, x, y = _problem()
    tx = optax.chain(gj.allreduce("data", codec=codec), optax.adamw(1e-2))
    state = _init(mesh, tx, params)
    step = _train_step(mesh, tx)
    shard = NamedSharding(mesh, P("data"))
    x, y = jax.device_put(x, shard), jax.device_put(y, shard)
    loss0 = float(jnp.mean(jax.vmap(_loss, (None, 0, 0))(params, x, y)))
    for _ in range(30):
        params, state = step(params, state, x, y)
    loss = float(jnp.mean(jax.vmap(_loss, (None, 0, 0))(params, x, y)))
    assert loss < 0.9 * loss0
    # params come out of shard_map as P(): check every device's copy is the same bits
    for leaf in jax.tree.leaves(params):
        copies = [np.asarray(s.data) for s in leaf.addressable_shards]
        for c in copies[1:]:
            np.testing.assert_array_equal(c.view(np.uint32), copies[0].view(np.uint32))


def test_no_recompilation_on_second_call(mesh):
    params, x, y = _problem()
    traces = []
    stage = gj.allreduce("data", codec="fp8_e4m3", stochastic_rounding=True)

    def counted_update(u, s, p=None):
        traces.append(1)
        return stage.update(u, s, p)

    tx = optax.chain(optax.GradientTransformation(stage.init, counted_update), optax.sgd(0.1))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = _init(mesh, tx, params)
    step = _train_step(mesh, tx)
    shard = NamedSharding(mesh, P("data"))
    x, y = jax.device_put(x, shard), jax.device_put(y, shard)
    # place the carried values on the shardings the compiled step returns (P() and P(None,)
    # are different cache keys), as a trainer does, then step twice
    out_shardings = step.lower(params, state, x, y).compile().output_shardings
    params, state = jax.device_put((params, state), out_shardings)
    params, state = step(params, state, x, y)
    params, state = step(params, state, x, y)
    assert len(traces) == 1
    assert step._cache_size() == 1


def test_grad_of_replicated_params_inside_shard_map(mesh):
    """With check_vma=True, jax.grad of invariant parameters would insert its own fp32
    all-reduce of the gradient (and the stage would sum again): the stage refuses it. Marked
    varying (pcast), or under check_vma=False, the gradient is per device and the step's HLO
    has no gradient-sized f32 all-reduce besides the stage's FP8 one."""
    params, x, y = _problem()
    grad_bytes = 4 * 32 * 16
    tx = gj.allreduce("data", codec="fp8_e4m3")
    state = tx.init(params)
    shard = NamedSharding(mesh, P("data"))
    args = (params, state, jax.device_put(x, shard), jax.device_put(y, shard))
    with pytest.raises(gj.utils.axes.NotPerDeviceError, match="multiply it by 8"):
        _train_step(mesh, tx, check_vma=True)(*args)
    for check_vma in (True, False):
        report = gj.wire_bytes(_train_step(mesh, tx, check_vma=check_vma, pcast=check_vma),
                               *args)
        big_f32 = [op for op in report.ops if op.kind == "all-reduce" and "f32" in op.dtypes
                   and op.buffer_bytes >= grad_bytes]
        assert not big_f32, report.table()
        assert any("u8" in op.dtypes for op in report.ops), report.table()  # the FP8 wire


def test_error_feedback_keeps_the_running_sum_faithful(mesh):
    g = jax.random.normal(jax.random.key(1), (N, 4096)) * (1 + jnp.arange(4096) % 7)
    exact = np.asarray(g, np.float64).mean(0)
    steps = 16

    def run(error_feedback):
        tx = gj.allreduce("data", codec="fp8_e5m2", error_feedback=error_feedback)

        def body(v):
            v = v[0]
            state = tx.init(v)

            def one(state, _):
                out, state = tx.update(v, state)
                return state, out

            _, outs = jax.lax.scan(one, state, None, length=steps)
            return outs.sum(0)[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        return np.asarray(f(jax.device_put(g, NamedSharding(mesh, P("data")))))

    with_ef, without = run(True), run(False)
    np.testing.assert_array_equal(with_ef, np.broadcast_to(with_ef[:1], with_ef.shape))
    err_ef = np.linalg.norm(with_ef[0] - steps * exact)
    err_plain = np.linalg.norm(without[0] - steps * exact)
    # without feedback the same rounding error repeats every step (grows like T); with it the
    # accumulated error stays at the size of one step's error
    assert err_ef < err_plain / 4, (err_ef, err_plain)


def test_state_layout_and_partition_specs(mesh):
    params, _, _ = _problem()
    tx = optax.chain(gj.allreduce("data", error_feedback=True, stochastic_rounding=True),
                     optax.adam(1e-3))
    state = _init(mesh, tx, params)
    stage_state = state[0]
    assert isinstance(stage_state, gj.AllReduceState)
    local, shards = stage_state.residuals
    assert local["w"].shape == (N, 32, 16)  # one buffer per device, sharded over 'data'
    assert local["w"].sharding.spec[0] == "data"
    assert stage_state.key.shape == (2,)
    specs = gj.partition_specs(state, "data")
    assert specs[0].key == P() and specs[1][0].mu["w"] == P()


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [({"codec": "int4"}, ValueError, "codec='int4'.*allowed values"),
     ({"block_size": -4}, ValueError, "block_size=-4"),
     ({"backend": "triton"}, ValueError, "backend='triton'"),
     ({"accumulate": "fp8"}, ValueError, "global_scale"),
     ({"intra_axis": "local", "error_feedback": True}, ValueError, "error_feedback"),
     ({"seed": 1.5}, TypeError, "seed")],
)
def test_build_time_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        gj.allreduce("data", **kwargs)


def test_init_rejects_bad_leaves_and_policies():
    with pytest.raises(TypeError, match=r"\['step'\] has dtype int32"):
        gj.allreduce("data").init({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)})
    with pytest.raises(ValueError):  # a policy pytree that doesn't match the gradients
        gj.allreduce("data", policy={"w": "fp32"}).init({"w": jnp.ones(3), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match="codec='fp9'"):
        gj.allreduce("data", policy=lambda path, leaf: "fp9").init({"w": jnp.ones(3)})


def test_single_device_identity():
    tx = optax.chain(gj.allreduce(None, codec="fp8_e4m3"), optax.sgd(1.0))
    params = {"w": jnp.ones((3, 2))}
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)({"w": jnp.full((3, 2), 0.5)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), -0.5)


def test_reframe_error_feedback_maps_own_residuals_and_zeroes_moved_shard_rows(mesh):
    """The protocol a wrapping stage (GIFT at a refresh) uses: each replica's own residual goes
    through ``change``; the shard owners' rows of moved leaves are zeroed (located by the
    bucket plan of a bare all-reduce; every row without one), the other rows are kept."""
    stage = gj.allreduce("data", codec="fp8_e4m3", error_feedback=True)
    g = {"w": jax.random.normal(jax.random.key(3), (N, 32, 16)),  # 4 rows of 128
         "b": jax.random.normal(jax.random.key(4), (N, 16))}  # 1 row; 8 rows: one per device
    double_w = lambda t: {"w": 2 * t["w"], "b": t["b"]}
    moved = {"w": True, "b": False}

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        _, st = stage.update(g, stage.init(g))
        known = gj.reframe_error_feedback(st, stage, g, double_w, moved)
        unknown = gj.reframe_error_feedback(st, optax.identity(), g, double_w, moved)
        return st.residuals, known.residuals, unknown.residuals

    spec = P("data")
    (local, shard), (k_local, k_shard), (u_local, u_shard) = jax.tree.map(
        np.asarray, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                          check_vma=False))(
            jax.device_put(g, NamedSharding(mesh, spec))))
    for mapped in (k_local, u_local):
        np.testing.assert_array_equal(mapped["w"], 2 * local["w"])
        np.testing.assert_array_equal(mapped["b"], local["b"])
    (shard,), (k_shard,), (u_shard,) = shard, k_shard, u_shard  # one bucket: [N, 1, 128]
    nonzero = lambda x: [i for i in range(N) if np.any(x[i] != 0)]
    assert len(nonzero(shard)) == 5 and not nonzero(u_shard)
    kept = nonzero(k_shard)
    assert len(kept) == 1  # b's row: kept as it was; w's four rows zeroed
    np.testing.assert_array_equal(k_shard[kept[0]], shard[kept[0]])
