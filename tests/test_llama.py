"""Tests of the Flax NNX Llama model, its helpers and the config files."""

import functools
import pathlib
import re
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gift_jax.comm.codecs import CODEC_NAMES
from gift_jax.models import (
    Llama,
    LlamaConfig,
    apply_rope,
    count_params,
    model_config_of,
    next_token_loss,
    param_shapes,
    rope_angles,
)
from gift_jax.training.config import METHODS
from gift_jax.training.optimizers import OPTIMIZER_NAMES

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.py"))

# Every matrix of SMALL is 32 × 32, so initialising it compiles a single random-normal program
# (compilation dominates these tests on CPU); tests of shapes and counts use distinct dims.
SMALL = LlamaConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4, d_ff=32, max_seq_len=32)


def _small(**overrides) -> LlamaConfig:
    fields = {**SMALL.__dict__, **overrides}
    return LlamaConfig(**fields)


def _tokens(seed, batch=2, seq=16, vocab=SMALL.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), jnp.int32)


_FORWARD = nnx.jit(lambda model, tokens, positions: model(tokens, positions))


def _forward(model, tokens, positions=None):
    if positions is None:  # always pass positions: one compilation per model, not two
        positions = jnp.arange(tokens.shape[1])
    return _FORWARD(model, tokens, positions)


def _num_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _like(model, **overrides):
    """A model of config ``model.config`` + overrides, sharing ``model``'s parameter values."""
    cfg = LlamaConfig(**{**model.config.__dict__, **overrides})
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


@pytest.fixture(scope="module")
def small_model():
    return Llama(SMALL, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- forward pass


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_shapes_and_dtypes(small_model, dtype):
    model = _like(small_model, dtype=dtype)
    cfg = model.config
    logits = _forward(model, _tokens(0))
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert logits.dtype == jnp.dtype(dtype)
    assert bool(jnp.all(jnp.isfinite(logits)))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)


def test_bf16_compute_tracks_fp32(small_model):
    tokens = _tokens(1)
    ref = _forward(small_model, tokens)
    low = _forward(_like(small_model, dtype="bfloat16"), tokens)
    np.testing.assert_allclose(low.astype(jnp.float32), ref, atol=3e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_hot_lookup_gives_the_gathers_logits(small_model, dtype):
    """``embed_lookup='one_hot'`` (a matmul in the compute dtype) selects the same rows."""
    tokens = _tokens(2)
    gather = _forward(_like(small_model, dtype=dtype), tokens)
    one_hot = _forward(_like(small_model, dtype=dtype, embed_lookup="one_hot"), tokens)
    np.testing.assert_array_equal(np.asarray(one_hot, np.float32), np.asarray(gather, np.float32))


def test_parameter_paths_are_per_layer_linears():
    cfg = _small(num_layers=3, num_kv_heads=2, d_ff=48, vocab_size=40)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # the module, unallocated
    linears = {
        "/".join(map(str, path)): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Linear)
    }
    for i in range(3):
        for name in ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj"):
            assert f"layers/{i}/{name}" in linears
        for name in ("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj"):
            assert f"layers/{i}/{name}" in linears
    assert "lm_head" in linears
    shapes = param_shapes(cfg, flat=True)
    hd = cfg.head_dim
    assert shapes["layers/2/mlp/down_proj/kernel"].shape == (cfg.d_ff, cfg.d_model)  # in × out
    assert shapes["layers/0/mlp/gate_proj/kernel"].shape == (cfg.d_model, cfg.d_ff)
    assert shapes["layers/1/attn/k_proj/kernel"].shape == (cfg.d_model, 2 * hd)
    assert shapes["embed/embedding"].shape == (cfg.vocab_size, cfg.d_model)
    assert shapes["final_norm/scale"].shape == (cfg.d_model,)


def test_tied_embeddings_have_no_head():
    model = Llama(_small(tie_embeddings=True), rngs=nnx.Rngs(0))
    assert model.lm_head is None
    assert "lm_head/kernel" not in param_shapes(_small(tie_embeddings=True), flat=True)
    logits = _forward(model, _tokens(0))
    assert logits.shape == (2, 16, SMALL.vocab_size)


