"""Scanned layers (model.scan_layers) compute what the unrolled blocks compute: the same loss
and per-layer gradients from the same parameters (fp32 to rounding, bf16 within its noise),
the same 20-step AdamW trajectory; remat policies change memory, not values; the trainer runs
GIFT and PLUMAGE on the stacked kernels."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gift_jax.models import GPT, GPTConfig, Llama, LlamaConfig, logical_axes, next_token_loss
from gift_jax.training.step import model_def_of

CFG = LlamaConfig(num_layers=3, d_model=64, num_heads=4, d_ff=160, max_seq_len=32)


def _pair(cfg: LlamaConfig):
    """An unrolled model and a scanned one holding the same parameters."""
    flat = Llama(cfg, rngs=nnx.Rngs(0))
    scanned = Llama(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(1))
    src = nnx.to_pure_dict(nnx.state(flat, nnx.Param))
    dst = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    dst = {**src, "layers": jax.tree.map(lambda *xs: jnp.stack(xs),
                                         *[src["layers"][i] for i in range(cfg.num_layers)])}
    state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(state, dst)
    nnx.update(scanned, state)
    return flat, scanned


TOKENS = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)


def _grads(model):
    loss, grads = jax.jit(nnx.value_and_grad(next_token_loss))(model, TOKENS)
    return float(loss), nnx.to_pure_dict(grads)


@pytest.mark.parametrize("remat", [False, True])
def test_scanned_blocks_match_unrolled_per_layer(remat):
    flat, scanned = _pair(dataclasses.replace(CFG, remat=remat))
    loss_a, ga = _grads(flat)
    loss_b, gb = _grads(scanned)
    assert abs(loss_a - loss_b) <= 1e-5 * abs(loss_a)
    for i in range(CFG.num_layers):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ga["layers"][i])[0],
                                jax.tree.leaves(gb["layers"]), strict=True):
            err = float(jnp.max(jnp.abs(a - b[i])) / jnp.max(jnp.abs(a)))
            assert err <= 1e-5, (i, path, err)
    for key in ("embed", "final_norm", "lm_head"):
        np.testing.assert_allclose(jax.tree.leaves(ga[key])[0], jax.tree.leaves(gb[key])[0],
                                   rtol=1e-5, atol=1e-7)


def test_bf16_scanned_within_bf16_noise():
    flat, scanned = _pair(dataclasses.replace(CFG, dtype="bfloat16"))
    loss_a, ga = _grads(flat)
    loss_b, gb = _grads(scanned)
    loss_ref, _ = _grads(_pair(CFG)[0])  # fp32: the size of bf16's own error
    assert abs(loss_a - loss_b) <= max(2 * abs(loss_a - loss_ref), 1e-3)
    a = ga["layers"][1]["mlp"]["down_proj"]["kernel"]
    b = gb["layers"]["mlp"]["down_proj"]["kernel"][1]
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 2e-2


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_weights_cast_once_give_the_layers_values_and_fp32_gradients(family):
    """``ModelDef.for_compute`` casts the linear layers' kernels and biases of a bf16 model
    (scanned: before the layer loop), not its norms or embeddings; the loss and the fp32
    gradients are those of the layers' own casts, bit for bit."""
    cfg = (dataclasses.replace(CFG, dtype="bfloat16", scan_layers=True) if family == "llama"
           else GPTConfig(num_layers=2, d_model=64, num_heads=4, d_ff=128, max_seq_len=32,
                          dtype="bfloat16", scan_layers=True))
    model_def = model_def_of(cfg)
    cast = {path for path, _ in model_def.compute_dtypes}
    assert cast and all(p.endswith(("kernel", "bias")) and "norm" not in p for p in cast)
    assert "layers/mlp/down_proj/kernel" in cast and not any(p.startswith("embed") for p in cast)
    model = (Llama if family == "llama" else GPT)(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = TOKENS % cfg.vocab_size

    def loss(p, once):
        return model_def.loss(model_def.merge(model_def.for_compute(p) if once else p), tokens)

    (la, ga), (lb, gb) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, once)
                          for once in (False, True))
    assert float(la) == float(lb)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree.leaves(gb),
                            strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_array_equal(a, b, err_msg=str(path))


