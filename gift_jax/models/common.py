"""What every decoder family of :mod:`gift_jax.models` shares, and the :class:`ModelSpec` the
trainer reads a family through.

The trainer knows a model only by its spec: how to build it from its config, the shapes and
logical axis names of its parameters (for the sharding rules of
:mod:`gift_jax.training.sharding`) and its loss. A family is one module (``llama.py``,
``gpt.py``) holding a frozen config dataclass, an ``nnx.Module`` and a ``SPEC``; the registry
in :mod:`gift_jax.models` maps ``model.family`` to it.

A family's config must have the fields the trainer sets or reads: ``vocab_size``,
``max_seq_len``, ``num_heads`` and ``kv_heads`` (the sharding check that tensor parallelism
splits whole heads), ``scan_layers``, ``embed_lookup`` and ``activation_axes`` (see
:class:`gift_jax.models.llama.LlamaConfig`); the model is called as ``model(tokens)`` →
logits. Parameter paths follow one naming, so that the default layer patterns of GIFT
(``*/mlp/down_proj``), PLUMAGE (``*/attn/*_proj``, ``*/mlp/*_proj``) and Muon's dense
exclusions (``embed/*``, ``lm_head/*``) select the same roles in every family.

Pieces shared here: the logical-axis metadata key, dtype names, the field checks common to
the configs, sharding constraints, the causal attention implementations (reference, jax,
Pallas/cuDNN flash), the block stack (unrolled or ``nnx.scan``-ned, rematerialised or not)
and the next-token loss.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gift_jax.utils.block_hook import active_block_hook, active_block_runner
from gift_jax.utils.platform import non_manual_axes, target_device

__all__ = [
    "LOGICAL_AXES",
    "REMAT_POLICIES",
    "DecoderConfig",
    "ModelSpec",
    "apply_blocks",
    "causal_attention",
    "check_decoder_fields",
    "constrain",
    "HeadsLinear",
    "dense",
    "embed_tokens",
    "next_token_loss",
    "stacked_blocks",
]

#: Metadata key of every parameter's logical axis names (one per dimension): ``vocab``,
#: ``embed`` (d_model), ``heads`` (query heads × head_dim), ``kv_heads`` (key/value heads ×
#: head_dim), ``mlp`` (d_ff), ``norm`` (a norm gain or bias), ``positions`` (a learned position
#: table's rows). A rule table maps them to mesh axes (:mod:`gift_jax.training.sharding`); a
#: custom key, not Flax's ``sharding`` metadata, so that building the model needs no mesh in
#: context.
LOGICAL_AXES = "logical_axes"

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLS = ("reference", "jax", "flash")
EMBED_LOOKUPS = ("gather", "one_hot")
#: ``remat_policy`` values: the policies (not policy factories) of ``jax.checkpoint_policies``.
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable")


# ----------------------------------------------------------------------------- configs


def _dtype_name(value: Any, owner: str, field: str) -> str:
    """Normalises a dtype given as a name or a dtype object to one of ``DTYPES``' names."""
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"{owner}.{field} must be one of {sorted(DTYPES)}, got {value!r}.")
    return name


