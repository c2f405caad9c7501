"""The GPT-2-style family (gift_jax/models/gpt.py) and the model registry: parameter count
from the dimensions, causality, scanned = unrolled, GPT-2's initialisation, logical axes that
shard on a (data, fsdp, tensor) mesh, GIFT's input statistics on a biased layer, config
errors that name the family's settings, and training through the trainer with GIFT (sharded
mesh), PLUMAGE and Muon."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from gift_jax.models import (
    GPT,
    MODELS,
    GPTConfig,
    LlamaConfig,
    count_params,
    logical_axes,
    model_config_of,
    model_spec,
    next_token_loss,
    param_shapes,
)
from gift_jax.training.config import ConfigError, complete_config, set_fields, validate_config
from gift_jax.training.defaults import default_config
from gift_jax.training.sharding import param_specs
from gift_jax.whitening.capture import with_input_stats

CFG = GPTConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, d_ff=64, max_seq_len=16)
TOKENS = jax.random.randint(jax.random.key(3), (4, 17), 0, 64)


def _n_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("scan", [False, True])
def test_count_params_matches_the_model(tie, scan):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, scan_layers=scan)
    assert _n_params(GPT(cfg, rngs=nnx.Rngs(0))) == count_params(cfg)
    assert sum(s.size for s in jax.tree.leaves(param_shapes(cfg))) == count_params(cfg)
    assert ("lm_head/kernel" in param_shapes(cfg, flat=True)) is (not tie)


def test_logits_at_t_ignore_later_tokens():
    model = GPT(CFG, rngs=nnx.Rngs(0))
    tokens = TOKENS[:, :12]
    changed = tokens.at[:, 7:].set((tokens[:, 7:] + 1) % CFG.vocab_size)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(np.asarray(a[:, :7]), np.asarray(b[:, :7]))
    assert float(jnp.max(jnp.abs(a[:, 7:] - b[:, 7:]))) > 1e-3
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        model(jnp.zeros((1, 17), jnp.int32))


def test_scanned_blocks_match_unrolled():
    flat = GPT(CFG, rngs=nnx.Rngs(0))
    scanned = GPT(dataclasses.replace(CFG, scan_layers=True), rngs=nnx.Rngs(1))
    src = nnx.to_pure_dict(nnx.state(flat, nnx.Param))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[src["layers"][i] for i in range(3)])
    state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(state, {**src, "layers": stacked})
    nnx.update(scanned, state)
    la, ga = jax.jit(nnx.value_and_grad(next_token_loss))(flat, TOKENS)
    lb, gb = jax.jit(nnx.value_and_grad(next_token_loss))(scanned, TOKENS)
    assert abs(float(la - lb)) <= 1e-5 * abs(float(la))
    ga, gb = nnx.to_pure_dict(ga), nnx.to_pure_dict(gb)
    for i in range(3):
        for a, b in zip(jax.tree.leaves(ga["layers"][i]), jax.tree.leaves(gb["layers"]),
                        strict=True):
            # the key bias's gradient is 0 in exact arithmetic (softmax is shift-invariant)
            assert float(jnp.max(jnp.abs(a - b[i]))) <= 1e-5 * float(jnp.max(jnp.abs(a))) + 1e-9


def test_gpt2_initialisation():
    cfg = dataclasses.replace(CFG, d_model=256, d_ff=1024, num_layers=8)
    p = param_shapes(cfg, flat=True)  # shapes only: the values come from the model
    values = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    block = values["layers"][0]
    residual = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, std in (("attn/q_proj", cfg.init_std), ("attn/o_proj", residual),
                      ("mlp/up_proj", cfg.init_std), ("mlp/down_proj", residual)):
        group, layer = name.split("/")
        kernel = np.asarray(block[group][layer]["kernel"])
        assert abs(kernel.std() / std - 1) < 0.05, name
        assert not np.any(np.asarray(block[group][layer]["bias"]))
    assert np.all(np.asarray(block["attn_norm"]["scale"]) == 1)
    assert not np.any(np.asarray(block["attn_norm"]["bias"]))
    assert p["embed/positions"].shape == (cfg.max_seq_len, cfg.d_model)


def test_logical_axes_shard_on_a_model_mesh():
    axes = logical_axes(CFG)
    shapes = param_shapes(CFG, flat=True)
    assert set(axes) == set(shapes)
    assert all(len(axes[p]) == len(shapes[p].shape) for p in axes)
    assert axes["layers/0/mlp/down_proj/bias"] == ("embed",)
    specs = param_specs(CFG, {"data": 2, "fsdp": 2, "tensor": 2})
    assert tuple(specs["layers/0/mlp/up_proj/kernel"]) == ("fsdp", "tensor")
    assert tuple(specs["layers/0/attn/q_proj/bias"]) == ("tensor",)
    assert tuple(specs["embed/embedding"]) == ("tensor", "fsdp")
    assert tuple(specs["embed/positions"]) == (None, "fsdp")  # positions: replicated rows


def test_input_statistics_of_a_biased_layer_are_its_input_second_moment():
    """GIFT's A = E[x xᵀ] of ``mlp/down_proj`` is the second moment of GELU(ln(h) W_up + b)."""
    model = GPT(dataclasses.replace(CFG, num_layers=1), rngs=nnx.Rngs(0))
    tokens = TOKENS[:, :-1]
    loss = with_input_stats(lambda m, t: next_token_loss(m, t), ["*/mlp/down_proj"])
    _, stats = loss(model, TOKENS)
    block = model.layers[0]
    h = model.embed(tokens)
    h = h + block.attn(block.attn_norm(h))
    x = jax.nn.gelu(block.mlp.up_proj(block.mlp_norm(h)), approximate=True).reshape(-1, 64)
    np.testing.assert_allclose(stats["layers/0/mlp/down_proj/kernel"], x.T @ x / x.shape[0],
                               rtol=1e-5, atol=1e-7)


