"""gift_jax.data_parallel_grad for a flax linen trainer as it is: boxed parameters and flax's
specs, sharding constraints inside the loss, stages (GIFT, error feedback, stochastic
rounding) with FSDP on the data axis, token-weighted losses, the communication state inside a
flax TrainState checkpointed by orbax."""


import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.core import meta
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax
from gift_jax.comm.data_parallel import gradient_shard_bytes

#: bound now, before any data_parallel_grad call: a constraint gift_jax cannot rewrite
_BOUND_CONSTRAINT = jax.lax.with_sharding_constraint


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _one_line(exc):
    assert "\n" not in str(exc.value), str(exc.value)
    return str(exc.value)


# ---- boxed parameters, flax's specs, constraints inside the loss --------------------------


RULES = (("batch", "data"), ("hidden", "data"), ("embed", None), ("mlp", "model"),
         ("out", None))


class MLP(nn.Module):
    """Kernels boxed in ``nn.LogicallyPartitioned`` (or ``nn.Partitioned`` on mesh axes), the
    first FSDP on data, the second on model; activations constrained the two ways a linen
    model does."""

    logical: bool = True
    raw: object = None  # a mesh: constrain with jax.lax.with_sharding_constraint instead

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        init = nn.initializers.normal(0.2)
        h = nn.Dense(64, use_bias=False, kernel_init=(
            nn.with_logical_partitioning(init, ("embed", "hidden")) if self.logical
            else nn.with_partitioning(init, (None, "data"))))(x)
        if self.raw is not None:
            h = jax.lax.with_sharding_constraint(h, NamedSharding(self.raw, P("data", "model")))
            h = jax.lax.with_sharding_constraint(h, P(("data",), "model"))
        else:
            h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return nn.Dense(8, use_bias=True, kernel_init=(
            nn.with_logical_partitioning(init, ("mlp", "out")) if self.logical
            else nn.with_partitioning(init, ("model", None))))(jnp.tanh(h))


def _linen_problem(model, mesh):
    x = jax.random.normal(jax.random.key(1), (64, 32))
    with nn.logical_axis_rules(RULES):  # (the same parameters with or without raw constraints)
        boxed = MLP(logical=model.logical).init(jax.random.key(0), x)["params"]
        shardings = (nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
                     if model.logical else nn.get_sharding(boxed, mesh))
    params = jax.device_put(boxed, shardings)
    return params, shardings, jax.device_put(x, NamedSharding(mesh, P("data")))


SPECS = {
    "None": lambda params, mesh: None,
    "get_partition_spec": lambda params, mesh: nn.get_partition_spec(params),
    "logical_to_mesh_sharding": lambda params, mesh: nn.logical_to_mesh_sharding(
        nn.get_partition_spec(params), mesh, RULES),
    "get_sharding": lambda params, mesh: nn.get_sharding(params, mesh),
}


@pytest.mark.parametrize("source", list(SPECS))
def test_boxed_params_with_flax_s_specs_give_xla_s_gradients_boxed(source):
    """Boxed parameters (FSDP on data, a kernel on model), the specs flax gives for them or
    none (the boxes' own, logical names through the rules in context): the gradients are XLA's
    own (fp32), boxed like the parameters, in the parameters' shardings."""
    mesh = _mesh((4, 2), ("data", "model"))
    model = MLP(logical=source != "get_sharding")  # nn.get_sharding takes mesh-axis boxes
    params, shardings, x = _linen_problem(model, mesh)

    def loss_fn(p, x):
        return jnp.mean((model.apply({"params": p}, x) - x[:, :8]) ** 2)

    grad_fn = gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32",
                                          param_specs=SPECS[source](params, mesh))

    @jax.jit
    def step(params, x):
        with nn.logical_axis_rules(RULES):
            return grad_fn(params, x)

    @jax.jit
    def xla(params, x):
        with nn.logical_axis_rules(RULES):
            return jax.value_and_grad(loss_fn)(params, x)

    with jax.set_mesh(mesh):
        loss, grads, _, _ = step(params, x)
        ref_loss, ref = xla(params, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    is_box = lambda v: isinstance(v, meta.AxisMetadata)
    boxes = jax.tree.leaves(grads, is_leaf=is_box)
    assert [type(b) for b in boxes] == [type(b) for b in jax.tree.leaves(params, is_leaf=is_box)]
    assert isinstance(grads["Dense_0"]["kernel"], nn.Partitioned)
    for g, r, s in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), jax.tree.leaves(shardings),
                       strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-6, atol=1e-7)
        assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)
    assert grads["Dense_0"]["kernel"].value.sharding.spec == P(None, "data")