def test_sequence_longer_than_max_is_rejected(small_model):
    model = _like(small_model, max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(0, seq=9))


# ----------------------------------------------------------------------------- attention


def test_causality(small_model):
    # The "jax" attention inherits causality from test_jax_attention_matches_reference.
    model = small_model
    tokens = _tokens(2)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % SMALL.vocab_size)
    a, b = _forward(model, tokens), _forward(model, changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert float(jnp.max(jnp.abs(a[:, 10:] - b[:, 10:]))) > 1e-4


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 2, 16)), jnp.float32)

    @jax.jit
    def score(m, n):
        qm = apply_rope(q, rope_angles(jnp.array([m]), 16, 10000.0))
        kn = apply_rope(k, rope_angles(jnp.array([n]), 16, 10000.0))
        return jnp.sum(qm * kn, axis=-1), jnp.linalg.norm(qm)

    np.testing.assert_allclose(score(3, 7)[0], score(103, 107)[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(score(9, 2)[0], score(20, 13)[0], rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(score(3, 7)[0] - score(3, 8)[0]))) > 1e-3
    np.testing.assert_allclose(score(5, 0)[1], jnp.linalg.norm(q), rtol=1e-6)  # a rotation


def test_model_is_invariant_to_a_global_position_shift(small_model):
    model = small_model
    tokens = _tokens(4)
    a = _forward(model, tokens, jnp.arange(16))
    b = _forward(model, tokens, jnp.arange(16) + 11)
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = _small(num_heads=4, num_kv_heads=2)
    gqa = Llama(gqa_cfg, rngs=nnx.Rngs(0))
    mha = Llama(_small(num_heads=4), rngs=nnx.Rngs(1))
    params = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))
    groups, hd = 2, gqa_cfg.head_dim
    for layer in params["layers"].values():
        for name in ("k_proj", "v_proj"):
            kernel = layer["attn"][name]["kernel"]  # (d_model, kv_heads * head_dim)
            heads = kernel.reshape(gqa_cfg.d_model, 2, hd)
            layer["attn"][name]["kernel"] = jnp.repeat(heads, groups, axis=1).reshape(
                gqa_cfg.d_model, 4 * hd
            )
    mha_state = nnx.state(mha, nnx.Param)
    nnx.replace_by_pure_dict(mha_state, params)
    nnx.update(mha, mha_state)
    tokens = _tokens(5)
    np.testing.assert_allclose(_forward(gqa, tokens), _forward(mha, tokens), atol=1e-5)


def test_jax_attention_matches_reference():
    tokens = _tokens(6)
    gqa = Llama(_small(num_kv_heads=2), rngs=nnx.Rngs(0))
    ref = _forward(gqa, tokens)
    fast = _forward(_like(gqa, attention_impl="jax"), tokens)
    np.testing.assert_allclose(fast, ref, atol=1e-5)


# ----------------------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_embeddings": True},
        {"num_kv_heads": 1},
        {"num_heads": 2, "num_kv_heads": 2},
    ],
)
def test_count_params_matches_model(overrides):
    cfg = _small(**overrides)
    assert _num_params(Llama(cfg, rngs=nnx.Rngs(0))) == count_params(cfg)
    assert sum(s.size for s in jax.tree.leaves(param_shapes(cfg))) == count_params(cfg)


def _load(path: pathlib.Path):
    return runpy.run_path(str(path))["get_config"]()


@functools.cache
def _flat_shapes(path: pathlib.Path) -> dict:
    return param_shapes(model_config_of(_load(path).model), flat=True)


def test_every_config_file_is_tested():
    names = {p.stem for p in CONFIG_FILES}
    expected = {"base", "tiny", "small", "gift_llama_300m", "gift_llama_600m"}
    expected |= {"llama_60m", "llama_130m", "llama_350m", "llama_1b"}
    assert expected <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_loads_and_states_its_parameter_count(path):
    config = _load(path)
    model_cfg = model_config_of(config.model)
    total = count_params(model_cfg)
    stated = re.search(r"([\d,]{5,}) parameters", runpy.run_path(str(path))["__doc__"])
    assert stated is not None, f"{path.name}: docstring must state the parameter count"
    assert int(stated.group(1).replace(",", "")) == total
    assert config.train.seq_len <= model_cfg.max_seq_len
    assert config.comm.codec in CODEC_NAMES
    assert config.comm.method in METHODS
    assert config.optimizer.name in OPTIMIZER_NAMES