def check_decoder_fields(cfg: Any, *, positive_ints: Sequence[str],
                         positive_reals: Sequence[str], bools: Sequence[str]) -> None:
    """Checks and normalises (in place, on a frozen dataclass) the fields every decoder config
    has: positive sizes, ``num_heads`` dividing ``d_model``, positive reals, bools,
    ``remat_policy``, ``embed_lookup``, ``attention_impl``, ``dtype``/``param_dtype`` names and
    ``activation_axes`` pairs.

    Args:
      cfg: the config dataclass instance (its class name prefixes every message).
      positive_ints, positive_reals, bools: the fields of each kind.

    Raises:
      ValueError: ``"<Config>.<field> must be …, got …"`` for the first bad field.
    """
    owner = type(cfg).__name__
    put = lambda field, value: object.__setattr__(cfg, field, value)
    for field in positive_ints:
        value = getattr(cfg, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{owner}.{field} must be a positive int, got {value!r}.")
        put(field, int(value))
    if cfg.d_model % cfg.num_heads:
        raise ValueError(f"{owner}.num_heads must divide d_model={cfg.d_model}, got "
                         f"num_heads={cfg.num_heads}.")
    for field in positive_reals:
        value = getattr(cfg, field)
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{field} must be a positive number, got {value!r}.")
        put(field, float(value))
    if cfg.remat_policy not in REMAT_POLICIES:
        raise ValueError(f"{owner}.remat_policy must be one of {REMAT_POLICIES}, got "
                         f"{cfg.remat_policy!r}.")
    for field in bools:
        if not isinstance(getattr(cfg, field), bool):
            raise ValueError(f"{owner}.{field} must be a bool, got {getattr(cfg, field)!r}.")
    put("activation_axes", tuple((str(k), str(v)) for k, v in cfg.activation_axes))
    if cfg.embed_lookup not in EMBED_LOOKUPS:
        raise ValueError(f"{owner}.embed_lookup must be one of {EMBED_LOOKUPS}, got "
                         f"{cfg.embed_lookup!r}.")
    if cfg.attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"{owner}.attention_impl must be one of {ATTENTION_IMPLS}, got "
                         f"{cfg.attention_impl!r}.")
    put("dtype", _dtype_name(cfg.dtype, owner, "dtype"))
    put("param_dtype", _dtype_name(cfg.param_dtype, owner, "param_dtype"))