@pytest.mark.parametrize("api", ["with_logical_constraint", "with_sharding_constraint"])
def test_constraints_naming_data_inside_the_loss_drop_it_and_keep_the_others(api):
    """A logical constraint whose rules put the batch on 'data', and a raw constraint with a
    NamedSharding of the mesh and with a PartitionSpec naming 'data': inside the map they
    constrain the rows over 'model' only, and the gradients are XLA's own."""
    mesh = _mesh((4, 2), ("data", "model"))
    model = MLP(raw=mesh if api == "with_sharding_constraint" else None)
    params, _, x = _linen_problem(model, mesh)

    def loss_fn(p, x):
        return jnp.mean((model.apply({"params": p}, x) - x[:, :8]) ** 2)

    grad_fn = gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32")

    def step(params, x):
        with nn.logical_axis_rules(RULES):
            return grad_fn(params, x)[:2]

    with jax.set_mesh(mesh):
        text = jax.jit(step).lower(params, x).as_text()
        loss, grads = jax.jit(step)(params, x)
        with nn.logical_axis_rules(RULES):
            ref_loss, ref = jax.jit(jax.value_and_grad(loss_fn))(params, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-6, atol=1e-7)
    # the hidden rows (16 per replica, 64 features) constrained over 'model' inside the map
    kept = [line for line in text.splitlines() if "sharding_constraint" in line
            and "16x64" in line and '"model"' in line]
    assert kept, [line for line in text.splitlines() if "sharding_constraint" in line]
    assert jax.lax.with_sharding_constraint is _BOUND_CONSTRAINT  # restored after the trace


def test_a_constraint_gift_jax_cannot_see_is_one_line_naming_the_fix():
    mesh = _mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((64, 4)), NamedSharding(mesh, P("data")))
    w = jnp.ones((4, 4))

    def loss_fn(w, x):  # the function bound at import, not jax.lax's attribute
        return jnp.mean(_BOUND_CONSTRAINT(x @ w, P("data", None)))

    with jax.set_mesh(mesh), pytest.raises(ValueError) as e:
        jax.jit(gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32"))(w, x)
    msg = _one_line(e)
    assert msg.startswith("data_parallel_grad:") and "jax.lax.with_sharding_constraint" in msg
    assert "leave 'data' out" in msg


def test_logical_boxes_without_rules_and_logical_specs_are_one_line():
    mesh = _mesh((4, 2), ("data", "model"))
    model = MLP()
    params, _, x = _linen_problem(model, mesh)
    loss_fn = lambda p, x: jnp.mean(model.apply({"params": p}, x))
    with pytest.raises(ValueError) as e:  # LogicallyPartitioned, no rules in context
        jax.jit(gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32"))(params, x)
    assert "'Dense_0/kernel'" in _one_line(e) and "nn.logical_axis_rules" in _one_line(e)
    unboxed = nn.unbox(params)
    with pytest.raises(ValueError) as e:  # logical names for unboxed params: not mesh axes
        jax.jit(gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32",
                                            param_specs=nn.get_partition_spec(params)))(
            unboxed, x)
    assert "'embed'" in _one_line(e) and "nn.logical_to_mesh_sharding" in _one_line(e)


# ---- stages with FSDP on the data axis --------------------------------------------------


FSDP = {"up": P(None, "data"), "down": P("data", None), "stack": P("data", None, None)}
GIFT_DIMS = {"stack": gift_jax.GiftDimensionNumbers(1, 2)}


def _stack_problem(mesh, specs):
    """``up`` (split over data on its output dimension), ``down`` (on its input dimension),
    ``stack``: 8 layers of (16, 16) split over data on the layer axis."""
    k = jax.random.split(jax.random.key(0), 5)
    raw = {"up": jax.random.normal(k[0], (32, 64)) / 4,
           "down": jax.random.normal(k[1], (64, 16)) / 8,
           "stack": jax.random.normal(k[2], (8, 16, 16)) / 4}
    params = {n: jax.device_put(v, NamedSharding(mesh, specs[n])) for n, v in raw.items()}
    batch = {"x": jax.random.normal(k[3], (64, 32)), "y": jax.random.normal(k[4], (64, 16))}
    return params, jax.device_put(batch, NamedSharding(mesh, P("data")))


def _forward(p, b):
    h, inputs = jnp.tanh(b["x"] @ p["up"]) @ p["down"], []
    for layer in range(8):
        inputs.append(h)
        h = jnp.tanh(h @ p["stack"][layer])
    return jnp.mean((h - b["y"]) ** 2), inputs


def _loss(p, b):
    return _forward(p, b)[0]


def _refresh_loss(p, b):
    """The loss and GIFT's statistics of ``up`` and of every layer of ``stack``."""
    loss, inputs = _forward(p, b)
    x, h = jax.lax.stop_gradient(b["x"]), jax.lax.stop_gradient(jnp.stack(inputs))
    return loss, {"up": x.T @ x / x.shape[0],
                  "stack": jnp.einsum("lti,ltj->lij", h, h) / h.shape[1]}


def _gift(ar):
    return gift_jax.gift(ar, ["up", "stack"], rank=8, dimension_numbers=GIFT_DIMS)


def _replicated(x):
    """Whether every device holds the same bits of ``x``'s global value."""
    first = np.asarray(x.addressable_shards[0].data)
    return all(np.array_equal(first, np.asarray(s.data)) for s in x.addressable_shards
               if s.index == x.addressable_shards[0].index)


def _run(mesh, specs, codec, steps=3, **kwargs):
    params, batch = _stack_problem(mesh, specs)
    if "wrap" in kwargs:
        kwargs["refresh_loss"] = _refresh_loss
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh, comm=codec, param_specs=specs, **kwargs)
    state = grad_fn.init(params)
    step = jax.jit(grad_fn, static_argnames="refresh")
    grads = []
    for i in range(steps):
        _, g, state, _ = step(params, batch, state, refresh=i == 0 and "wrap" in kwargs)
        grads.append(g)
    return params, batch, grads, state


