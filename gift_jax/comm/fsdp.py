"""Quantized FSDP collectives: each block's weights gathered over ``fsdp`` and their gradients
reduce-scattered over it in a codec, inside the trainer's replica map.

On a sharded mesh the trainer's ``shard_map`` is manual over the data axes only; inside a
replica XLA's SPMD partitioner splits every weight over ``fsdp`` (ZeRO-3) and inserts, per
layer, an all-gather of the weight in the compute dtype before its use and a reduce-scatter of
its gradient after the backward's matmul, both in bf16/fp32. ZeRO++ (Wang et al., 2023)
quantizes exactly these two: qwZ gathers the weights in int8 blocks, qgZ reduce-scatters the
gradients in 4/8 bits; EQuARX does the same inside XLA on TPU.

:func:`fsdp_block_runner` takes them over. Each block of the model's stack (scanned or
unrolled, :func:`gift_jax.utils.block_hook.block_runner`) runs in a ``shard_map`` manual over
``fsdp`` on this device's rows of the residual stream. Inside, each weight split over
``fsdp`` (along dimension ``d``) passes through a ``jax.custom_vjp``:

* forward: ``W = all_gather(W_i)`` along ``d`` — exact, or with ``weight_codec`` each shard
  quantized by its owner and every device decoding the same bytes
  (:func:`~gift_jax.comm.collectives.quantized_all_gather`; a straight-through estimator:
  the master shard ``W_i`` is never rounded, only the copy the block computes with);
* backward: ``G_i = Σ_r G_r[d-slice i]``, this device's rows' full-weight gradient ``G_r``
  reduce-scattered along ``d`` in ``grad_codec`` (:func:`~gift_jax.comm.collectives.
  reduce_scatter_along`: one scale per sender and leaf, or the codec's blocks; sums in fp32,
  as the data axis's reduction).

The block is rematerialised (``model.remat``) inside the map, the gather with it, so as under
XLA's own FSDP a gathered weight lives for its layer only and is gathered again in the
backward. Weights not split over ``fsdp`` (norm scales) enter whole; ``shard_map``'s
transpose sums their gradients over ``fsdp`` in fp32. The embedding and output head stay with
XLA's collectives. The gradient leaves the map as this device's shard, which the data axes'
reduction (after the backward, or inside it: its hook wraps the block's state before the
runner) then reduces as before.

Inside the map the remaining model axes (``tensor``) stay with GSPMD; the collectives run in
a nested ``shard_map`` over them (a Pallas kernel must see no axis left to GSPMD).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from gift_jax.comm.codecs import (
    Codec,
    abs_max,
    decode_rows,
    encode_rows,
    leaf_scale_from_amax,
)
from gift_jax.comm.collectives import (
    Collective,
    quantized_all_gather,
    reduce_scatter_along,
)
from gift_jax.utils.block_hook import BlockRunner
from gift_jax.utils.platform import non_manual_axes
from gift_jax.utils.tree_paths import leaf_path


@dataclasses.dataclass(frozen=True)
class FsdpCodecs:
    """How the blocks' weights cross ``fsdp`` (``comm.fsdp_codec``,
    ``comm.fsdp_weight_codec``).

    Attributes:
      axis: the mesh axis the weights are split over (``'fsdp'``).
      grad: the gradients' reduce-scatter codec.
      weight: the weights' all-gather codec, or ``None`` (exact, in the weight's dtype).
      backend: the quantize kernels' backend (``'auto'``, ``'pallas'``, ``'xla'``).
    """

    axis: str
    grad: Codec
    weight: Codec | None = None
    backend: str = "auto"


def _restricted(spec: PartitionSpec, keep: Callable[[str], bool]) -> PartitionSpec:
    """``spec`` with only the mesh axes ``keep`` accepts (the others replicated)."""
    def entry(e):
        names = tuple(a for a in ((e,) if isinstance(e, str) else tuple(e or ())) if keep(a))
        return None if not names else names[0] if len(names) == 1 else names
    return PartitionSpec(*(entry(e) for e in spec))


def _on_auto_axes(fn: Callable[[jax.Array], jax.Array], in_spec: PartitionSpec,
                  out_spec: PartitionSpec) -> Callable[[jax.Array], jax.Array]:
    """``fn`` in a ``shard_map`` over the mesh axes still left to GSPMD (size 1 included),
    ``in_spec``/``out_spec`` restricted to them; ``fn`` itself when none is left."""
    axes = non_manual_axes(min_size=1)
    if not axes:
        return fn
    keep = lambda a: a in axes
    return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(_restricted(in_spec, keep),),
                         out_specs=_restricted(out_spec, keep), axis_names=set(axes),
                         check_vma=False)


def _gather_fn(codecs: FsdpCodecs, dim: int) -> Callable[[jax.Array], jax.Array]:
    """This device's shard → the whole weight, gathered along ``dim`` over ``codecs.axis``."""
    axis = codecs.axis

    def gather(shard: jax.Array) -> jax.Array:
        if codecs.weight is None:
            return jax.lax.all_gather(shard, axis, axis=dim, tiled=True)
        if _codes_in_place(codecs.weight):
            return _gather_codes(shard, dim, axis, codecs.weight)
        moved = jnp.moveaxis(shard, dim, 0)
        flat = quantized_all_gather(moved, axis, codec=codecs.weight, backend=codecs.backend)
        whole = flat.reshape(-1, *moved.shape[1:]).astype(shard.dtype)
        return jnp.moveaxis(whole, 0, dim)

    return gather


