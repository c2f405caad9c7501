"""A GPT-2-style decoder in Flax NNX: learned positions, pre-LayerNorm blocks, GELU MLP,
biases, tied embeddings (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", §2.3).

Parameter layout (``/``-joined paths of ``nnx.state(model, nnx.Param)``), named like
:mod:`gift_jax.models.llama`'s so that the same layer patterns select the same roles::

    embed/embedding                      (vocab_size, d_model)
    embed/positions                      (max_seq_len, d_model)   # learned, added to tokens
    layers/<i>/attn_norm/{scale,bias}    (d_model,)
    layers/<i>/attn/{q,k,v}_proj/kernel  (d_model, d_model)       # GPT-2's fused c_attn, split
    layers/<i>/attn/{q,k,v}_proj/bias    (d_model,)
    layers/<i>/attn/o_proj/{kernel,bias} (d_model, d_model), (d_model,)      # c_proj
    layers/<i>/mlp_norm/{scale,bias}     (d_model,)
    layers/<i>/mlp/up_proj/{kernel,bias}   (d_model, d_ff), (d_ff,)          # c_fc
    layers/<i>/mlp/down_proj/{kernel,bias} (d_ff, d_model), (d_model,)       # c_proj ("fc2")
    final_norm/{scale,bias}              (d_model,)
    lm_head/kernel                       (d_model, vocab_size)  # absent when tie_embeddings

GIFT whitens kernels only (``*/mlp/down_proj`` selects ``…/down_proj/kernel``); a bias's
gradient is the sum of the layer's output gradients and crosses the wire like any other
unselected leaf. The position table sits under ``embed/`` so that Muon's dense exclusion
(``embed/*``) keeps it out of orthogonalisation, as the token table.

Initialisation as GPT-2: normal(0, ``init_std``) weights, zero biases, unit LayerNorm gains;
the two projections that write into the residual stream (``o_proj``, ``down_proj``) are
scaled by ``1/√(2·num_layers)`` (GPT-2 §2.3: the residual path accumulates ``2L`` writes).
``scan_layers``, ``remat``, ``attention_impl``, ``embed_lookup`` and ``activation_axes``
behave as in :class:`~gift_jax.models.llama.LlamaConfig` (shared code in
:mod:`gift_jax.models.common`). LayerNorm statistics, the softmax and the loss are computed
in fp32 whatever ``dtype`` is.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gift_jax.models.common import (
    LOGICAL_AXES,
    DecoderConfig,
    ModelSpec,
    apply_blocks,
    causal_attention,
    check_decoder_fields,
    constrain,
    dense,
    embed_tokens,
    stacked_blocks,
)

__all__ = ["GPT", "GPTConfig", "SPEC", "count_params"]


@dataclasses.dataclass(frozen=True)
class GPTConfig(DecoderConfig):
    """Static hyper-parameters of a GPT-2-style model.

    Attributes:
      vocab_size: number of token ids.
      d_model: width of the residual stream.
      num_layers: number of transformer blocks.
      num_heads: number of attention heads; must divide ``d_model``.
      d_ff: hidden width of the GELU MLP (GPT-2: ``4·d_model``).
      max_seq_len: rows of the learned position table, the longest sequence accepted.
      norm_eps: epsilon inside LayerNorm's square root.
      tie_embeddings: the head is the transposed token embedding (GPT-2's choice).
      dtype, param_dtype, init_std, attention_impl, remat, remat_policy, scan_layers,
        embed_lookup, activation_axes: as :class:`~gift_jax.models.llama.LlamaConfig`'s.
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int = 512
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    init_std: float = 0.02
    attention_impl: str = "reference"
    remat: bool = False
    remat_policy: str = "nothing_saveable"
    scan_layers: bool = False
    embed_lookup: str = "gather"
    activation_axes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        check_decoder_fields(
            self, positive_ints=("vocab_size", "d_model", "num_layers", "num_heads", "d_ff",
                                 "max_seq_len"),
            positive_reals=("norm_eps", "init_std"),
            bools=("tie_embeddings", "remat", "scan_layers"))

    @property
    def kv_heads(self) -> int:
        """Key/value heads: every head has its own (no grouped-query attention)."""
        return self.num_heads

    @property
    def residual_init_std(self) -> float:
        """Init std of the projections into the residual stream: ``init_std / √(2L)``."""
        return self.init_std / math.sqrt(2 * self.num_layers)


class LayerNorm(nnx.Module):
    """``y = (x − mean(x)) / sqrt(var(x) + ε) · g + b`` over the last axis, statistics in fp32,
    ``g`` at ones and ``b`` at zeros."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype=param_dtype), **{LOGICAL_AXES: ("norm",)})
        self.bias = nnx.Param(jnp.zeros((dim,), dtype=param_dtype), **{LOGICAL_AXES: ("norm",)})
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


class Embeddings(nnx.Module):
    """Token table ``E`` (vocab × d) and learned position table ``P`` (max_seq_len × d):
    ``x_t = E[token_t] + P[t]``; :meth:`attend` is the tied head ``x Eᵀ``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(cfg.init_std)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                        cfg.storage_dtype), **{LOGICAL_AXES: ("vocab", "embed")})
        self.positions = nnx.Param(init(rngs.params(), (cfg.max_seq_len, cfg.d_model),
                                        cfg.storage_dtype),
                                   **{LOGICAL_AXES: ("positions", "embed")})
        self.cfg = cfg

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = embed_tokens(self.embedding[...], tokens, self.cfg)
        return x + self.positions[: tokens.shape[1]].astype(x.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """The tied head: logits ``x Eᵀ``.

        Args:
          x: the final normalised residual stream, ``(batch, seq, d_model)``.

        Returns:
          Logits ``(batch, seq, vocab_size)`` in ``x``'s dtype.
        """
        return jnp.einsum("btd,vd->btv", x, self.embedding[...].astype(x.dtype))


class Attention(nnx.Module):
    """Causal multi-head self-attention with biases: ``softmax(q kᵀ/√d + M) v W_o + b_o``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        heads = dict(use_bias=True, heads=cfg.num_heads)
        self.q_proj = dense(cfg, d, d, rngs, ("embed", "heads"), **heads)
        self.k_proj = dense(cfg, d, d, rngs, ("embed", "heads"), **heads)
        self.v_proj = dense(cfg, d, d, rngs, ("embed", "heads"), **heads)
        self.o_proj = dense(cfg, d, d, rngs, ("heads", "embed"), use_bias=True,
                            init_std=cfg.residual_init_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        cfg = self.cfg
        split = lambda y: constrain(y, cfg, "batch", None, "heads", None)  # (b, t, heads, dh)
        o = causal_attention(split(self.q_proj(x)), split(self.k_proj(x)),
                             split(self.v_proj(x)), cfg)
        return self.o_proj(o.reshape(b, t, cfg.d_model))


class MLP(nnx.Module):
    """``down(gelu(x W_up + b_up)) + b_down`` with GPT-2's tanh-approximated GELU."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.up_proj = dense(cfg, cfg.d_model, cfg.d_ff, rngs, ("embed", "mlp"), use_bias=True)
        self.down_proj = dense(cfg, cfg.d_ff, cfg.d_model, rngs, ("mlp", "embed"),
                               use_bias=True, init_std=cfg.residual_init_std)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.gelu(self.up_proj(x), approximate=True)
        return self.down_proj(constrain(h, self.cfg, "batch", None, "mlp"))


class Block(nnx.Module):
    """Pre-LayerNorm block: ``h = x + attn(ln(x))``, ``y = h + mlp(ln(h))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        norm = dict(eps=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
        self.attn_norm = LayerNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = LayerNorm(cfg.d_model, **norm)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.attn.cfg
        x = constrain(x + self.attn(self.attn_norm(x)), cfg, "batch", None, None)
        return constrain(x + self.mlp(self.mlp_norm(x)), cfg, "batch", None, None)


class GPT(nnx.Module):
    """Decoder-only GPT-2-style language model:
    ``logits = head(ln(blocks(E[tokens] + P[positions])))``. Call with int tokens
    ``(batch, seq)``, ``seq ≤ max_seq_len``; returns logits ``(batch, seq, vocab_size)``."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}.")
        self.config = config
        self.embed = Embeddings(config, rngs=rngs)
        self.layers = stacked_blocks(lambda r: Block(config, rngs=r), config, rngs)
        self.final_norm = LayerNorm(config.d_model, eps=config.norm_eps,
                                    dtype=config.compute_dtype, param_dtype=config.storage_dtype)
        self.lm_head = (None if config.tie_embeddings else
                        dense(config, config.d_model, config.vocab_size, rngs,
                              ("embed", "vocab")))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tokens.shape}.")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={cfg.max_seq_len}.")
        x = constrain(self.embed(tokens), cfg, "batch", None, None)
        x = self.final_norm(apply_blocks(self.layers, x, cfg))
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return constrain(logits, cfg, "batch", None, "vocab")


def count_params(config: GPTConfig) -> int:
    """Number of parameters, from the dimensions alone.

    Per block: two LayerNorms ``4d``, attention ``4·(d² + d)``, MLP ``2·d·d_ff + d_ff + d``;
    plus token and position tables ``(V + T)·d``, final LayerNorm ``2d`` and, untied, head
    ``d·V``.

    Args:
      config: the model's config.

    Returns:
      The number of parameters of ``GPT(config)``.
    """
    d, f = config.d_model, config.d_ff
    block = 4 * d + 4 * (d * d + d) + 2 * d * f + f + d
    head = 0 if config.tie_embeddings else d * config.vocab_size
    return (config.vocab_size + config.max_seq_len) * d + config.num_layers * block + 2 * d + head


#: The GPT-2-style family as the trainer sees it (``model.family = "gpt"``).
SPEC = ModelSpec("gpt", GPTConfig, GPT, count_params)
