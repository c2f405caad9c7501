"""gift_jax.data_parallel_grad: the quantized reduction inside a plain GSPMD ``jax.jit``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax
from gift_jax.comm.data_parallel import gradient_shard_bytes


def _mesh(shape, names):  # GSPMD: Auto axes (jax.make_mesh's default is Explicit)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _problem(mesh, specs=None, rows=64):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"up": jax.random.normal(k1, (16, 64)) / 4,
              "down": jax.random.normal(k2, (64, 1)) / 8}
    x = jax.random.normal(k3, (rows, 16))
    batch = {"x": x, "y": jnp.sin(x[:, :1])}
    specs = specs or {"up": P(), "down": P()}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    return params, batch, specs


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["up"]) @ p["down"] - b["y"]) ** 2)


def _steps(mesh, specs, comm, params, batch):
    tx = optax.adamw(1e-2)
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh, comm=comm, param_specs=specs)
    shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}

    @jax.jit
    def ours(params, batch):
        loss, grads, _, _ = grad_fn(params, batch)
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates), grads, loss

    @jax.jit
    def xla(params, batch):  # XLA's own reduction: the gradient of the global loss
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        grads = jax.lax.with_sharding_constraint(grads, shard)
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates), grads, loss

    return ours, xla


MESHES = {
    "replicated": ((8,), ("data",), {"up": P(), "down": P()}),
    "fsdp_axis": ((4, 2), ("data", "fsdp"), {"up": P(None, "fsdp"), "down": P("fsdp")}),
    "fsdp_on_data": ((8,), ("data",), {"up": P(None, "data"), "down": P("data")}),
    "both": ((4, 2), ("data", "fsdp"), {"up": P("fsdp", "data"), "down": P("fsdp")}),
}


@pytest.mark.parametrize("layout", list(MESHES))
def test_fp32_matches_xla_bit_for_bit_in_the_params_shardings(layout):
    shape, names, specs = MESHES[layout]
    mesh = _mesh(shape, names)
    params, batch, specs = _problem(mesh, specs)
    ours, xla = _steps(mesh, specs, "fp32", params, batch)
    (p1, g1, l1), (p2, g2, l2) = ours(params, batch), xla(params, batch)
    # With the model axes (fsdp) GSPMD partitions the *model's* compute of the two programs
    # differently (inside the map over data, or over the whole mesh), so a few gradient
    # elements differ in the last bit before any reduction; without them the per-device
    # arithmetic is the same and the fp32 reduction is XLA's own, bit for bit.
    exact = "fsdp" not in names
    for k in p1:
        for a, b in ((p1[k], p2[k]), (g1[k], g2[k])):
            if exact:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=k)
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
        assert g1[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), g1[k].ndim), k
    assert float(l1) == float(l2) if exact else abs(float(l1) - float(l2)) < 1e-6


@pytest.mark.parametrize("layout", list(MESHES))
def test_fp8_sends_only_u8_gradient_bytes_over_data(layout):
    shape, names, specs = MESHES[layout]
    mesh = _mesh(shape, names)
    params, batch, specs = _problem(mesh, specs)
    ours, xla = _steps(mesh, specs, "fp8_e4m3", params, batch)
    over = gift_jax.parse_hlo(ours.lower(params, batch).compile().as_text(),
                              mesh=mesh).over("data")
    big = [op for op in over.ops if op.buffer_bytes > 16]  # the loss's 4-byte pmean aside
    # FSDP on data: the forward gathers each parameter split over data (f32, the weights)
    weights = [op for op in big if op.kind == "all-gather" and op.dtypes == ("f32",)]
    split = sum(params[k].size * 4 for k, s in specs.items() if "data" in str(s))
    assert sum(op.buffer_bytes for op in weights) <= split
    grads = [op for op in big if op not in weights]
    assert grads and all(set(op.dtypes) == {"u8"} for op in grads), over.ops
    (_, g1, _), (_, g2, _) = ours(params, batch), xla(params, batch)
    for k in g1:  # fp8: close to the exact reduction, not equal
        err = float(jnp.abs(g1[k] - g2[k]).max() / jnp.abs(g2[k]).max())
        assert 0 < err < 0.1, (k, err)
        assert g1[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), g1[k].ndim), k


@pytest.mark.parametrize("comm", ["fp8_e4m3", "fp32"])
def test_fsdp_on_data_never_holds_the_full_gradients(comm):
    """FSDP on the data axis, 8 layers of 256x256 split over data: from the compiled
    program's memory analysis, the reduced gradients are the shards (<= 1.1x), and the
    temporaries beyond the gathered weights (which the backward pass reads) hold one layer's
    whole per-replica gradient and its wire buffers at a time, never the 8 layers'."""
    mesh = _mesh((8,), ("data",))
    layers, n = 8, 256
    params = {f"w{i}": jax.random.normal(jax.random.key(i), (n, n)) / 16 for i in range(layers)}
    specs = {k: P(None, "data") for k in params}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    x = jax.device_put(jax.random.normal(jax.random.key(99), (64, n)),
                       NamedSharding(mesh, P("data")))

    def loss(p, b):
        h = b
        for i in range(layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean((h - b) ** 2)

    grad_fn = gift_jax.data_parallel_grad(loss, mesh, comm=comm, param_specs=specs)
    mem = jax.jit(lambda p, b: grad_fn(p, b)[1]).lower(params, x).compile().memory_analysis()
    shard = gradient_shard_bytes(params, specs, mesh)
    leaf, gathered = n * n * 4, layers * n * n * 4
    assert shard == gathered // 8
    assert mem.output_size_in_bytes <= 1.1 * shard, (mem.output_size_in_bytes, shard)
    grad_temps = mem.temp_size_in_bytes - gathered
    assert grad_temps <= 1.5 * leaf, (grad_temps, leaf)  # full gradients: 8 leaves


def test_sums_stay_sums_and_the_loss_is_the_global_mean():
    mesh = _mesh((8,), ("data",))
    params, batch, _ = _problem(mesh)

    def loss_fn(p, b):
        return _loss(p, b), {"tokens": jnp.float32(b["x"].shape[0]), "peak": jnp.max(b["x"]),
                             "loss": _loss(p, b)}

    grad_fn = gift_jax.data_parallel_grad(
        loss_fn, mesh, comm="fp32", has_aux=True,
        aux_reduce={"tokens": "sum", "peak": "max", "loss": "mean"})
    loss, _, state, aux = jax.jit(grad_fn)(params, batch)
    assert state is None
    assert float(aux["tokens"]) == 64.0
    assert float(aux["peak"]) == float(jnp.max(batch["x"]))
    np.testing.assert_allclose(float(loss), float(_loss(params, batch)), rtol=1e-6)
    np.testing.assert_allclose(float(aux["loss"]), float(loss), rtol=1e-6)


def test_a_stage_with_error_feedback_keeps_its_state_in_the_caller_s_train_state():
    mesh = _mesh((8,), ("data",))
    params, batch, _ = _problem(mesh)
    stage = gift_jax.allreduce("data", "fp8_e4m3", error_feedback=True,
                               stochastic_rounding=True)
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh, comm=stage)
    state = grad_fn.init(params)
    step = jax.jit(grad_fn)
    _, g1, state1, _ = step(params, batch, state)
    _, g2, state2, _ = step(params, batch, state1)
    local, _ = state1.residuals
    assert local["up"].shape == (8, 16, 64)  # one buffer per replica
    assert float(jnp.abs(local["up"]).max()) > 0
    assert not np.array_equal(np.asarray(state1.key), np.asarray(state2.key))
    exact = jax.jit(jax.grad(_loss))(params, batch)
    for k in exact:  # two steps of error feedback: each within fp8's error of the exact one
        for g in (g1, g2):
            assert float(jnp.abs(g[k] - exact[k]).max()) < 0.2 * float(jnp.abs(exact[k]).max())
    with pytest.raises(ValueError, match="grad_fn.init"):
        grad_fn(params, batch)