def _codes_in_place(codec: Codec) -> bool:
    """Whether ``codec`` encodes element by element with one scale per tensor (fp8, int8):
    then a gradient is scaled and cast where it lies, and only its bytes move."""
    return codec.row_scale_dtype is None and codec.has_leaf_scale and codec.bits == 8


def _owner_scales(scale: jax.Array, axis: str, dim: int, size: int, ndim: int) -> jax.Array:
    """Every device's ``scale`` gathered, as the scale of each index along ``dim`` of an
    array of ``ndim`` dimensions split into ``P`` blocks of ``size`` (device ``r``'s block
    ``r``), shaped to broadcast."""
    owners = jnp.repeat(jax.lax.all_gather(scale, axis), size)
    return owners.reshape((-1,) + (1,) * (ndim - dim - 1))


def _gather_codes(shard: jax.Array, dim: int, axis: str, codec: Codec) -> jax.Array:
    """The all-gather of :func:`_gather_fn` for a per-tensor 8-bit codec: each owner scales
    its shard by ``s_i = amax_i / fmax`` and casts it where it lies, the bytes (tiled along
    ``dim``) and the ``P`` scales are gathered, and every device decodes ``s_i · q_i`` into
    the weight's dtype where it lies (the same bytes everywhere, so the same weight; the
    decode fuses into the weight's matmuls)."""
    x = shard.astype(jnp.float32)
    scale = leaf_scale_from_amax(abs_max(x), codec)
    codes = jax.lax.all_gather(encode_rows(x, codec, scale)[0], axis, axis=dim, tiled=True)
    owners = _owner_scales(scale, axis, dim, shard.shape[dim], shard.ndim)
    return decode_rows(codes, None, codec, owners).astype(shard.dtype)


def _scatter_codes(g: jax.Array, dim: int, axis: str, codec: Codec) -> jax.Array:
    """The reduce-scatter of :func:`_scatter_fn` for a per-tensor 8-bit codec, encoded in
    ``g``'s own layout: ``s_r = amax_r / fmax``, ``q_r = cast(g_r / s_r)`` (one pass over
    the gradient, fused with the matmul that makes it, a quarter of its bytes written), the
    bytes' blocks along ``dim`` exchanged (a tiled ``all_to_all``: block ``r`` of what
    arrives is sender ``r``'s slice ``i``), and ``Σ_r s_r · q_r[slice i]`` summed in fp32
    over static slices of the bytes — the values of :func:`~gift_jax.comm.collectives.
    reduce_scatter_along` with the same codec, without laying the floats out as wire rows."""
    P = jax.lax.axis_size(axis)
    x = g.astype(jnp.float32)
    scale = leaf_scale_from_amax(abs_max(x), codec)
    received = jax.lax.all_to_all(encode_rows(x, codec, scale)[0], axis, dim, dim, tiled=True)
    senders = jax.lax.all_gather(scale, axis)
    m = g.shape[dim] // P
    total = sum(decode_rows(jax.lax.slice_in_dim(received, r * m, (r + 1) * m, axis=dim),
                            None, codec, senders[r]) for r in range(P))
    return total.astype(g.dtype)