def test_registry_and_config_errors():
    assert model_spec("gpt") is MODELS["gpt"] and model_spec(CFG) is MODELS["gpt"]
    assert model_spec(LlamaConfig()) is MODELS["llama"]
    # the one table of defaults holds the Llama's spec defaults exactly
    assert default_config().model.to_dict() == MODELS["llama"].defaults()
    group = ml_collections.ConfigDict({"family": "gpt", "d_model": 64})
    config = complete_config(ml_collections.ConfigDict({"model": group}))
    assert config.model.to_dict() == {**MODELS["gpt"].defaults(), "d_model": 64}
    assert model_config_of(config.model) == GPTConfig(d_model=64)
    with pytest.raises(ValueError, match=r"model.family must be one of \['gpt', 'llama'\]"):
        model_spec("bert")
    with pytest.raises(ValueError, match=r"Unknown LlamaConfig fields \['family'\]"):
        LlamaConfig.from_mapping(config.model)  # a run's group goes through model_config_of
    bad = complete_config(ml_collections.ConfigDict({"model": group}))
    with bad.model.unlocked():
        bad.model.rope_theta = 1e4
    with pytest.raises(ConfigError, match=r"Unknown model fields \['rope_theta'\].*"
                                          r"model.family='gpt'"):
        validate_config(bad, 8)
    bad = complete_config(ml_collections.ConfigDict({"model": {"family": "bert"}}))
    with pytest.raises(ConfigError, match="model.family='bert' is not supported; allowed: "):
        validate_config(bad, 8)


def _gpt_config(mode, optimizer="adamw", **overrides):
    from trainer_kit import small_config

    config = small_config(mode, optimizer)
    config.model = ml_collections.ConfigDict(MODELS["gpt"].defaults())
    return set_fields(config, {"model.vocab_size": 256, "model.d_model": 32,
                               "model.num_layers": 1, "model.num_heads": 2, "model.d_ff": 64,
                               "model.max_seq_len": 16, **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("mode,optimizer,mesh", [
    ("gift_fp8", "adamw", (2, 2, 2)),
    ("plumage", "adamw", (8, 1, 1)),
    ("fp8", "muon", (8, 1, 1)),
])
def test_trains_through_the_trainer(mode, optimizer, mesh):
    from trainer_kit import assert_replicas_identical, run

    data, fsdp, tensor = mesh
    config = _gpt_config(mode, optimizer, **{"mesh.data": data, "mesh.fsdp": fsdp,
                                             "mesh.tensor": tensor})
    result = run(config, stop_after=6)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert result.step == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert result.summary["params"] == count_params(model_config_of(config.model))
    assert result.summary["skipped_steps"] == 0
    assert_replicas_identical(result.params)