def config_from_mapping(cls: type, mapping: Mapping[str, Any]) -> Any:
    """``cls(**mapping)`` for a config dataclass; unknown keys raise ``ValueError`` (a typo
    in a config file is not ignored), ``family`` among them: a run's ``model`` group goes
    through :func:`gift_jax.models.model_config_of`, which checks it names this family.

    Args:
      cls: the family's config dataclass.
      mapping: its field values by name (e.g. ``config.model`` without ``family``).

    Returns:
      The config instance (its ``__post_init__`` checks the values).

    Raises:
      ValueError: a key that is not a field of ``cls``, naming the allowed ones.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    fields = dict(mapping)
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"Unknown {cls.__name__} fields {unknown}; allowed: {sorted(names)}.")
    return cls(**fields)


class DecoderConfig:
    """What every family's config dataclass derives alike: a mixin with no fields (so each
    family keeps its own field order and defaults) over the fields they share (``d_model``,
    ``num_heads``, ``dtype``, ``param_dtype``)."""

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> Any:
        """Builds a config from a mapping (e.g. ``config.model`` of an ml_collections config).

        Unknown keys raise ``ValueError`` so that a typo in a config file is not ignored.

        Args:
          mapping: field values by name (``family`` is not a field: drop it first, or use
            :meth:`ModelSpec.config`).

        Returns:
          An instance of this config class.

        Raises:
          ValueError: a key that is not a field, or a field value the config rejects.
        """
        return config_from_mapping(cls, mapping)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(DTYPES[self.dtype])

    @property
    def storage_dtype(self) -> jnp.dtype:
        return jnp.dtype(DTYPES[self.param_dtype])


# ----------------------------------------------------------------------------- layers


def constrain(x: jax.Array, cfg: Any, *names: str | None) -> jax.Array:
    """``x`` with its sharding constrained per ``cfg.activation_axes`` (one logical name or
    ``None`` per dimension); the identity when the config sets none.

    Args:
      x: an activation.
      cfg: the model config; its ``activation_axes`` maps logical names to mesh axes.
      *names: one logical name (``"batch"``, ``"heads"``, ``"kv_heads"``, ``"mlp"``,
        ``"vocab"``) or ``None`` per dimension of ``x``; a name without a rule is unsplit, a
        rule may name several mesh axes joined by commas (``"data,fsdp"``).

    Returns:
      ``x`` under ``jax.lax.with_sharding_constraint`` on the mesh axes in context that are
      not manual (a rule's manual axes are dropped: inside a ``shard_map`` over ``fsdp``
      the rows are already this device's), or ``x`` itself when the config sets no rule or
      every axis is manual.
    """
    axes = non_manual_axes(min_size=1) if cfg.activation_axes else ()
    if not axes:
        return x
    rules = dict(cfg.activation_axes)
    spec = jax.sharding.PartitionSpec(
        *(_mesh_axes(rules.get(n), axes) if n else None for n in names))
    return jax.lax.with_sharding_constraint(x, spec)


def _mesh_axes(rule: str | None, among: tuple[str, ...] | None = None) -> str | tuple | None:
    """The mesh axis (or axes, a rule joined by commas) of a logical rule, keeping only those
    in ``among`` when given (``None`` when none is left)."""
    if not rule:
        return None
    axes = tuple(rule.split(","))
    if among is not None:
        axes = tuple(a for a in axes if a in among)
    return None if not axes else axes[0] if len(axes) == 1 else axes


class HeadsLinear(nnx.Linear):
    """An ``nnx.Linear`` ``(d_in × heads·head_dim)`` whose matmul writes its output split into
    heads: ``y[…, h, k] = Σ_d x[…, d] W[d, h·head_dim + k] (+ b[h·head_dim + k])``, the kernel
    viewed as ``(d_in, heads, head_dim)`` — the flat layer's output reshaped to
    ``(…, heads, head_dim)``, with the same parameters, paths and dtype rules.

    Why not the flat layer and a reshape: inside a ``shard_map`` manual over ``data`` with
    the kernel split over ``fsdp``, the partitioner gathers a flat projection's weight at its
    convert to the compute dtype, and the dot's flat output is then copied twice into the
    attention's heads layout, in the forward and in the rematerialised forward; with the
    heads in the contraction's output the dot writes that layout itself, as XLA's own
    data-parallel step does (``docs/api/pod.md``, the 7B forward copies).
    """

    def __init__(self, *args: Any, heads: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.out_features % heads:
            raise ValueError(f"HeadsLinear: out_features={self.out_features} is not a "
                             f"multiple of heads={heads}")
        self.heads = heads

    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        kernel = kernel.reshape(kernel.shape[0], self.heads, -1)
        extra = ({} if self.preferred_element_type is None
                 else {"preferred_element_type": self.preferred_element_type})
        y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                             precision=self.precision, **extra)
        if bias is not None:
            y += bias.reshape(kernel.shape[1:])
        return y


def dense(cfg: Any, d_in: int, d_out: int, rngs: nnx.Rngs, axes: tuple[str, str], *,
          use_bias: bool = False, init_std: float | None = None,
          heads: int | None = None) -> nnx.Linear:
    """An ``nnx.Linear`` ``(d_in × d_out)`` in the config's dtypes, normal init of std
    ``init_std`` (default ``cfg.init_std``), kernel logical axes ``axes`` and, with
    ``use_bias``, a zero bias whose logical axis is the output's.

    Args:
      cfg: the model config (``compute_dtype``, ``storage_dtype``, ``init_std``).
      d_in, d_out: the input and output widths.
      rngs: the initialisation RNG streams.
      axes: the kernel's logical axis names ``(input, output)``, e.g. ``("embed", "mlp")``.
      use_bias: add a zero-initialised bias.
      init_std: std of the kernel's normal init; ``None``: ``cfg.init_std``.
      heads: output ``(…, heads, d_out / heads)`` (a :class:`HeadsLinear`); ``None``: flat.

    Returns:
      The ``nnx.Linear`` layer, kernel ``(d_in, d_out)``.
    """
    extra = {"bias_metadata": {LOGICAL_AXES: (axes[1],)}} if use_bias else {}
    if heads is not None:
        extra["heads"] = heads
    return (nnx.Linear if heads is None else HeadsLinear)(
        d_in,
        d_out,
        use_bias=use_bias,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.storage_dtype,
        kernel_init=nnx.initializers.normal(cfg.init_std if init_std is None else init_std),
        rngs=rngs,
        kernel_metadata={LOGICAL_AXES: axes},
        **extra,
    )


def embed_tokens(table: jax.Array, tokens: jax.Array, cfg: Any) -> jax.Array:
    """Rows ``table[tokens]`` in the compute dtype: a gather, or with ``embed_lookup='one_hot'``
    a one-hot matmul (partitions where the gather's gradient does not, see
    :class:`~gift_jax.models.llama.LlamaConfig`) in the compute dtype at full precision:
    the same rows, and like every other weight's, the table's gradient leaves its matmul in
    the compute dtype (maxtext's lookup). An fp32 matmul of a bf16 model's table took the
    trainer's ``shard_map`` step on a pod half again XLA's own compile time
    (``docs/api/pod.md``).

    Args:
      table: the embedding table, ``(vocab_size, d_model)``.
      tokens: int token ids, ``(batch, seq)``.
      cfg: the model config (``embed_lookup``, ``vocab_size``, ``compute_dtype``).

    Returns:
      The embeddings, ``(batch, seq, d_model)`` in the compute dtype.
    """
    compute = cfg.compute_dtype
    if cfg.embed_lookup == "one_hot":
        return jnp.einsum("btv,vd->btd", jax.nn.one_hot(tokens, cfg.vocab_size, dtype=compute),
                          table.astype(compute), precision=jax.lax.Precision.HIGHEST)
    return jnp.take(table, tokens, axis=0).astype(compute)


# ----------------------------------------------------------------------------- attention


def causal_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """``softmax(q kᵀ / √d + causal mask) v`` with grouped key/value heads, fp32 softmax.

    Shapes: q ``(B, T, H, D)``; k, v ``(B, T, K, D)`` with ``K | H``; query head ``h`` reads
    key/value head ``h // (H/K)``. Returns ``(B, T, H, D)`` in v's dtype (q's in the model,
    where q, k and v share the compute dtype).

    Args:
      q: queries, ``(B, T, H, D)``.
      k, v: keys and values, ``(B, T, K, D)``.

    Returns:
      The attention output, ``(B, T, H, D)`` in ``v``'s dtype (q's in the model).
    """
    b, t, h, d = q.shape
    groups = h // k.shape[2]
    qg = q.reshape(b, t, k.shape[2], groups, d)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, t, h, d)


def _tpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: Any) -> jax.Array:
    """jax's Pallas TPU flash attention (``pallas.ops.tpu.flash_attention``, causal, fp32
    online softmax) on ``(B, T, H, D)`` arrays; grouped key/value heads are repeated to the
    query heads. A Mosaic kernel cannot be partitioned by GSPMD, so where mesh axes are not
    manual (the sharded trainer's ``fsdp``/``tensor``) it runs in a ``shard_map`` over them,
    rows split as ``activation_axes['batch']`` and heads as ``activation_axes['heads']``."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    _, t, h, d = q.shape
    groups = h // k.shape[2]
    if groups > 1:
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    blk = min(128, t)
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                          block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk,
                          block_q_dkv=blk, block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)
    kernel = lambda q_, k_, v_: fa.flash_attention(q_, k_, v_, causal=True,
                                                   sm_scale=1.0 / math.sqrt(d),
                                                   block_sizes=sizes)
    to_bhtd = lambda x: x.transpose(0, 2, 1, 3)
    kernel = _on_local_shards(kernel, cfg, heads_dim=1)
    return to_bhtd(kernel(to_bhtd(q), to_bhtd(k), to_bhtd(v)))


