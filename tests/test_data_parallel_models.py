"""gift_jax.data_parallel_grad on every codec, flax linen and NNX models, GIFT and PLUMAGE
stages, and gradient accumulation (reduce once)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax

# a bound on the relative error of one reduction over 4 replicas, per codec
TOLERANCE = {"fp32": 1e-6, "bf16": 0.01, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2, "mxfp8": 0.1,
             "nvfp4": 0.5, "int8": 0.05}


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _problem(mesh, specs):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"up": jax.random.normal(k1, (32, 64)) / 4, "down": jax.random.normal(k2, (64, 8))}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.device_put(jax.random.normal(k3, (64, 32)), NamedSharding(mesh, P("data")))
    return params, x


def _loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["up"]) @ p["down"] - x[:, :8]) ** 2)


@pytest.mark.parametrize("codec", sorted(TOLERANCE))
def test_every_codec_reduces_fsdp_on_data_and_on_another_axis(codec):
    """``up`` split over data (reduce-scattered into its shard), ``down`` over fsdp (each
    device's shard reduced across data)."""
    mesh = _mesh((4, 2), ("data", "fsdp"))
    specs = {"up": P(None, "data"), "down": P("fsdp")}
    params, x = _problem(mesh, specs)
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh, comm=codec, param_specs=specs)
    _, grads, _, _ = jax.jit(grad_fn)(params, x)
    exact = jax.jit(jax.grad(_loss))(params, x)
    for k in exact:
        err = float(jnp.abs(grads[k] - exact[k]).max() / jnp.abs(exact[k]).max())
        assert err < TOLERANCE[codec], (k, err)
        assert grads[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), 2), k


def test_accumulate_steps_reduces_once_and_averages_the_microbatches():
    mesh = _mesh((8,), ("data",))
    specs = {"up": P(None, "data"), "down": P()}
    params, x = _problem(mesh, specs)
    once = gift_jax.data_parallel_grad(_loss, mesh, comm="fp32", param_specs=specs)
    accum = gift_jax.data_parallel_grad(_loss, mesh, comm="fp32", param_specs=specs,
                                        accumulate_steps=4)
    (l1, g1, _, _), (l2, g2, _, _) = jax.jit(once)(params, x), jax.jit(accum)(params, x)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    for k in g1:
        np.testing.assert_allclose(g1[k], g2[k], rtol=1e-5, atol=1e-6)
    fp8 = gift_jax.data_parallel_grad(_loss, mesh, param_specs=specs, accumulate_steps=4)
    hlo = jax.jit(fp8).lower(params, x).compile().as_text()
    over = gift_jax.parse_hlo(hlo, mesh=mesh).over("data")
    assert sum(op.kind == "all-to-all" for op in over.ops) == 2  # one per leaf, not per micro
    with pytest.raises(ValueError, match="not divisible into accumulate_steps=3"):
        jax.jit(gift_jax.data_parallel_grad(_loss, mesh, accumulate_steps=3))(params, x)


