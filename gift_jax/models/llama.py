"""A Llama decoder in Flax NNX: RMSNorm, rotary embeddings, (grouped-query) attention, SwiGLU.

Parameter layout (paths as ``/``-joined keys of ``nnx.state(model, nnx.Param)``)::

    embed/embedding                      (vocab_size, d_model)
    layers/<i>/attn_norm/scale           (d_model,)
    layers/<i>/attn/q_proj/kernel        (d_model, num_heads * head_dim)
    layers/<i>/attn/k_proj/kernel        (d_model, num_kv_heads * head_dim)
    layers/<i>/attn/v_proj/kernel        (d_model, num_kv_heads * head_dim)
    layers/<i>/attn/o_proj/kernel        (num_heads * head_dim, d_model)
    layers/<i>/mlp_norm/scale            (d_model,)
    layers/<i>/mlp/gate_proj/kernel      (d_model, d_ff)
    layers/<i>/mlp/up_proj/kernel        (d_model, d_ff)
    layers/<i>/mlp/down_proj/kernel      (d_ff, d_model)      # the artifact's "fc2"
    final_norm/scale                     (d_model,)
    lm_head/kernel                       (d_model, vocab_size)  # absent when tie_embeddings

Every projection is an ``nnx.Linear`` without bias, so Flax kernels are (in × out): the
*input* side of a layer, where GIFT's factor ``A = E[x xᵀ]`` acts, is the first kernel axis.

Two layouts of the blocks (``scan_layers``):

* ``False`` (the default): an ``nnx.List``, one Python object per block, unrolled under
  ``jit``: one kernel per layer and per-layer paths such as ``layers/17/mlp/down_proj/kernel``;
  compile time grows linearly with depth.
* ``True``: one block whose parameters are stacked over a leading layer axis (built with
  ``nnx.vmap``, applied with ``nnx.scan``, maxtext's layout): paths ``layers/mlp/down_proj/kernel``
  of shape ``(L, d_ff, d_model)``, logical axes ``('layers', …)``. The compiler sees one
  block, so a pod compile takes minutes whatever the depth. Layer patterns such as
  ``*/mlp/down_proj`` select the stacked kernel; GIFT's statistics and factors and PLUMAGE's
  projections are then per layer along the leading axis (their matrix views treat it as a
  batch axis), and input statistics ride along in the scanned state
  (:mod:`gift_jax.whitening.capture`).

``remat`` recomputes each block in the backward pass with the policy ``remat_policy`` (a name
of ``jax.checkpoint_policies``: ``nothing_saveable``, the default, keeps only the block's
input; ``dots_with_no_batch_dims_saveable`` keeps the projections' outputs, maxtext's
"minimal" trade).

Precision: parameters are stored in ``param_dtype`` (fp32); matmuls run in ``dtype`` (fp32 or
bf16). RMSNorm statistics, rotary angles, attention softmax and the loss are computed in fp32
whatever ``dtype`` is; the residual stream is carried in ``dtype``.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from gift_jax.models.common import (
    LOGICAL_AXES,
    REMAT_POLICIES,
    DecoderConfig,
    ModelSpec,
    apply_blocks,
    causal_attention,
    check_decoder_fields,
    constrain,
    dense,
    embed_tokens,
    next_token_loss,
    stacked_blocks,
)

__all__ = [
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "MLP",
    "RMSNorm",
    "SPEC",
    "apply_rope",
    "LOGICAL_AXES",
    "REMAT_POLICIES",
    "count_params",
    "logical_axes",
    "next_token_loss",
    "param_shapes",
    "rope_angles",
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Static hyper-parameters of a Llama model.

    Attributes:
      vocab_size: number of token ids (rows of the embedding, columns of the head).
      d_model: width of the residual stream.
      num_layers: number of transformer blocks.
      num_heads: number of query heads; must divide ``d_model``.
      num_kv_heads: number of key/value heads (grouped-query attention); must divide
        ``num_heads``. ``None`` means ``num_heads`` (plain multi-head attention).
      d_ff: hidden width of the SwiGLU MLP.
      max_seq_len: longest sequence the model accepts.
      rope_theta: base of the rotary frequencies.
      norm_eps: epsilon inside RMSNorm's square root.
      tie_embeddings: reuse the token embedding as output head (no ``lm_head``).
      dtype: compute dtype of the matmuls: 'float32', 'bfloat16' or 'float16'.
      param_dtype: storage dtype of the parameters (normally 'float32').
      init_std: standard deviation of the normal initialiser of every kernel and the embedding.
      attention_impl: 'reference' (explicit einsums, fp32 softmax, O(T²) memory), 'jax'
        (``jax.nn.dot_product_attention``: cuDNN flash attention on GPU in bf16/fp16, XLA
        elsewhere) or 'flash' (chosen by the lowering target: jax's Pallas TPU flash
        attention kernel on TPU, cuDNN on GPU, the reference elsewhere; see
        :func:`~gift_jax.models.common.causal_attention_flash`).
      remat: recompute each block's activations in the backward pass (``nnx.remat``).
      remat_policy: which values a rematerialised block keeps, a name of
        ``jax.checkpoint_policies`` (see the module docstring).
      scan_layers: stack the blocks' parameters over a leading layer axis and apply them with
        ``nnx.scan`` (see the module docstring).
      embed_lookup: 'gather' (a gather of the embedding rows) or 'one_hot' (a one-hot matmul
        in the compute dtype at full precision, the same rows: maxtext's iota embedding; the
        table's gradient leaves it in the compute dtype). The sharded trainer uses
        'one_hot': XLA's SPMD partitioner (jax 0.10–0.12) crashes on the gather's gradient
        when the table and the token rows are both split over mesh axes; it costs one
        ``2·tokens·vocab·d_model`` matmul, about the head's.
      activation_axes: ``((logical, mesh axis), …)``: constrain the activations' shardings
        (``batch``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``; the residual stream's
        ``d_model`` is never split) — the sharded trainer sets it so that GSPMD gathers
        FSDP-split weights for each matmul (ZeRO-3) rather than reducing activations; ``()``
        (the default): no constraint, the model runs anywhere.
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    d_ff: int = 344
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
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
            positive_reals=("rope_theta", "norm_eps", "init_std"),
            bools=("tie_embeddings", "remat", "scan_layers"))
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim = d_model / num_heads must be even for rotary "
                f"embeddings, got {self.head_dim} (d_model={self.d_model}, "
                f"num_heads={self.num_heads})."
            )
        kv = self.num_kv_heads
        if kv is not None and (
            isinstance(kv, bool)
            or not isinstance(kv, numbers.Integral)
            or kv < 1
            or self.num_heads % kv
        ):
            raise ValueError(
                f"LlamaConfig.num_kv_heads must be None or a positive divisor of "
                f"num_heads={self.num_heads}, got {kv!r}."
            )
        if kv is not None:
            object.__setattr__(self, "num_kv_heads", int(kv))

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads after resolving ``num_kv_heads=None``."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


# ----------------------------------------------------------------------------- pure math


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Rotary angles ``φ[t, i] = p_t · θ^(−2i/d)`` for ``i < d/2``, in fp32.

    Args:
      positions: integer positions, any shape ``S``.
      head_dim: ``d``, the (even) per-head dimension.
      theta: the frequency base.

    Returns:
      fp32 array of shape ``S + (d/2,)``.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotates feature pairs ``(x_i, x_{i+d/2})`` by the angles ``φ_i`` (the "half" layout).

    For each pair, ``(x₁, x₂) ↦ (x₁ cos φ − x₂ sin φ, x₂ cos φ + x₁ sin φ)``: a rotation
    ``R(φ)``. Since ``R(φ_m)ᵀ R(φ_n) = R(φ_n − φ_m)``, the score ``⟨R_m q, R_n k⟩`` depends on
    the positions only through ``n − m``.

    Args:
      x: ``(batch, seq, heads, head_dim)``.
      angles: ``(batch, seq, head_dim/2)`` or ``(seq, head_dim/2)`` from ``rope_angles``.

    Returns:
      The rotated array, same shape and dtype as ``x`` (computed in fp32).
    """
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- modules


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation: ``y = x / sqrt(mean(x²) + ε) · g``.

    Unlike LayerNorm there is no centring and no bias; ``g`` (``scale``) starts at ones.
    The statistic is computed in fp32 and the result cast to the compute dtype.
    """

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, param_dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype=param_dtype), **{LOGICAL_AXES: ("norm",)})
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


class Attention(nnx.Module):
    """Causal self-attention with rotary embeddings and grouped key/value heads.

    ``q = x W_q``, ``k = x W_k``, ``v = x W_v`` (K ≤ H heads for k, v), rotate q and k by
    RoPE, ``o = softmax(q kᵀ/√d + M) v`` with the causal mask M, output ``o W_o``.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.q_proj = dense(cfg, cfg.d_model, q_dim, rngs, ("embed", "heads"),
                            heads=cfg.num_heads)
        self.k_proj = dense(cfg, cfg.d_model, kv_dim, rngs, ("embed", "kv_heads"),
                            heads=cfg.kv_heads)
        self.v_proj = dense(cfg, cfg.d_model, kv_dim, rngs, ("embed", "kv_heads"),
                            heads=cfg.kv_heads)
        self.o_proj = dense(cfg, q_dim, cfg.d_model, rngs, ("heads", "embed"))

    def __call__(self, x: jax.Array, angles: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (b, t, heads, head_dim)
        q = constrain(q, self.cfg, "batch", None, "heads", None)
        k = constrain(k, self.cfg, "batch", None, "kv_heads", None)
        v = constrain(v, self.cfg, "batch", None, "kv_heads", None)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = causal_attention(q, k, v, self.cfg)
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(x W_gate) ⊙ (x W_up))``, ``silu(z) = z·σ(z)``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate_proj = dense(cfg, cfg.d_model, cfg.d_ff, rngs, ("embed", "mlp"))
        self.up_proj = dense(cfg, cfg.d_model, cfg.d_ff, rngs, ("embed", "mlp"))
        self.down_proj = dense(cfg, cfg.d_ff, cfg.d_model, rngs, ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(constrain(h, self.cfg, "batch", None, "mlp"))


class Block(nnx.Module):
    """Pre-norm transformer block: ``h = x + attn(norm(x))``, ``y = h + mlp(norm(h))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        norm = dict(eps=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, angles: jax.Array) -> jax.Array:
        cfg = self.attn.cfg
        x = constrain(x + self.attn(self.attn_norm(x), angles), cfg, "batch", None, None)
        return constrain(x + self.mlp(self.mlp_norm(x)), cfg, "batch", None, None)


class Llama(nnx.Module):
    """Decoder-only Llama language model.

    ``logits = head(norm(blocks(embed(tokens))))``; with ``tie_embeddings`` the head is the
    transposed embedding matrix. Call with int tokens ``(batch, seq)``; returns logits
    ``(batch, seq, vocab_size)`` in the compute dtype.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama expects a LlamaConfig, got {type(config).__name__}.")
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.d_model,
            dtype=config.compute_dtype,
            param_dtype=config.storage_dtype,
            embedding_init=nnx.initializers.normal(config.init_std),
            rngs=rngs,
            embedding_metadata={LOGICAL_AXES: ("vocab", "embed")},
        )
        self.layers = stacked_blocks(lambda r: Block(config, rngs=r), config, rngs)
        self.final_norm = RMSNorm(
            config.d_model,
            eps=config.norm_eps,
            dtype=config.compute_dtype,
            param_dtype=config.storage_dtype,
        )
        self.lm_head = (
            None
            if config.tie_embeddings
            else dense(config, config.d_model, config.vocab_size, rngs, ("embed", "vocab"))
        )

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits for every position.

        Args:
          tokens: int array ``(batch, seq)`` with ``seq <= max_seq_len``.
          positions: optional int positions, ``(seq,)`` or ``(batch, seq)``; defaults to
            ``arange(seq)``.

        Returns:
          Logits ``(batch, seq, vocab_size)`` in the compute dtype.

        Raises:
          ValueError: ``tokens`` not 2-D, or longer than ``max_seq_len``.
        """
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tokens.shape}.")
        if tokens.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_seq_len={cfg.max_seq_len}."
            )
        if positions is None:
            positions = jnp.arange(tokens.shape[1])
        angles = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
        if cfg.embed_lookup == "one_hot":
            x = embed_tokens(self.embed.embedding[...], tokens, cfg)
        else:
            x = self.embed(tokens)
        x = constrain(x, cfg, "batch", None, None)
        x = apply_blocks(self.layers, x, cfg, angles)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return constrain(logits, cfg, "batch", None, "vocab")


# ----------------------------------------------------------------------------- helpers


def count_params(config: LlamaConfig) -> int:
    """Number of parameters, computed from the dimensions alone.

    Per block: two RMSNorm scales ``2d``, attention ``d·Hh + 2·d·Kh + Hh·d`` (h = head_dim),
    SwiGLU ``3·d·d_ff``; plus embedding ``V·d``, final norm ``d`` and, untied, head ``d·V``.

    Args:
      config: the model's config.

    Returns:
      The number of parameters of ``Llama(config)``.
    """
    d, h = config.d_model, config.head_dim
    attn = d * config.num_heads * h * 2 + d * config.kv_heads * h * 2
    block = 2 * d + attn + 3 * d * config.d_ff
    head = 0 if config.tie_embeddings else d * config.vocab_size
    return config.vocab_size * d + config.num_layers * block + d + head


def param_shapes(config: LlamaConfig, *, flat: bool = False) -> dict:
    """The parameters as ``jax.ShapeDtypeStruct`` leaves, without allocating any array
    (:meth:`ModelSpec.param_shapes`): a nested dict ``{'layers': {3: {'mlp': {'down_proj':
    {'kernel': …}}}}, …}``, or with ``flat`` one keyed by ``'layers/3/mlp/down_proj/kernel'``.

    Args:
      config: the model's config.
      flat: return the flat dict keyed by ``'/'``-joined paths instead of the nested one.

    Returns:
      The dict of ``jax.ShapeDtypeStruct`` leaves.
    """
    return SPEC.param_shapes(config, flat=flat)


def logical_axes(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """``{path: logical axis names}`` of every parameter (:meth:`ModelSpec.logical_axes`).

    Args:
      config: the model's config.

    Returns:
      ``{'/'-joined path: names}``, one name per dimension (``layers`` for a stacked axis).
    """
    return SPEC.logical_axes(config)


#: The Llama family as the trainer sees it (``model.family = "llama"``).
SPEC = ModelSpec("llama", LlamaConfig, Llama, count_params)