# The GaLore 130M/350M/1B files only change the dimensions of llama_60m; tracing them adds time,
# not coverage.
@pytest.mark.parametrize("name", ["tiny", "llama_60m", "gift_llama_300m", "gift_llama_600m"])
def test_param_shapes_match_count_params(name):
    shapes = _flat_shapes(CONFIG_DIR / f"{name}.py")  # nnx.eval_shape: nothing is allocated
    assert all(isinstance(s, jax.ShapeDtypeStruct) for s in shapes.values())
    assert all(s.dtype == jnp.float32 for s in shapes.values())
    model_cfg = model_config_of(_load(CONFIG_DIR / f"{name}.py").model)
    assert sum(s.size for s in shapes.values()) == count_params(model_cfg)


def test_gift_600m_layers_exist():
    config = _load(CONFIG_DIR / "gift_llama_600m.py")
    shapes = _flat_shapes(CONFIG_DIR / "gift_llama_600m.py")
    assert len(config.gift.layers) == 13
    for layer in config.gift.layers:
        assert shapes[f"{layer}/kernel"].shape == (3456, 1280)


def test_from_mapping_rejects_unknown_fields():
    with pytest.raises(ValueError, match="d_modle"):
        LlamaConfig.from_mapping({"d_modle": 64})


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_heads": 3}, "num_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"d_model": 40, "num_heads": 8}, "head_dim"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"dtype": "int8"}, "dtype"),
        ({"param_dtype": "float64x"}, "param_dtype"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"attention_impl": "splash"}, "attention_impl"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
    ],
)
def test_config_validation(overrides, field):
    with pytest.raises(ValueError, match=field):
        _small(**overrides)


def test_dtype_objects_are_normalised():
    cfg = _small(dtype=jnp.bfloat16, param_dtype=np.float32)
    assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
    assert hash(cfg) == hash(_small(dtype="bfloat16"))
    assert _small(num_kv_heads=np.int64(2), norm_eps=1).num_kv_heads == 2  # CLI/numpy values


# ----------------------------------------------------------------------------- training


def test_next_token_loss_shifts_and_masks():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (2, 6))
    mask = np.array([[1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], np.float32)

    def fake_model(inputs):  # next_token_loss only calls model(tokens[:, :-1])
        assert inputs.shape == (2, 5)
        return jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32)

    log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    ce = -np.take_along_axis(np.asarray(log_probs), tokens[:, 1:, None], axis=-1)[..., 0]
    loss = jax.jit(lambda t, m: next_token_loss(fake_model, t, m))
    np.testing.assert_allclose(loss(tokens, None), ce.mean(), rtol=1e-6)
    np.testing.assert_allclose(loss(tokens, mask), (ce * mask).sum() / mask.sum(), rtol=1e-6)


def test_remat_wraps_every_block(small_model):
    # Gradients under jax.checkpoint are JAX's business; check that remat is really applied.
    tokens = _tokens(8, seq=17)

    def checkpoints(model):
        graphdef, params = nnx.split(model)
        grad_fn = jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens))
        return len(re.findall(r"= (?:remat2|checkpoint)\[", str(jax.make_jaxpr(grad_fn)(params))))

    assert checkpoints(small_model) == 0
    assert checkpoints(_like(small_model, remat=True)) == SMALL.num_layers


def test_loss_decreases_under_jitted_adam(small_model):
    graphdef, params = nnx.split(small_model, nnx.Param)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)
    tokens = jnp.tile(jnp.arange(17) % 5, (4, 1))  # a short repeated sequence

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            return next_token_loss(nnx.merge(graphdef, p), tokens)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert step._cache_size() == 1  # no recompilation
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses[0], np.log(SMALL.vocab_size), rtol=0.05)  # ≈ uniform
    assert losses[-1] < 0.2 * losses[0], losses
