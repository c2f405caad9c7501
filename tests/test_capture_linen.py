"""The linen capture (gift_jax.whitening.capture_linen) against the NNX capture on the same
models with the same weights: the list and scanned MLP blocks of ``nnx_toys``, a tied block, an
nn.vmap ensemble, DenseGeneral layers, jax.jit and jax.shard_map, and GIFT taking the
statistics."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from nnx_toys import DF, DM, MLP, NL, ListModel, ScanModel

from gift_jax.utils.tree_paths import UnmatchedPatternError
from gift_jax.whitening import capture, capture_linen
from gift_jax.whitening.stage import GiftDimensionNumbers, gift

X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 5, DM)), jnp.float32)


class LinenMLP(nn.Module):
    def setup(self):
        self.up_proj = nn.Dense(DF)
        self.down_proj = nn.Dense(DM)

    def __call__(self, x):
        return self.down_proj(jax.nn.relu(self.up_proj(x)))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return x + LinenMLP(name="mlp")(x), None


class LinenList(nn.Module):
    def setup(self):
        self.layers = [LinenBlock() for _ in range(2)]  # linen names them layers_0, layers_1

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x


class LinenScan(nn.Module):
    variable_axes: tuple = (("params", 0), (capture_linen.COLLECTION, 0))

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(LinenBlock), variable_axes=dict(self.variable_axes),
                        split_rngs={"params": True}, length=NL)
        return stack(name="layers")(x, None)[0]


class NnxTied(nnx.Module):  # one MLP applied twice
    def __init__(self, rngs):
        self.mlp = MLP(rngs)

    def __call__(self, x):
        return self.mlp(x + self.mlp(x))


class LinenTied(nn.Module):
    @nn.compact
    def __call__(self, x):
        mlp = LinenMLP(name="mlp")
        return mlp(x + mlp(x))


def nnx_loss(model, x):
    return jnp.mean(model(x) ** 2)


def linen_loss(model, params, x):
    return jnp.mean(model.apply({"params": params}, x) ** 2)


def _params(model):
    """The NNX model's params as a pure dict (a linen params dict of the same paths)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _nnx_stats(model, layers):
    refresh = capture.with_input_stats(nnx_loss, layers)
    return nnx.jit(lambda m, x: refresh(m, x))(model, X)


def _linen_step(module, layers):
    """jit(value_and_grad) of the linen refresh loss w.r.t. params."""
    refresh = capture_linen.with_input_stats(linen_loss, layers)
    return jax.jit(lambda p, x: jax.value_and_grad(refresh, argnums=1, has_aux=True)(
        module, p, x))


def _refresh_once(grads, stats, dims=None):
    """One GIFT refresh update on one device; its state and output."""
    layers = ["*/mlp/down_proj"] if dims is None else list(dims)
    tx = gift(optax.identity(), layers, rank=4, dimension_numbers=dims)
    out, state = jax.jit(lambda g, s, st: tx.update(g, s, gift_stats=st))(
        grads, tx.init(grads), stats)
    return out, state


def test_list_model_equals_nnx_capture_loss_and_grads_plain():
    model = ListModel(nnx.Rngs(0))
    params = {f"layers_{i}": block for i, block in _params(model)["layers"].items()}
    layers = ["*/mlp/down_proj", "layers_0/mlp/up_proj/kernel"]
    (loss, stats), grads = _linen_step(LinenList(), layers)(params, X)
    _, want = _nnx_stats(model, ["*/mlp/down_proj", "layers/0/mlp/up_proj/kernel"])
    assert sorted(stats) == ["layers_0/mlp/down_proj/kernel", "layers_0/mlp/up_proj/kernel",
                             "layers_1/mlp/down_proj/kernel"]
    for path, a in stats.items():  # the same computation, compiled alike: bit for bit
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, want[path.replace("layers_", "layers/")])
    plain_loss, plain_grads = jax.jit(jax.value_and_grad(
        lambda p, x: linen_loss(LinenList(), p, x)))(params, X)
    np.testing.assert_array_equal(loss, plain_loss)
    jax.tree.map(np.testing.assert_array_equal, grads, plain_grads)
    # GIFT takes them: one refresh of the selected down projections, finite
    down = {k: v for k, v in stats.items() if "down_proj" in k}
    out, state = _refresh_once(grads, down)
    assert int(state.refreshes) == 1 and int(state.identity_fallbacks) == 0
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(out))