@pytest.mark.parametrize("codec, axes", [("fp32", "data"), ("fp8_e4m3", "data"),
                                         ("fp32", "data_fsdp")])
def test_gift_whitens_leaves_split_over_data_shard_by_shard(codec, axes):
    """GIFT on ``up`` (split on its output dimension) and ``stack`` (split on its layer axis),
    FSDP on data (and on fsdp): each device unwhitens its own shard; ``down`` (split on its
    input dimension, not selected) is reduce-scattered by the codec as without a stage. fp32:
    the gradients are the exact ones and the unsharded GIFT's to fp32 rounding (the factors,
    refreshed on step 0, are not the identity); fp8: within fp8's error; the GIFT state is the
    unsharded run's (bit for bit on data alone; split over fsdp too, GSPMD partitions the
    forward apart: its statistics to fp32 rounding) and the same on every device."""
    if axes == "data":
        mesh, specs = _mesh((8,), ("data",)), FSDP
    else:
        mesh = _mesh((4, 2), ("data", "fsdp"))
        specs = {"up": P("fsdp", "data"), "down": P("data", "fsdp"),
                 "stack": P("data", None, "fsdp")}
    replicated = {n: P() for n in FSDP}
    params, batch, sharded, state = _run(mesh, specs, codec, wrap=_gift)
    _, _, whole, whole_state = _run(mesh, replicated, codec, wrap=_gift)
    exact = jax.jit(jax.grad(_loss))(params, batch)
    assert int(state.refreshes) == 1
    u = np.asarray(state.whitened["up"].factor.u)
    assert float(np.abs(u).max()) > 0  # a real factor, not the identity
    if axes == "data":
        for a, b in zip(jax.tree.leaves(state.whitened),
                        jax.tree.leaves(whole_state.whitened), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:  # GSPMD partitions the forward over fsdp: its statistics to fp32 rounding (and
        # the factors' eigenvectors up to their signs)
        for p in state.whitened:
            np.testing.assert_allclose(np.asarray(state.whitened[p].stats),
                                       np.asarray(whole_state.whitened[p].stats),
                                       rtol=1e-4, atol=1e-6)
    assert all(_replicated(a) for a in jax.tree.leaves(state.whitened))
    # fp32: rounding, through whitening's round trip (and the fsdp partitioning's forward)
    tol = {"fp32": 2e-5 if axes == "data" else 1e-4, "fp8_e4m3": 0.1}[codec]
    for g_sharded, g_whole in zip(sharded, whole, strict=True):
        for name, spec in specs.items():
            g = g_sharded[name]
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim), name
            scale = float(jnp.abs(exact[name]).max())
            assert float(jnp.abs(g - exact[name]).max()) < tol * scale, name
            if codec == "fp32":
                assert float(jnp.abs(g - g_whole[name]).max()) < tol * scale, name
    if codec == "fp8_e4m3":  # an ordinary step: only u8 gradient bytes cross data
        grad_fn = gift_jax.data_parallel_grad(_loss, mesh, param_specs=FSDP, wrap=_gift)
        over = gift_jax.parse_hlo(jax.jit(grad_fn).lower(params, batch, state).compile()
                                  .as_text(), mesh=mesh).over("data")
        weights = sum(params[n].size * 4 for n in FSDP)  # the forward gathers them in f32
        exchanges = [op for op in over.ops if op.kind == "all-to-all"]
        assert len(exchanges) == 3 and all(set(op.dtypes) == {"u8"} for op in exchanges)
        f32 = [op for op in over.ops if "f32" in op.dtypes and op.buffer_bytes > 16]
        assert all(op.kind == "all-gather" for op in f32), over.table()
        assert sum(op.buffer_bytes for op in f32) <= weights, over.table()
    if codec == "fp8_e4m3":  # whitened, not the codec alone: other bits than without GIFT
        _, _, plain, _ = _run(mesh, FSDP, codec, steps=2,
                              allreduce_options={"stochastic_rounding": False})
        assert not np.array_equal(np.asarray(plain[1]["up"]), np.asarray(sharded[1]["up"]))
        np.testing.assert_array_equal(np.asarray(plain[1]["down"]),
                                      np.asarray(sharded[1]["down"]))