def _on_local_shards(kernel: Callable, cfg: Any, heads_dim: int) -> Callable:
    """``kernel(q, k, v)`` run on each device's own rows and heads where mesh axes are not
    manual (the sharded trainer's ``fsdp``/``tensor``): a ``shard_map`` over them, rows split
    as ``activation_axes['batch']`` and heads (dimension ``heads_dim``) as
    ``activation_axes['heads']``. A Mosaic kernel cannot be partitioned by GSPMD, and cuDNN's
    custom partitioning fails inside the trainer's partly manual map (jax 0.12: a
    ``GSPMDSharding`` where it expects a ``NamedSharding``); with no such axes, ``kernel``."""
    axes = non_manual_axes(min_size=1)
    if not axes:
        return kernel
    rules = dict(cfg.activation_axes)
    split = lambda name: _mesh_axes(rules.get(name), axes)
    dims = [split("batch"), None, None, None]
    dims[heads_dim] = split("heads")
    spec = jax.sharding.PartitionSpec(*dims)
    return jax.shard_map(kernel, mesh=jax.sharding.get_abstract_mesh(), in_specs=(spec,) * 3,
                         out_specs=spec, axis_names=set(axes), check_vma=False)


def causal_attention_flash(q: jax.Array, k: jax.Array, v: jax.Array, cfg: Any) -> jax.Array:
    """Flash attention where it lowers, chosen by the lowering target
    (:func:`gift_jax.utils.platform.target_device`, not this host): the Pallas TPU kernel on
    TPU, ``jax.nn.dot_product_attention`` with cuDNN on GPU (bf16/fp16; XLA for fp32), the
    reference elsewhere. Shapes as :func:`causal_attention_reference`.

    Args:
      q, k, v: queries ``(B, T, H, D)``, keys and values ``(B, T, K, D)``.
      cfg: the model config (its ``activation_axes`` place the TPU kernel's ``shard_map``).

    Returns:
      The attention output, ``(B, T, H, D)``.
    """
    platform, _ = target_device()
    if platform == "tpu":
        return _tpu_flash_attention(q, k, v, cfg)
    if platform == "gpu":
        cudnn = q.dtype in (jnp.bfloat16, jnp.float16)
        kernel = lambda q_, k_, v_: jax.nn.dot_product_attention(
            q_, k_, v_, is_causal=True, implementation="cudnn" if cudnn else None)
        return _on_local_shards(kernel, cfg, heads_dim=2)(q, k, v)
    return causal_attention_reference(q, k, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: Any) -> jax.Array:
    """Causal attention by ``cfg.attention_impl``: ``'reference'``
    (:func:`causal_attention_reference`), ``'jax'`` (``jax.nn.dot_product_attention``) or
    ``'flash'`` (:func:`causal_attention_flash`). Shapes as the reference's.

    Args:
      q, k, v: queries ``(B, T, H, D)``, keys and values ``(B, T, K, D)``.
      cfg: the model config (``attention_impl``; ``activation_axes`` for ``'flash'``).

    Returns:
      The attention output, ``(B, T, H, D)``.
    """
    if cfg.attention_impl == "jax":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    if cfg.attention_impl == "flash":
        return causal_attention_flash(q, k, v, cfg)
    return causal_attention_reference(q, k, v)