def _scatter_fn(codecs: FsdpCodecs, dim: int) -> Callable[[jax.Array], jax.Array]:
    """This device's gradient of the whole weight → its shard of the sum over ``fsdp`` (fp32
    sums in every codec)."""
    codec, axis = codecs.grad, codecs.axis
    if codec.is_exact:
        return lambda g: jax.lax.psum_scatter(
            g.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True).astype(g.dtype)
    if _codes_in_place(codec):
        return lambda g: _scatter_codes(g, dim, axis, codec)
    col = Collective(axis, codec, backend=codecs.backend)
    return lambda g: reduce_scatter_along(g, dim, col, False)[0]


def gathered(shard: jax.Array, dim: int, spec: PartitionSpec, codecs: FsdpCodecs
             ) -> jax.Array:
    """The whole weight from this device's ``shard`` (split over ``codecs.axis`` along
    ``dim``), whose gradient is reduce-scattered back into the shard in ``codecs.grad``.

    Call inside a ``shard_map`` manual over ``codecs.axis``.

    Args:
      shard: this device's shard of the weight.
      dim: the dimension split over ``codecs.axis``.
      spec: the weight's spec over the whole mesh (its other axes stay split inside).
      codecs: the codecs.

    Returns:
      The gathered weight, in ``shard``'s dtype.
    """
    other = _restricted(spec, lambda a: a != codecs.axis)
    gather = _on_auto_axes(_gather_fn(codecs, dim), other, other)
    scatter = _on_auto_axes(_scatter_fn(codecs, dim), other, other)

    @jax.custom_vjp
    def whole(x):
        return gather(x)

    def fwd(x):
        return gather(x), None

    def bwd(_, g):
        return (scatter(g),)

    whole.defvjp(fwd, bwd)
    return whole(shard)


def _split_dim(spec: PartitionSpec, axis: str) -> int | None:
    """The dimension ``spec`` splits over ``axis`` (alone or among others), or ``None``."""
    for d, e in enumerate(spec):
        if e == axis or (isinstance(e, tuple) and axis in e):
            return d
    return None


def fsdp_block_runner(codecs: FsdpCodecs, specs: Mapping[str, PartitionSpec]) -> BlockRunner:
    """The :data:`~gift_jax.utils.block_hook.BlockRunner` that runs each block in a
    ``shard_map`` manual over ``codecs.axis``, its weights gathered and their gradients
    reduce-scattered there (see the module docstring).

    Call the model inside the trainer's replica map (manual over the data axes, ``fsdp`` left
    to GSPMD), with the residual stream's rows split over ``fsdp``.

    Args:
      codecs: the codecs.
      specs: ``{path inside a block: spec of one block's leaf}`` over the whole mesh (a
        scanned stack's layer axis dropped; :meth:`gift_jax.training.sharding.ParamLayout.
        block_specs`).

    Returns:
      The runner.

    Raises:
      ValueError: (when traced) a block leaf ``specs`` does not list.
    """
    axis = codecs.axis

    def run(block_fn, graphdef, state, x, *args, remat):
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        paths = [leaf_path(p) for p, _ in flat]
        missing = [p for p in paths if p not in specs]
        if missing:
            raise ValueError(f"comm.fsdp_codec: block leaves {missing} have no spec; the "
                             f"layout lists {sorted(specs)}")
        leaf_specs = [specs[p] for p in paths]
        dims = [_split_dim(s, axis) for s in leaf_specs]
        in_state = [_restricted(s, lambda a: a == axis) for s in leaf_specs]

        def inner(leaves, h, *a):
            whole = [x if d is None else gathered(x, d, s, codecs)
                     for x, d, s in zip(leaves, dims, leaf_specs, strict=True)]
            block = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, whole))
            return block_fn(block, h, *a)

        mapped = jax.shard_map(
            remat(inner), mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(in_state, PartitionSpec(axis), *(PartitionSpec() for _ in args)),
            out_specs=PartitionSpec(axis), axis_names={axis}, check_vma=False)
        return mapped([v for _, v in flat], x, *args)

    return run