def test_reduce_gradients_is_the_stateless_form():
    mesh = _mesh((8,), ("data",))
    per_device = {"w": jax.random.normal(jax.random.key(1), (8, 32, 16))}
    per_device = jax.device_put(per_device, NamedSharding(mesh, P("data")))
    exact = gift_jax.reduce_gradients(per_device, mesh, codec="fp32")
    np.testing.assert_allclose(exact["w"], per_device["w"].mean(0), rtol=1e-6, atol=1e-7)
    fp8 = jax.jit(lambda t: gift_jax.reduce_gradients(t, mesh))(per_device)
    assert fp8["w"].shape == (32, 16)
    assert 0 < float(jnp.abs(fp8["w"] - exact["w"]).max()) < 0.1
    with pytest.raises(ValueError, match="leading axis of 8"):
        gift_jax.reduce_gradients({"w": jnp.zeros((4, 3))}, mesh)


def test_bad_input_is_one_line():
    mesh = _mesh((8,), ("data",))
    params, batch, _ = _problem(mesh)

    def one_line(exc):
        assert "\n" not in str(exc.value), str(exc.value)
        return str(exc.value)

    with pytest.raises(ValueError) as e:
        jax.jit(gift_jax.data_parallel_grad(lambda p, b: (b["x"] @ p["up"]).sum(1), mesh))(
            params, batch)
    assert "not a scalar" in one_line(e)
    with pytest.raises(ValueError) as e:
        gift_jax.data_parallel_grad(_loss, mesh, data_axis="batch")
    assert "no axis 'batch'" in one_line(e)
    with pytest.raises(ValueError) as e:
        gift_jax.data_parallel_grad(_loss, _mesh((1, 8), ("data", "fsdp")))
    assert "size 1" in one_line(e)
    with pytest.raises(ValueError) as e:
        gift_jax.data_parallel_grad(_loss, mesh, has_aux=True)
    assert "aux_reduce" in one_line(e)
    bad = gift_jax.data_parallel_grad(_loss, mesh, param_specs={"up": P(None, "data"),
                                                                "down": P(None, "data")})
    with pytest.raises(ValueError) as e:
        jax.jit(bad)(params, batch)
    assert "'down'" in one_line(e) and "does not divide" in one_line(e)
    mesh2 = _mesh((4, 2), ("data", "fsdp"))
    bad = gift_jax.data_parallel_grad(_loss, mesh2, param_specs={"up": P(None, ("data", "fsdp")),
                                                                 "down": P()})
    with pytest.raises(ValueError) as e:
        jax.jit(bad)(*_problem(mesh2)[:2])
    assert "'up'" in one_line(e)
    with pytest.raises(TypeError) as e:
        gift_jax.data_parallel_grad(_loss, mesh, comm=optax.MultiSteps(optax.sgd(1.0), 2))
    assert "accumulate_steps" in one_line(e)