def test_gift_refuses_only_the_selected_leaves_split_on_their_input_dimension():
    mesh = _mesh((8,), ("data",))
    params, batch = _stack_problem(mesh, FSDP)
    bad = gift_jax.data_parallel_grad(
        _loss, mesh, param_specs=FSDP,
        wrap=lambda ar: gift_jax.gift(ar, ["down", "up"], rank=8))
    with pytest.raises(ValueError) as e:
        bad.init(params)
    msg = _one_line(e)
    assert "'down'" in msg and "'up'" not in msg and "'stack'" not in msg
    assert "output dimension" in msg and "gift(layers=...)" in msg
    # a stage built outside data_parallel_grad cannot reduce-scatter: the leaf and the fix
    stage = gift_jax.gift(gift_jax.allreduce("data"), ["up"], rank=8)
    with pytest.raises(ValueError) as e:
        jax.jit(gift_jax.data_parallel_grad(_loss, mesh, comm=stage, param_specs=FSDP))(
            params, batch, None)
    assert "'down'" in _one_line(e) and "wrap=" in _one_line(e)
    routed = gift_jax.data_parallel_grad(
        _loss, mesh, param_specs=FSDP,
        wrap=lambda ar: gift_jax.gift(ar, ["up"], rank=8, route_frame="adam"))
    with pytest.raises(ValueError) as e:
        routed.init(params)
    assert "'up'" in _one_line(e) and "route_frame='off'" in _one_line(e)


@pytest.mark.parametrize("axes", ["data", "data_fsdp"])
def test_error_feedback_and_stochastic_rounding_on_leaves_split_over_data(axes):
    """Each replica's error-feedback buffer of a leaf split over data is its whole
    quantization error (leaf-shaped, one per replica; split over fsdp like its leaf); two
    steps stay within fp8's error of the exact gradient, and a leaf replicated over data is
    bit-identical on its replicas."""
    if axes == "data":
        mesh, specs = _mesh((8,), ("data",)), dict(FSDP, down=P())
    else:
        mesh = _mesh((4, 2), ("data", "fsdp"))
        specs = {"up": P("fsdp", "data"), "down": P("fsdp"), "stack": P("data", None, "fsdp")}
    params, batch, grads, state = _run(
        mesh, specs, "fp8_e4m3", steps=2,
        allreduce_options={"error_feedback": True, "stochastic_rounding": True})
    local, _ = state.residuals
    replicas = mesh.shape["data"]
    assert local["up"].shape == (replicas, 32, 64)
    assert local["stack"].shape == (replicas, 8, 16, 16)
    assert float(jnp.abs(local["up"]).max()) > 0
    want = {"data": P("data"), "data_fsdp": P("data", "fsdp")}[axes]
    assert local["up"].sharding.is_equivalent_to(NamedSharding(mesh, want), 3)
    exact = jax.jit(jax.grad(_loss))(params, batch)
    for g in grads:
        for name in exact:
            err = float(jnp.abs(g[name] - exact[name]).max() / jnp.abs(exact[name]).max())
            assert 0 < err < 0.2, (name, err)
            assert g[name].sharding.is_equivalent_to(NamedSharding(mesh, specs[name]),
                                                     g[name].ndim)
        assert _replicated(g["down"])