def test_scanned_layers_stack_like_nnx_scan_and_a_missing_collection_is_one_line():
    model = ScanModel(nnx.Rngs(1))
    # nn.scan (of nn.remat) named "layers" stacks like nnx.vmap: the same paths
    params = _params(model)
    (_, stats), grads = _linen_step(LinenScan(), ["layers/mlp/*_proj"])(params, X)
    _, want = _nnx_stats(model, ["layers/mlp/*_proj"])
    assert sorted(stats) == sorted(want) == ["layers/mlp/down_proj/kernel",
                                             "layers/mlp/up_proj/kernel"]
    assert stats["layers/mlp/down_proj/kernel"].shape == (NL, DF, DF)
    for path, a in stats.items():  # the same einsum per layer, carried by either scan
        np.testing.assert_array_equal(a, want[path])
    dims = {"*/mlp/down_proj": GiftDimensionNumbers(1, 2)}
    _, state = _refresh_once(grads, {"layers/mlp/down_proj/kernel":
                                     stats["layers/mlp/down_proj/kernel"]}, dims)
    assert state.whitened["layers/mlp/down_proj/kernel"].factor.u.shape == (NL, DF, 4)
    assert int(state.identity_fallbacks) == 0
    refresh = capture_linen.with_input_stats(linen_loss, ["layers/mlp/down_proj"])
    with pytest.raises(ValueError, match="does not carry the 'gift_input_stats'") as err:
        jax.eval_shape(lambda p: refresh(LinenScan((("params", 0),)), p, X), params)
    assert "\n" not in str(err.value)


def test_tied_layer_accumulates_every_call_like_nnx():
    model = NnxTied(nnx.Rngs(2))
    (loss, stats), _ = _linen_step(LinenTied(), ["mlp/*_proj"])(_params(model), X)
    want_loss, want = _nnx_stats(model, ["mlp/*_proj"])
    assert sorted(stats) == sorted(want) == ["mlp/down_proj/kernel", "mlp/up_proj/kernel"]
    for path, a in stats.items():
        np.testing.assert_array_equal(a, want[path])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)


def test_bad_patterns_are_one_line():
    params = LinenList().init(jax.random.key(0), X)["params"]
    bad = capture_linen.with_input_stats(linen_loss, ["*/mlp/down_proj", "*/attn/q_proj"])
    with pytest.raises(UnmatchedPatternError, match=r"^capture.layers: pattern\(s\) "
                       r"\['\*/attn/q_proj'\] match no path") as err:
        bad(LinenList(), params, X)
    assert "\n" not in str(err.value) and "layers_0/mlp/up_proj/kernel" in str(err.value)
    with pytest.raises(ValueError, match="a LinenMLP; only nn.Dense and nn.DenseGeneral"):
        capture_linen.with_input_stats(linen_loss, ["layers_0/mlp"])(LinenList(), params, X)


class Attention(nn.Module):  # DenseGeneral projections: (d, H, hd) in, (H, hd, d) out
    @nn.compact
    def __call__(self, x):
        q = nn.DenseGeneral((2, 4), name="q_proj")(x)
        return nn.DenseGeneral(DM, axis=(-2, -1), name="o_proj")(jnp.tanh(q))


def test_dense_general_and_mutable_collections_pass_through():
    module = Attention()
    params = module.init(jax.random.key(3), X)["params"]

    def loss(model, params, x):  # the caller's own mutable= is kept (and empty here)
        y, mutated = model.apply({"params": params}, x, mutable=["intermediates"])
        assert set(mutated) <= {"intermediates"}
        return jnp.mean(y**2)

    refresh = capture_linen.with_input_stats(loss, ["*_proj"])
    (_, stats), grads = jax.jit(lambda p, x: jax.value_and_grad(
        refresh, argnums=1, has_aux=True)(module, p, x))(params, X)
    x = np.asarray(X, np.float64).reshape(-1, DM)
    h = np.tanh(np.einsum("ti,ihd->thd", x, np.asarray(params["q_proj"]["kernel"], np.float64))
                + np.asarray(params["q_proj"]["bias"], np.float64)).reshape(len(x), -1)
    np.testing.assert_allclose(stats["q_proj/kernel"], x.T @ x / len(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["o_proj/kernel"], h.T @ h / len(h), rtol=1e-5, atol=1e-6)
    dims = {"q_proj": GiftDimensionNumbers(0, (1, 2)), "o_proj": GiftDimensionNumbers((0, 1), 2)}
    out, state = _refresh_once(grads, stats, dims)
    assert int(state.refreshes) == 1 and int(state.identity_fallbacks) == 0
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(out))