def test_error_feedback_on_fsdp_shards_keeps_one_buffer_per_device():
    """allreduce_options with error feedback on a (data, fsdp) mesh: each device's buffers
    hold its own shard's error (per device over data *and* fsdp), kept in the train state."""
    shape, names, specs = MESHES["fsdp_axis"]
    mesh = _mesh(shape, names)
    params, batch, specs = _problem(mesh, specs)
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh, param_specs=specs,
                                          allreduce_options={"error_feedback": True})
    state = grad_fn.init(params)
    step = jax.jit(grad_fn)
    _, g1, state, _ = step(params, batch, state)
    _, g2, state, _ = step(params, batch, state)
    local, _ = state.residuals
    assert local["up"].shape == (4, 16, 64), local["up"].shape  # one per replica
    assert float(jnp.abs(local["up"]).max()) > 0
    assert local["up"].sharding.spec == P("data", None, "fsdp")
    assert state.residuals[1][0].sharding.spec == P(("data", "fsdp"))  # the owners' rows
    exact = jax.jit(jax.grad(_loss))(params, batch)
    for k in exact:
        for g in (g1, g2):
            assert float(jnp.abs(g[k] - exact[k]).max()) < 0.2 * float(jnp.abs(exact[k]).max())
            assert g[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), g[k].ndim)
    with pytest.raises(ValueError) as e:
        gift_jax.data_parallel_grad(_loss, mesh, allreduce_options={"mean": False})
    assert "sets 'mean'" in str(e.value)