def test_unselected_leaves_split_over_data_are_reduced_inside_the_backward():
    """GIFT on one of 8 layers split over data: the other 7 gradients are reduce-scattered
    inside the backward pass as without a stage, so the temporaries hold about one layer's
    whole per-replica gradient (and GIFT's one) at a time, not 8 (from the compiled memory
    analysis)."""
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

    grad_fn = gift_jax.data_parallel_grad(
        loss, mesh, param_specs=specs, wrap=lambda ar: gift_jax.gift(ar, ["w0"], rank=8))
    state = grad_fn.init(params)
    mem = jax.jit(lambda p, b, s: grad_fn(p, b, s)[1]).lower(
        params, x, state).compile().memory_analysis()
    leaf, gathered = n * n * 4, layers * n * n * 4
    assert mem.output_size_in_bytes <= 1.1 * gradient_shard_bytes(params, specs, mesh)
    assert mem.temp_size_in_bytes - gathered <= 2 * leaf, (mem.temp_size_in_bytes, leaf)


def test_refresh_may_be_a_traced_choice():
    """``refresh=`` a traced bool (the step number inside the jitted step): both variants in one
    ``lax.cond``, each the same as its static variant."""
    mesh = _mesh((8,), ("data",))
    params, batch = _stack_problem(mesh, FSDP)
    grad_fn = gift_jax.data_parallel_grad(_loss, mesh, param_specs=FSDP, wrap=_gift,
                                          refresh_loss=_refresh_loss)
    state = grad_fn.init(params)
    static = jax.jit(grad_fn, static_argnames="refresh")
    traced = jax.jit(lambda p, b, s, step: grad_fn(p, b, s, refresh=step % 2 == 0))
    s1, s2 = state, state
    for i in range(2):
        _, g1, s1, _ = static(params, batch, s1, refresh=i % 2 == 0)
        _, g2, s2, _ = traced(params, batch, s2, jnp.int32(i))
        for a, b in zip(jax.tree.leaves((g1, s1)), jax.tree.leaves((g2, s2)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(s2.refreshes) == 1 and int(s2.count) == 1
    with pytest.raises(ValueError, match="refresh_loss"):
        jax.jit(gift_jax.data_parallel_grad(_loss, mesh, param_specs=FSDP, wrap=_gift),
                static_argnames="refresh")(params, batch, state, refresh=True)


# ---- token-weighted losses ------------------------------------------------------------------


def _token_batch(mesh, counts, seq=8, width=16, seed=0):
    """8 replicas × 4 rows × ``seq`` positions; replica ``r`` has ``counts[r]`` real tokens
    (small integers as features, so that every sum below is exact in fp32)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.randint(k1, (32, seq, width), -3, 4).astype(jnp.float32)
    mask = np.zeros((8, 4 * seq), np.float32)
    for r, c in enumerate(counts):
        mask[r, :c] = 1
    batch = {"x": x, "mask": jnp.asarray(mask.reshape(32, seq)),
             "t": jax.random.randint(k2, (32, seq), 0, 8)}
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def _token_mean(per_token, mask):
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1)


def test_a_token_weighted_loss_is_the_global_token_mean_exactly_where_arithmetic_allows():
    """A linear per-token loss of small-integer features and power-of-two token counts per
    replica (1 … 8 of 32 positions, 32 real tokens in all): every product and sum is exact,
    so with ``loss_weight`` the loss and gradient are the global token mean bit for bit
    (the one-device loss on the whole batch); the default, a mean of per-replica means,
    is not."""
    mesh = _mesh((8,), ("data",))
    batch = _token_batch(mesh, [1, 1, 2, 4, 8, 8, 4, 4])
    w = jnp.asarray(np.arange(16 * 4).reshape(16, 4) % 5 - 2, jnp.float32)
    c = jnp.asarray([1.0, -2.0, 0.5, 3.0])

    def loss_fn(w, b):
        return _token_mean((b["x"] @ w) @ c, b["mask"])

    one_device = jax.jit(jax.value_and_grad(loss_fn))(w, jax.device_get(batch))
    weighted = gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32",
                                           loss_weight=lambda b: jnp.sum(b["mask"]))
    loss, grad, _, _ = jax.jit(weighted)(w, batch)
    assert float(loss) == float(one_device[0])
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(one_device[1]))
    default, grad2, _, _ = jax.jit(gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32"))(
        w, batch)
    assert abs(float(default) - float(one_device[0])) > 0.1 * abs(float(one_device[0]))
    assert not np.allclose(np.asarray(grad2), np.asarray(one_device[1]), rtol=0.01)


@pytest.mark.parametrize("accumulate_steps", [1, 2])
def test_a_token_weighted_cross_entropy_is_the_global_token_mean_to_fp32_rounding(
        accumulate_steps):
    """Cross-entropy over random real-token counts per replica (one replica all padding):
    with ``loss_weight`` the loss, the gradient and a ``"weighted"`` metric are the one-device
    values on the whole batch to fp32 rounding (the sums run in another order), token counts
    ``"sum"`` exactly; the default is off by far more."""
    mesh = _mesh((8,), ("data",))
    batch = _token_batch(mesh, [0, 3, 17, 32, 5, 29, 11, 24])
    w = jax.random.normal(jax.random.key(3), (16, 8)) / 4

    def loss_fn(w, b):
        logits = b["x"] @ w
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, b["t"])
        hit = (jnp.argmax(logits, -1) == b["t"]).astype(jnp.float32)
        return _token_mean(per_token, b["mask"]), {"tokens": jnp.sum(b["mask"]),
                                                   "accuracy": _token_mean(hit, b["mask"])}

    (ref_loss, ref_aux), ref = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        w, jax.device_get(batch))
    grad_fn = gift_jax.data_parallel_grad(
        loss_fn, mesh, comm="fp32", has_aux=True, accumulate_steps=accumulate_steps,
        aux_reduce={"tokens": "sum", "accuracy": "weighted"},
        loss_weight=lambda b: jnp.sum(b["mask"]))
    loss, grad, _, aux = jax.jit(grad_fn)(w, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref), rtol=2e-5, atol=1e-7)
    assert float(aux["tokens"]) == float(ref_aux["tokens"]) == 121.0
    np.testing.assert_allclose(float(aux["accuracy"]), float(ref_aux["accuracy"]), rtol=2e-6)
    default = gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp32", has_aux=True,
                                          aux_reduce="sum")
    d_loss, d_grad, _, _ = jax.jit(default)(w, batch)
    assert abs(float(d_loss) - float(ref_loss)) > 1e-3 * float(ref_loss)
    with pytest.raises(ValueError) as e:
        gift_jax.data_parallel_grad(loss_fn, mesh, has_aux=True, aux_reduce="weighted")
    assert "loss_weight" in _one_line(e)
    with pytest.raises(ValueError) as e:
        gift_jax.data_parallel_grad(loss_fn, mesh, mean=False, loss_weight=jnp.sum)
    assert "mean=False" in _one_line(e)


# ---- the communication state in a flax TrainState, checkpointed by orbax ---------------


class TrainState(train_state.TrainState):
    comm_state: object = None


def _abstract(state, mesh):
    """Orbax's restore target: each array's shape, dtype and sharding (replicated on the mesh
    for the optimizer's scalars and the step, made on one device)."""

    def one(x):
        x = jnp.asarray(x)
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh,
                                                                                          P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state)


def test_the_comm_state_in_a_train_state_resumes_bit_for_bit_from_orbax(tmp_path):
    """Error feedback (per-device buffers split over data) and stochastic rounding, kept in a
    TrainState: 2 steps, orbax save, restore, 2 more equal 4 uninterrupted steps bit for bit;
    restoring without the comm state would not."""
    mesh = _mesh((8,), ("data",))
    params, batch = _stack_problem(mesh, FSDP)
    grad_fn = gift_jax.data_parallel_grad(
        _loss, mesh, param_specs=FSDP,
        allreduce_options={"error_feedback": True, "stochastic_rounding": True})

    @jax.jit
    def step(state, batch):
        _, grads, comm_state, _ = grad_fn(state.params, batch, state.comm_state)
        return state.apply_gradients(grads=grads, comm_state=comm_state)

    fresh = TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-2),
                              comm_state=grad_fn.init(params))
    run = fresh
    for _ in range(4):
        run = step(run, batch)
    half = step(step(fresh, batch), batch)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", half)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", _abstract(fresh, mesh))
    assert restored.comm_state.residuals[0]["up"].sharding == half.comm_state.residuals[0][
        "up"].sharding
    resumed = step(step(restored, batch), batch)
    for a, b in zip(jax.tree.leaves(run), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lost = step(step(restored.replace(comm_state=fresh.comm_state), batch), batch)
    assert not np.array_equal(np.asarray(lost.params["up"]), np.asarray(run.params["up"]))