# ----------------------------------------------------------------------------- block stack


def _block_forward(block: nnx.Module, x: jax.Array, *args: Any) -> jax.Array:
    return block(x, *args)


def _remat_fn(cfg: Any) -> Callable[[Callable], Callable]:
    """``fn → fn`` rematerialised per ``cfg.remat`` (``remat_policy``), or the identity."""
    if not cfg.remat:
        return lambda fn: fn
    policy = getattr(jax.checkpoint_policies, cfg.remat_policy)
    return lambda fn: jax.checkpoint(fn, policy=policy)


def _forward_fn(cfg: Any) -> Callable:
    """``(block, x, *args) → x`` for one block, rematerialised per ``cfg.remat``."""
    if not cfg.remat:
        return _block_forward
    return nnx.remat(_block_forward, policy=getattr(jax.checkpoint_policies, cfg.remat_policy))


def stacked_blocks(make_block: Callable[[nnx.Rngs], nnx.Module], cfg: Any,
                   rngs: nnx.Rngs) -> nnx.Module | nnx.List:
    """``cfg.num_layers`` blocks built by ``make_block(rngs)``: an ``nnx.List`` of blocks, or
    with ``cfg.scan_layers`` one block whose parameters are stacked on axis 0 (``nnx.vmap``
    over split rngs, maxtext's layout).

    Args:
      make_block: builds one block from the RNG streams it is given.
      cfg: the model config (``num_layers``, ``scan_layers``).
      rngs: the initialisation RNG streams (split ``num_layers`` ways under ``scan_layers``).

    Returns:
      The ``nnx.List`` of blocks, or the one stacked block.
    """
    if not cfg.scan_layers:
        return nnx.List([make_block(rngs) for _ in range(cfg.num_layers)])

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return make_block(rngs)

    return make(rngs)