def test_inside_shard_map_each_device_gets_its_local_statistics():
    params = LinenList().init(jax.random.key(4), X)["params"]
    refresh = capture_linen.with_input_stats(linen_loss, ["*/mlp/down_proj"])
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def per_device(p, x):
        (_, stats), _ = jax.value_and_grad(refresh, argnums=1, has_aux=True)(LinenList(), p, x)
        return jax.tree.map(lambda a: a[None], stats)

    sharded = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                                    out_specs=P("data")))(params, X)
    local = jax.jit(lambda x: refresh(LinenList(), params, x)[1])
    for d in range(8):
        for path, a in local(X[d:d + 1]).items():
            np.testing.assert_array_equal(sharded[path][d], a)


class Ensemble(nn.Module):  # nn.vmap over Dense: one (V, n, m) kernel, members fed their rows
    variable_axes: tuple = (("params", 0), (capture_linen.COLLECTION, 0))

    @nn.compact
    def __call__(self, x):
        stack = nn.vmap(nn.Dense, variable_axes=dict(self.variable_axes),
                        split_rngs={"params": True}, in_axes=0, out_axes=0)
        return stack(DF, name="ens")(x)


def test_vmapped_dense_stacks_per_member():
    x = X[:2]  # (members, rows, DM)
    params = Ensemble().init(jax.random.key(5), x)["params"]
    refresh = capture_linen.with_input_stats(linen_loss, ["ens"])
    _, stats = jax.jit(lambda p, x: refresh(Ensemble(), p, x))(params, x)
    assert stats["ens/kernel"].shape == (2, DM, DM)
    for v in range(2):
        np.testing.assert_allclose(stats["ens/kernel"][v], x[v].T @ x[v] / len(x[v]),
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="does not carry"):
        refresh(Ensemble((("params", 0),)), params, x)


def test_the_loss_may_take_what_a_train_state_holds():
    """``loss_fn(apply_fn, params, x)`` captured from ``state.apply_fn`` (``model.apply``) and
    boxed parameters (``nn.with_partitioning``): the statistics of the module form, bit for
    bit; any other first argument is one TypeError."""
    from flax.training import train_state

    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, None))
            h = jax.nn.relu(nn.Dense(DF, kernel_init=init, name="up_proj")(x))
            return nn.Dense(DM, kernel_init=init, name="down_proj")(h)

    module = Boxed()
    params = module.init(jax.random.key(0), X)["params"]
    assert isinstance(params["down_proj"]["kernel"], nn.Partitioned)
    state = train_state.TrainState.create(apply_fn=module.apply, params=params,
                                          tx=optax.sgd(0.1))

    def apply_loss(apply_fn, params, x):
        return jnp.mean(apply_fn({"params": params}, x) ** 2)

    refresh = capture_linen.with_input_stats(apply_loss, ["down_proj"])
    (loss, stats), grads = jax.jit(lambda p: jax.value_and_grad(
        lambda p: refresh(state.apply_fn, p, X), has_aux=True)(p))(state.params)
    (want_loss, want), want_grads = _linen_step(module, ["down_proj"])(params, X)
    np.testing.assert_array_equal(loss, want_loss)
    np.testing.assert_array_equal(stats["down_proj/kernel"], want["down_proj/kernel"])
    assert isinstance(grads["down_proj"]["kernel"], nn.Partitioned)
    jax.tree.map(np.testing.assert_array_equal, grads, want_grads)
    with pytest.raises(TypeError, match="the linen module or its apply"):
        refresh(lambda v, x: x, params, X)