def test_flax_linen_with_logical_partitioning_and_rules():
    """A linen model whose activations carry a batch constraint mapped onto 'data' (which is
    manual inside the map) and whose kernels are split over 'data' and 'fsdp'."""

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.with_logical_constraint(x, ("batch", "embed"))
            h = nn.Dense(64, use_bias=False, kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.2), ("embed", "mlp")))(x)
            h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
            return nn.Dense(8, use_bias=False, kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.2), ("mlp", "out")))(h)

    rules = (("batch", "data"), ("embed", None), ("mlp", "data"), ("out", None))
    mesh = _mesh((8,), ("data",))
    model = MLP()
    x = jax.random.normal(jax.random.key(1), (64, 32))
    with nn.logical_axis_rules(rules):
        boxed = model.init(jax.random.key(0), x)["params"]
        specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    params = jax.device_put(nn.unbox(boxed), specs)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))

    def loss_fn(p, x):
        return jnp.mean((model.apply({"params": p}, x) - x[:, :8]) ** 2)

    grad_fn = gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32", param_specs=specs)

    @jax.jit
    def step(params, x):
        with nn.logical_axis_rules(rules):
            return grad_fn(params, x)[1]

    grads = step(params, x)
    exact = jax.jit(jax.grad(loss_fn))(params, x)
    for a, b, s in zip(jax.tree.leaves(grads), jax.tree.leaves(exact), jax.tree.leaves(specs),
                       strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert a.sharding.is_equivalent_to(s, a.ndim)


def test_flax_nnx_model_and_a_gift_stage_whose_state_is_the_callers():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 64, use_bias=False, rngs=rngs, kernel_init=(
                nnx.with_partitioning(nnx.initializers.normal(0.2), (None, "data"))))
            self.down = nnx.Linear(64, 8, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.down(jnp.tanh(self.up(x)))

    mesh = _mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    specs = nnx.get_partition_spec(state)
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 32)),
                       NamedSharding(mesh, P("data")))

    def loss_fn(state, x):
        return jnp.mean((nnx.merge(graphdef, state)(x) - x[:, :8]) ** 2)

    grads = jax.jit(gift_jax.data_parallel_grad(loss_fn, mesh, param_specs=specs))(state, x)[1]
    assert grads["up"]["kernel"].get_value().sharding.spec == P(None, "data")
    # GIFT around an fp8 all-reduce: replicated params, the stage's state in the train state
    params = jax.device_put(state, NamedSharding(mesh, P()))
    stage = gift_jax.gift(gift_jax.allreduce("data", "fp8_e4m3"), layers=["down/kernel"],
                          rank=8, axis_name="data")
    grad_fn = gift_jax.data_parallel_grad(loss_fn, mesh, comm=stage)
    comm_state = grad_fn.init(params)
    loss, grads, comm_state2, _ = jax.jit(grad_fn)(params, x, comm_state)
    exact = jax.jit(jax.grad(loss_fn))(params, x)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(exact), strict=True):
        assert float(jnp.abs(a - b).max()) < 0.1 * float(jnp.abs(b).max())
    assert jax.tree.structure(comm_state2) == jax.tree.structure(comm_state)


def test_plumage_with_its_communication_is_a_stage_whose_updates_come_back():
    """PLUMAGE with ``communicate=`` is a whole optimizer: its state lives in the caller's
    train state and its output (updates, reduced in fp8) takes the place of the gradients."""
    mesh = _mesh((8,), ("data",))
    params, x = _problem(mesh, {"up": P(), "down": P()})
    tx = gift_jax.plumage(learning_rate=1e-2, rank=4, refresh_every=2,
                          communicate=gift_jax.allreduce("data", codec="fp8_e4m3"))
    steps = {refresh: jax.jit(gift_jax.data_parallel_grad(
        _loss, mesh, comm=tx, stage_args=lambda _, r=refresh: {"plumage_refresh": r}))
        for refresh in (True, False)}
    state = gift_jax.data_parallel_grad(_loss, mesh, comm=tx).init(params)
    losses = []
    for i in range(6):
        refresh = bool(gift_jax.plumage_refresh_due(state))
        assert refresh == (i % 2 == 0)
        loss, updates, state, _ = steps[refresh](params, x, state)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses


def test_optax_multisteps_around_the_optimizer_composes():
    """The reduced gradients feed an ``optax.MultiSteps`` optimizer as any gradient does:
    parameters move every second step (each microbatch is reduced; ``accumulate_steps``
    reduces once instead)."""
    mesh = _mesh((8,), ("data",))
    params, x = _problem(mesh, {"up": P(None, "data"), "down": P()})
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh,
                                          param_specs={"up": P(None, "data"), "down": P()})
    tx = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)

    @jax.jit
    def step(params, opt_state, x):
        _, grads, _, _ = grad_fn(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    p1, opt_state = step(params, opt_state, x)
    p2, opt_state = step(p1, opt_state, x)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p1),
                                                    strict=True))
    assert not np.array_equal(p2["up"], p1["up"])
    assert p2["up"].sharding.spec == P(None, "data")