def apply_blocks(layers: nnx.Module | nnx.List, x: jax.Array, cfg: Any,
                 *args: Any) -> jax.Array:
    """``x`` through the blocks of :func:`stacked_blocks` in order, each called as
    ``block(x, *args)``: a Python loop, or ``nnx.scan`` over the stacked layer axis.

    Args:
      layers: what :func:`stacked_blocks` built with the same ``cfg``.
      x: the residual stream, ``(batch, seq, d_model)``.
      cfg: the model config (``scan_layers``; ``remat`` and ``remat_policy``: each block
        rematerialised).
      *args: passed to every block unchanged (e.g. Llama's rotary angles).

    Returns:
      The residual stream after the last block, ``x``'s shape.

    A scanned stack honours an active :func:`gift_jax.utils.block_hook.block_hook`: each
    layer's block state goes through the hook (with that layer's inputs) before the block runs.
    Either stack honours an active :func:`gift_jax.utils.block_hook.block_runner`: it runs
    each block (rematerialised as the runner places it).
    """
    forward = _forward_fn(cfg)
    hook, runner = active_block_hook(), active_block_runner()

    def run(block: nnx.Module, h: jax.Array, layer_inputs: Any = None) -> jax.Array:
        if runner is None and (hook is None or not cfg.scan_layers):
            return forward(block, h, *args)
        graphdef, state = nnx.split(block)
        if hook is not None and cfg.scan_layers:
            state = hook.fn(state, layer_inputs)
        if runner is None:
            return forward(nnx.merge(graphdef, state), h, *args)
        return runner(_block_forward, graphdef, state, h, *args, remat=_remat_fn(cfg))

    if not cfg.scan_layers:
        for block in layers:
            x = run(block, x)
        return x

    if hook is None:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block: nnx.Module, h: jax.Array) -> jax.Array:
            return run(block, h)

        return body(layers, x)

    @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry)
    def hooked(block: nnx.Module, h: jax.Array, layer_inputs: Any) -> jax.Array:
        return run(block, h, layer_inputs)

    return hooked(layers, x, hook.per_layer)


# ----------------------------------------------------------------------------- loss


def next_token_loss(model: nnx.Module, tokens: jax.Array, mask: jax.Array | None = None,
                    one_hot: bool = False) -> jax.Array:
    """Mean next-token cross-entropy, ``−mean_t log softmax(logits_t)[tokens_{t+1}]``.

    The model reads ``tokens[:, :-1]`` and predicts ``tokens[:, 1:]``; logits are upcast to
    fp32 before the log-softmax.

    Args:
      model: a decoder called as ``model(tokens) → logits`` (any family of
        :mod:`gift_jax.models`).
      tokens: int ``(batch, seq + 1)``.
      mask: optional ``(batch, seq)`` weights of the *targets* ``tokens[:, 1:]`` (e.g. 0 on
        padding); the loss is then ``Σ mask·ce / Σ mask``.
      one_hot: take the target's logit by a one-hot contraction instead of a gather (the same
        loss up to the last bits): it partitions when the vocabulary dimension is split over a
        mesh axis, where a gather along it crashes XLA's SPMD partitioner (jax 0.10–0.12) if
        the rows are split too. The sharded train step uses it.

    Returns:
      A scalar fp32 loss.
    """
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    if one_hot:
        target = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=jnp.float32)
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * target, axis=-1)
    else:
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    if mask is None:
        return jnp.mean(ce)
    mask = mask.astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