def test_twenty_adamw_steps_match():
    flat, scanned = _pair(CFG)
    losses = []
    for model in (flat, scanned):
        tx = optax.adamw(3e-3)
        params = nnx.state(model, nnx.Param)
        graphdef, _ = nnx.split(model, nnx.Param)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, graphdef=graphdef, tx=tx):
            loss, g = jax.value_and_grad(
                lambda p: next_token_loss(nnx.merge(graphdef, p), TOKENS))(params)
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        out = []
        for _ in range(20):
            params, opt_state, loss = step(params, opt_state)
            out.append(float(loss))
        losses.append(out)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert losses[0][-1] < losses[0][0] - 0.5  # it trained


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_remat_policies_keep_values(policy):
    base = _grads(_pair(CFG)[1])  # the scanned model, no remat
    other = _grads(_pair(dataclasses.replace(CFG, remat=True, remat_policy=policy))[1])
    assert abs(base[0] - other[0]) <= 1e-6 * abs(base[0])


def test_stacked_logical_axes_and_bad_policy():
    axes = logical_axes(dataclasses.replace(CFG, scan_layers=True))
    assert axes["layers/mlp/down_proj/kernel"] == ("layers", "mlp", "embed")
    assert axes["embed/embedding"] == ("vocab", "embed")
    with pytest.raises(ValueError, match=r"LlamaConfig.remat_policy must be one of .*"
                       r"nothing_saveable.*got 'sometimes'"):
        dataclasses.replace(CFG, remat_policy="sometimes")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gift", "plumage"])
def test_trainer_runs_gift_and_plumage_on_stacked_kernels(tmp_path, method):
    from trainer_kit import run, small_config

    config = small_config("gift_fp8" if method == "gift" else "plumage",
                          **{"model.num_layers": 2, "model.scan_layers": True})
    summary = run(config, str(tmp_path)).summary
    assert np.isfinite(summary["final_loss"])
    assert set(summary["wire_bytes_per_step"]) == {"ordinary", "refresh"}


def test_trainer_quantizes_each_stacked_layer_on_its_own_scales():
    """With scan_layers the trainer's all-reduce splits every stacked kernel into its layers
    (one slot and one scale each); norms, embeddings and the head stay one tensor; unrolled
    blocks need no split."""
    from trainer_kit import recipe_of, small_config

    from gift_jax.comm.stage import allreduce_spec

    for scan in (True, False):
        config = small_config("fp8", **{"model.num_layers": 3, "model.scan_layers": scan})
        cfg = dataclasses.replace(CFG, scan_layers=scan)
        params = nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param))
        spec = allreduce_spec(recipe_of(config).comm.allreduce(("data",)))
        paths = ["/".join(str(getattr(k, "key", k)) for k in p)
                 for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        stacks = dict(zip(paths, spec.stacks(params), strict=True))
        want = {p: 3 if scan and p.startswith("layers/") and p.endswith("kernel") else 1
                for p in paths}
        assert stacks == want


def test_flash_attention_kernel_matches_reference():
    """attention_impl='flash' on a TPU target runs jax's Pallas TPU flash kernel (here in TPU
    interpret mode on CPU): grouped heads, forward and gradients equal the reference's within
    fp32 rounding; on a CPU target 'flash' is the reference itself."""
    from jax.experimental.pallas import tpu as pltpu

    from gift_jax.models import common as L

    cfg = LlamaConfig(d_model=128, num_heads=4, num_kv_heads=2)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (2, 128, 4, 32))
    k, v = (jax.random.normal(key, (2, 128, 2, 32)) for key in ks[1:])
    loss = lambda attn: lambda *a: jnp.sum(attn(*a) ** 2)
    ref_out = L.causal_attention_reference(q, k, v)
    ref_grads = jax.grad(loss(L.causal_attention_reference), argnums=(0, 1, 2))(q, k, v)
    flash = lambda *a: L._tpu_flash_attention(*a, cfg)
    with pltpu.force_tpu_interpret_mode():
        out = flash(q, k, v)
        grads = jax.grad(loss(flash), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        assert float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) < 5e-6
    np.testing.assert_array_equal(L.causal_attention_flash(q, k, v, cfg), ref_out)