# ----------------------------------------------------------------------------- the spec


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family as the trainer sees it.

    Attributes:
      family: the name ``model.family`` selects it by.
      config_type: the family's frozen config dataclass (the fields of the ``model`` group).
      module_type: the ``nnx.Module`` class, built as ``module_type(config, rngs=rngs)``.
      count_params: ``config → number of parameters``, from the dimensions alone.
      trainer_fields: config fields the trainer sets itself (not settings of a config file).
    """

    family: str
    config_type: type
    module_type: type
    count_params: Callable[[Any], int]
    trainer_fields: tuple[str, ...] = ("embed_lookup", "activation_axes")

    def config(self, mapping: Mapping[str, Any]) -> Any:
        """The family's config from a mapping (``config.model``); unknown keys raise
        ``ValueError`` naming the allowed ones.

        Args:
          mapping: the ``model`` group; a ``family`` key is dropped (not checked here, see
            :func:`gift_jax.models.model_config_of`).

        Returns:
          An instance of :attr:`config_type`.

        Raises:
          ValueError: a key that is not a field of the config, or a value it rejects.
        """
        return config_from_mapping(self.config_type,
                                   {k: v for k, v in mapping.items() if k != "family"})

    def defaults(self) -> dict[str, Any]:
        """The ``model`` group of a config file at the config dataclass's defaults:
        ``family`` and every field but :attr:`trainer_fields`."""
        fields = {f.name: f.default for f in dataclasses.fields(self.config_type)
                  if f.name not in self.trainer_fields}
        return {"family": self.family, **fields}

    def build(self, config: Any, *, rngs: nnx.Rngs) -> nnx.Module:
        """The model with parameters initialised from ``rngs``.

        Args:
          config: an instance of :attr:`config_type`.
          rngs: the initialisation RNG streams.

        Returns:
          ``module_type(config, rngs=rngs)``.
        """
        return self.module_type(config, rngs=rngs)

    def abstract(self, config: Any) -> nnx.Module:
        """The model with ``jax.ShapeDtypeStruct`` leaves (``nnx.eval_shape``: no arrays).

        Args:
          config: an instance of :attr:`config_type`.

        Returns:
          The abstract module.
        """
        return nnx.eval_shape(lambda: self.build(config, rngs=nnx.Rngs(0)))

    def param_shapes(self, config: Any, *, flat: bool = False) -> dict:
        """The parameters as ``jax.ShapeDtypeStruct`` leaves, without allocating any array.

        Args:
          config: the family's config.
          flat: if False (default), a nested dict (``nnx.to_pure_dict`` of the ``nnx.Param``
            state); if True, a flat dict keyed by ``'/'``-joined paths such as
            ``'layers/3/mlp/down_proj/kernel'``.

        Returns:
          The nested or flat dict of shapes.
        """
        tree = nnx.to_pure_dict(nnx.state(self.abstract(config), nnx.Param))
        if not flat:
            return tree
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}

    def logical_axes(self, config: Any) -> dict[str, tuple[str, ...]]:
        """``{path: logical axis names}`` of every parameter (paths as :meth:`param_shapes`
        with ``flat=True``), read from the :data:`LOGICAL_AXES` metadata; a stacked layer
        axis (``scan_layers``) is named ``layers``.

        Args:
          config: an instance of :attr:`config_type`.

        Returns:
          ``{path: names}``, one name per dimension of the parameter.
        """
        out = {}
        for path, variable in nnx.iter_graph(self.abstract(config)):
            if isinstance(variable, nnx.Param):
                names = tuple(variable.get_metadata()[LOGICAL_AXES])
                stacked = len(variable.get_value().shape) - len(names)
                out["/".join(str(k) for k in path)] = ("layers",) * stacked + names
        return out

    @staticmethod
    def loss(model: nnx.Module, tokens: jax.Array, mask: jax.Array | None = None,
             one_hot: bool = False) -> jax.Array:
        """The training loss, :func:`next_token_loss`.

        Args:
          model, tokens, mask, one_hot: as :func:`next_token_loss`.

        Returns:
          The scalar fp32 loss.
        """
        return next_token_loss(model, tokens, mask, one_hot)
