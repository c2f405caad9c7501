"""The custom psum: quantized reduce-scatter, all-gather and all-reduce with fp32 accumulation.

A psum of FP8 values would accumulate in FP8 and overflow. Instead (``../DESIGN.md``):

1. each replica quantizes its local buffer with its *own* scales and bitcasts it to ``uint8``;
   the scales travel inside the same byte buffer as the chunks;
2. an ``all_to_all`` of those bytes is the reduce-scatter: every replica decodes the ``P``
   chunks of its shard with their senders' scales and **sums them in fp32** (fixed order);
3. the owner re-quantizes its reduced shard, a ``uint8`` ``all_gather`` ships shard + scales,
   and every replica decodes every shard with its owner's scales — the same bytes and the same
   scales everywhere, so the results are bit-identical on all replicas.

Why ``uint8`` on the wire: XLA lowers collectives of float8 arrays as f16 (twice the bytes) and
may move converts across an all-gather (jax-ml/jax#23543); a bitcast pins the format. The
bytes actually moved are read back from the compiled HLO by :func:`gift_jax.wire_bytes`.

Everything here runs inside ``jax.shard_map`` (or any context that binds the axis names);
``axis_name=None`` is the single-device identity. An axis name may be a tuple of mesh axes
(reduced as one group). ``intra_axis`` gives the hierarchical variant: reduce-scatter over the
(fast) intra-node axis in ``intra_codec`` (fp32 by default), the quantized all-reduce of that
shard across ``axis_name``, and an all-gather back over the intra axis.

Stale per-tensor scales (:func:`all_reduce_tree_stale`; ``gift_jax.allreduce(scale_sync_every=
K)``, the artifact's per-layer scales synced every 50 steps): on a sync step each scale group's
two scales — the senders' (of the replicas' gradients) and the owners' (of the reduced mean) —
are the fresh ones, ``pmax``-shared by every replica (as ``global_scale=True`` computes them);
on the other steps the held ones are reused, so values beyond ``fmax`` times a stale scale
saturate (clipped, as the casts do) and are counted. A replica whose values are non-finite
still sends NaN (its scale is NaN for that step), never clipped garbage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gift_jax.comm.buckets import DEFAULT_BUCKET_ELEMS, Bucket, plan_buckets
from gift_jax.comm.codecs import (
    Codec,
    abs_max,
    decode_rows,
    encode_rows,
    get_codec,
    leaf_scale_from_amax,
    ring_codecs,
    roundtrip,
)
from gift_jax.comm.kernels import backend as qk
from gift_jax.utils.axes import (
    AxisName,
    all_gather_invariant,
    as_varying,
    axis_size,
    axis_tuple,
    vma_checked,
)
from gift_jax.utils.platform import target_device

ACCUMULATE = ("fp32", "fp8")
#: How a quantized reduction exchanges its bytes across the data axis (:class:`AllReduceSpec`).
EXCHANGES = ("auto", "all_to_all", "permute")
#: How a quantized reduction packs a bucket (:meth:`AllReduceSpec.packs_bytes`).
PACKS = ("bytes", "floats")


def _to_bytes(a: jax.Array) -> jax.Array:
    """Any array → ``uint8[..., itemsize·last]`` (a bitcast)."""
    if a.dtype == jnp.uint8:
        return a
    raw = jax.lax.bitcast_convert_type(a, jnp.uint8)
    return raw.reshape(*a.shape[:-1], -1)


def _from_bytes(raw: jax.Array, dtype) -> jax.Array:
    if jnp.dtype(dtype) == jnp.uint8:
        return raw
    k = jnp.dtype(dtype).itemsize
    return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, k), dtype)


#: Bytes per row of a wire buffer: the lane width of a TPU vector register.
_LANES = 128


def _wire_rows(parts: list[jax.Array]) -> tuple[jax.Array, tuple[int, ...]]:
    """Byte parts ``u8[P, n_i]`` → one lane-dense buffer ``u8[P, Σ ceil(n_i/128), 128]``
    (each part zero-padded to whole 128-byte rows), and the rows of each part.

    Why rows: the TPU compiler took 75 s to compile one ``all_to_all`` of a flat
    ``u8[8, 2097152]`` (its 1-byte tiling of a 2-M-long minor dimension), and 1.4 s for the
    same bytes as ``u8[8, 16384, 128]``; a 32-bit all-gather of a flat buffer was also
    rewritten into an all-reduce, twice the bytes. At most 127 padding bytes per part travel.
    """
    rows, blocks = [], []
    for part in parts:
        n = part.shape[1]
        r = -(-n // _LANES)
        if r * _LANES != n:
            part = jnp.pad(part, ((0, 0), (0, r * _LANES - n)))
        blocks.append(part.reshape(part.shape[0], r, _LANES))
        rows.append(r)
    return (jnp.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0]), tuple(rows)


def _wire_parts(buf: jax.Array, rows: tuple[int, ...], sizes: tuple[int, ...]) -> list[jax.Array]:
    """The inverse of :func:`_wire_rows`: ``u8[P, R, 128]`` → the parts ``u8[P, n_i]``."""
    out, off = [], 0
    for r, n in zip(rows, sizes, strict=True):
        out.append(buf[:, off : off + r].reshape(buf.shape[0], r * _LANES)[:, :n])
        off += r
    return out


# ---- per-leaf scales -----------------------------------------------------------------------


def _leaf_amax(x: jax.Array, row_leaf: jax.Array, num_leaves: int) -> jax.Array:
    """Absolute maximum of each leaf over the rows present in ``x``; Inf if any is non-finite.

    Rows of leaves absent from ``x`` contribute nothing (their amax is 0).
    """
    row_amax = abs_max(x, axis=1)
    bad = ~jnp.isfinite(row_amax)
    amax = _segment_max(jnp.where(bad, 0.0, row_amax), row_leaf, num_leaves)
    leaf_bad = _segment_max(bad.astype(jnp.int32), row_leaf, num_leaves) > 0
    return jnp.where(leaf_bad, jnp.inf, amax)


def _segment_max(values: jax.Array, row_leaf: jax.Array, num_leaves: int) -> jax.Array:
    """``max(values[rows of leaf l], 0)`` for every leaf ``l`` of non-negative ``values``
    (0 for a leaf without rows), as one masked reduction ``[num_leaves, rows] → [num_leaves]``
    that XLA fuses without materialising the mask. A scatter (``jax.ops.segment_max``) gives
    the same values, but the TPU compiler took 8 s for one over 131072 rows (0.7 s this way),
    and a step has several per bucket."""
    member = row_leaf[None, :] == jnp.arange(num_leaves, dtype=row_leaf.dtype)[:, None]
    return jnp.max(jnp.where(member, values[None, :], jnp.zeros((), values.dtype)), axis=1)


def _leaf_scales(x, codec: Codec, row_leaf, num_leaves, axis_name, global_scale: bool):
    if not codec.has_leaf_scale:
        return None
    amax = _leaf_amax(x, row_leaf, num_leaves)
    if global_scale:
        amax = jax.lax.pmax(amax, axis_name)
    return leaf_scale_from_amax(amax, codec)


def _rows_held(table: jax.Array, axis_name, rows: int) -> jax.Array:
    """This replica's ``rows`` entries of a per-row table ``[P·rows, ...]`` (its shard's rows
    of the bucket plan: their leaf ids, or which are kept), replica ``i`` holding rows
    ``[i·rows, (i+1)·rows)``.

    A gather of the table reshaped ``[P, rows, ...]`` rather than ``lax.dynamic_slice``:
    jaxlib 0.12's XLA:CPU names an HLO op from JAX's ``dynamic_slice`` ``dynamic_slice.N`` and
    one it rewrites from a gather ``dynamic-slice.N``; both become the same LLVM function name,
    and a fusion holding both with the same ``N`` (an s32 row-leaf lookup indexing an f32
    scale gather) failed to compile ("Failed to translate module to LLVM IR").
    """
    table = jnp.asarray(table)
    held = table.reshape((axis_size(axis_name), rows) + table.shape[1:])
    return jnp.take(held, jax.lax.axis_index(axis_name), axis=0)


def _rows_of(leaf_scale: jax.Array | None, row_leaf: jax.Array):
    return None if leaf_scale is None else leaf_scale[row_leaf][:, None]


def _segment_sum(values: jax.Array, row_leaf: jax.Array, num_leaves: int) -> jax.Array:
    """``sum(values[rows of leaf l])`` for every leaf ``l`` (as :func:`_segment_max`)."""
    member = row_leaf[None, :] == jnp.arange(num_leaves, dtype=row_leaf.dtype)[:, None]
    return jnp.sum(jnp.where(member, values[None, :], jnp.zeros((), values.dtype)), axis=1)


def saturated_count(x: jax.Array, codec: Codec, leaf_scale: jax.Array, row_leaf: jax.Array,
                    num_leaves: int) -> jax.Array:
    """How many elements of ``x: f32[rows, B]`` lie beyond the format's range at their
    group's scale, ``|x · (1/s)| > fmax`` (the casts clip them to ``±fmax``), per scale group.

    Args:
      x: the row buffer about to be encoded.
      codec: a per-tensor-scaled codec (:attr:`~gift_jax.comm.codecs.Codec.fmax`).
      leaf_scale: ``f32[num_leaves]``, each group's scale (a NaN scale counts nothing).
      row_leaf: ``int32[rows]``, the group of every row.
      num_leaves: the number of groups.

    Returns:
      ``f32[num_leaves]`` counts (exact below 2²⁴).
    """
    over = jnp.sum(_beyond_range(x, codec, leaf_scale[row_leaf][:, None]), axis=1)
    return _segment_sum(over, row_leaf, num_leaves)


def _beyond_range(x: jax.Array, codec: Codec, scale: jax.Array) -> jax.Array:
    """``|x · (1/s)| > fmax`` as float32 ones and zeros (a zero or NaN scale: none)."""
    inv = jnp.where(scale == 0, jnp.float32(0.0), 1.0 / scale)
    return (jnp.abs(x * inv) > codec.fmax).astype(jnp.float32)


def stale_scales(codec: Codec) -> bool:
    """Whether a bucket of ``codec`` takes stale synced scales: one per-tensor scale and no
    per-row ones (``fp8_e4m3``, ``fp8_e5m2``, ``int8`` without a block size).

    Args:
      codec: the bucket's codec.

    Returns:
      ``True`` where :func:`all_reduce_tree_stale` holds its scales.
    """
    return codec.has_leaf_scale and codec.row_scale_dtype is None


def _held_scale(local_amax: jax.Array, codec: Codec, axis_name: AxisName, held: jax.Array,
                due: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(scale used this step, scale held after it)`` of a stale-scale leg quantizing values
    whose per-group amax on this replica is ``local_amax``: the fresh synced scale (``pmax``
    of the replicas' amax, as ``global_scale=True``) on a sync step (``due``, or where
    nothing is held: 0), else the held one; NaN for this step where this replica's own
    values are non-finite (its amax is Inf); a sync that is non-finite holds 0 (sync again on
    the next step)."""
    fresh = leaf_scale_from_amax(jax.lax.pmax(local_amax, axis_name), codec)
    sync = due | (held == 0)
    used = jnp.where(sync, fresh, held)
    keep = jnp.where(jnp.isfinite(fresh), fresh, jnp.float32(0.0))
    return (jnp.where(jnp.isfinite(local_amax), used, jnp.float32(jnp.nan)),
            jnp.where(sync, keep, held))


# ---- settings ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """Static settings of one quantized collective over ``axis_name`` (hashable).

    Attributes:
      axis_name: mesh axis (or tuple of axes) to reduce over; ``None`` = single device.
      codec: the wire format (:func:`gift_jax.comm.codecs.get_codec`).
      global_scale: share one per-tensor scale across replicas (one tiny ``pmax``); needed
        only to emulate FP8 accumulation, where all senders must use the same scale.
      accumulate: ``"fp32"`` (default, exact sum of decoded values) or ``"fp8"`` (emulate a
        ring that rounds every partial sum to the wire format, like NCCL's fp8 reduction;
        requires a per-tensor fp8 codec and ``global_scale``).
      backend: ``"auto"``, ``"xla"`` or ``"pallas"`` for quantize / dequantize-accumulate.
      permute: exchange the bytes by ``P − 1`` shifted ``ppermute``s instead of one
        ``all_to_all`` / ``all_gather`` (the same ``(P−1)/P·S`` bytes by the bus model). For
        the outer axis of the hierarchical reduction, which on a multi-slice TPU job crosses
        the data-centre network: there the TPU compiler sends an ``all_to_all``'s whole
        operand to the other slice (its own chunk included) and lowers the gather as an
        all-reduce, twice the bytes; a ``ppermute`` is sent as it is (see
        :func:`exchange_chunks`).
    """

    axis_name: AxisName | None
    codec: Codec
    global_scale: bool = False
    accumulate: str = "fp32"
    backend: str = "auto"
    permute: bool = False

    def __post_init__(self):
        if self.accumulate not in ACCUMULATE:
            raise ValueError(
                f"accumulate={self.accumulate!r} is not supported; allowed values: {ACCUMULATE}"
            )
        if self.accumulate == "fp8":
            if not self.codec.supports_ring_accumulation:
                raise ValueError(
                    "accumulate='fp8' emulates FP8 ring accumulation and needs a per-tensor "
                    f"codec, one of {ring_codecs()} without block_size, got {self.codec}"
                )
            if not self.global_scale:
                raise ValueError("accumulate='fp8' needs global_scale=True (shared scales)")
        qk.resolve_backend(self.backend)


# ---- byte exchanges -------------------------------------------------------------------------


def exchange_chunks(chunks: jax.Array, axis: AxisName, permute: bool) -> jax.Array:
    """``chunks[j]`` (shape ``[P, ...]``) sent to replica ``j``; returns ``[P, ...]`` with
    row ``i`` from replica ``i``: ``all_to_all``, or with ``permute`` one ``ppermute`` per
    shift ``s = 1..P−1`` (replica ``r`` sends ``chunks[(r+s) % P]`` to ``(r+s) % P``).

    Args:
      chunks: ``[P, ...]``, row ``j`` for replica ``j`` (``P`` = the size of ``axis``).
      axis: the bound mesh axis (or tuple of axes) to exchange over.
      permute: exchange by ``P − 1`` ``ppermute``s instead of one ``all_to_all`` (see
        :attr:`Collective.permute`).

    Returns:
      ``[P, ...]``: row ``i`` received from replica ``i`` (this replica's own row kept).
    """
    if not permute:
        return jax.lax.all_to_all(chunks, axis, 0, 0, tiled=True)
    P = chunks.shape[0]
    idx = jax.lax.axis_index(axis)
    out = chunks  # row idx stays: my own chunk
    for s in range(1, P):
        sent = jax.lax.dynamic_index_in_dim(chunks, (idx + s) % P, keepdims=False)
        got = jax.lax.ppermute(sent, axis, perm=[(r, (r + s) % P) for r in range(P)])
        out = jax.lax.dynamic_update_index_in_dim(out, got, (idx - s) % P, 0)
    return out


def gather_chunks(chunk: jax.Array, axis: AxisName, permute: bool) -> jax.Array:
    """Every replica's ``chunk`` stacked ``[P, ...]`` (row ``i`` from replica ``i``):
    ``all_gather`` typed invariant, or with ``permute`` one ``ppermute`` per shift. A
    ``ppermute``'s result is typed per replica, so under ``shard_map(check_vma=True)`` the
    gather stays an ``all_gather`` (the stage's output must be typed replicated).

    Args:
      chunk: this replica's chunk, any shape.
      axis: the bound mesh axis (or tuple of axes) to gather over.
      permute: gather by ``ppermute``s (ignored where ``check_vma`` tracks ``axis``).

    Returns:
      ``[P, *chunk.shape]``, identical on every replica.
    """
    if not permute or vma_checked(axis):
        return all_gather_invariant(chunk, axis)
    # a gather is the exchange in which every replica sends everyone the same chunk
    return exchange_chunks(jnp.broadcast_to(chunk[None], (axis_size(axis), *chunk.shape)),
                           axis, permute=True)


# ---- row-level collectives -----------------------------------------------------------------


def reduce_scatter_rows(
    x: jax.Array,
    col: Collective,
    row_leaf: jax.Array,
    num_leaves: int,
    rand_bits: jax.Array | None = None,
    return_local_error: bool = False,
    leaf_scale: jax.Array | None = None,
):
    """Quantized reduce-scatter of ``x: f32[rows, B]`` (rows divisible by the axis size).

    Args:
      x: this replica's row buffer (``B = col.codec.row_size``).
      col: the collective's settings (axis, codec, scales, accumulation, backend, exchange).
      row_leaf: ``int32[rows]``, the scale group of every row
        (:meth:`~gift_jax.comm.buckets.Bucket.row_leaf_ids`): per-tensor scales are computed
        per group.
      num_leaves: the number of scale groups (``row_leaf`` is below it).
      rand_bits: ``u32[rows, B]`` random bits for stochastic rounding, or ``None`` (round to
        nearest).
      return_local_error: also return the local quantization error.
      leaf_scale: ``f32[num_leaves]``, this sender's per-tensor scales in place of the ones
        computed from ``x`` (stale synced scales), or ``None``.

    Returns:
      The fp32 sum of this replica's shard, ``f32[rows/P, B]`` (shard ``i`` = rows
      ``[i·rows/P, (i+1)·rows/P)``), and, if asked, the local quantization error ``x − Q(x)``
      (for error feedback; zeros for fp32), as a pair ``(shard, error)``.
    """
    codec, axis = col.codec, col.axis_name
    if codec.is_exact:
        out = jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
        return (out, jnp.zeros_like(x)) if return_local_error else out
    if leaf_scale is None:
        leaf_scale = _leaf_scales(x, codec, row_leaf, num_leaves, axis, col.global_scale)
    leaf_rows = _rows_of(leaf_scale, row_leaf)
    payload, row_scale = qk.quantize(x, codec, leaf_rows, rand_bits, backend=col.backend)
    shard = reduce_scatter_encoded(payload, row_scale, leaf_scale, col, row_leaf, num_leaves)
    if not return_local_error:
        return shard
    local = qk.dequantize_accumulate(payload[None], codec,
                                     None if row_scale is None else row_scale[None],
                                     None if leaf_rows is None else leaf_rows[None],
                                     backend=col.backend)
    return shard, x - local


def reduce_scatter_encoded(payload: jax.Array, row_scale: jax.Array | None,
                           leaf_scale: jax.Array | None, col: Collective, row_leaf: jax.Array,
                           num_leaves: int) -> jax.Array:
    """The exchange and fp32 sum of :func:`reduce_scatter_rows`, from this replica's encoded
    row buffer.

    Args:
      payload: ``u8[rows, row_bytes]``, the encoded rows (rows divisible by the axis size).
      row_scale: their row scales as they travel, or ``None``.
      leaf_scale: ``f32[num_leaves]``, the scales the rows were encoded with, or ``None``.
      col, row_leaf, num_leaves: as :func:`reduce_scatter_rows`.

    Returns:
      The fp32 sum of this replica's shard, ``f32[rows/P, B]``.
    """
    codec, axis = col.codec, col.axis_name
    P = axis_size(axis)
    rs = payload.shape[0] // P
    parts = [payload.reshape(P, rs * codec.row_bytes)]
    if row_scale is not None:
        parts.append(_to_bytes(row_scale).reshape(P, -1))
    if leaf_scale is not None:
        parts.append(jnp.broadcast_to(_to_bytes(leaf_scale[None]), (P, 4 * num_leaves)))
    wire, wire_rows = _wire_rows(parts)
    recv = exchange_chunks(wire, axis, col.permute)  # [P, chunk rows, 128]: one per sender
    received = iter(_wire_parts(recv, wire_rows, tuple(p.shape[1] for p in parts)))

    r_payload = next(received).reshape(P, rs, codec.row_bytes)
    r_row = None
    if row_scale is not None:
        k = jnp.dtype(codec.row_scale_dtype).itemsize
        r_row = _from_bytes(next(received).reshape(P, rs, k), codec.row_scale_dtype)
    r_leaf_rows = None
    if leaf_scale is not None:
        r_leaf = _from_bytes(next(received), jnp.float32)  # [P, L]
        mine = _rows_held(row_leaf, axis, rs)
        r_leaf_rows = r_leaf[:, mine][..., None]
    if col.accumulate == "fp8":
        return _fp8_ring_sum(r_payload, codec, r_leaf_rows)
    return qk.dequantize_accumulate(r_payload, codec, r_row, r_leaf_rows, backend=col.backend)


def _fp8_ring_sum(payload, codec: Codec, leaf_rows):
    """Emulated FP8 accumulation: every partial sum is rounded back to the (shared) format."""
    acc = None
    for n in range(payload.shape[0]):
        term = decode_rows(payload[n], None, codec, leaf_rows[n])
        acc = term if acc is None else acc + term
        if n:  # a hop: the running sum travels in the wire format with the shared scale
            acc = decode_rows(encode_rows(acc, codec, leaf_rows[n])[0], None, codec, leaf_rows[n])
    return acc


def all_gather_rows(
    shard: jax.Array,
    col: Collective,
    row_leaf: jax.Array,
    num_leaves: int,
    rand_bits: jax.Array | None = None,
    return_local_error: bool = False,
    leaf_scale: jax.Array | None = None,
):
    """Quantized all-gather of ``shard: f32[rs, B]`` → ``f32[P·rs, B]``, bit-identical everywhere.

    Args:
      shard: this replica's rows (``B = col.codec.row_size``).
      col: the collective's settings (axis, codec, scales, backend, exchange).
      row_leaf: ``int32[P·rs]`` maps every row of the *gathered* buffer to its leaf
        (per-tensor scales are computed per leaf over the rows of each shard).
      num_leaves: the number of scale groups (``row_leaf`` is below it).
      rand_bits: ``u32[rs, B]`` random bits for stochastic rounding, or ``None``.
      return_local_error: also return the owner's re-quantization error.
      leaf_scale: ``f32[num_leaves]``, the owner's per-tensor scales in place of the ones
        computed from its shard (stale synced scales), or ``None``.

    Returns:
      The gathered ``f32[P·rs, B]``; with ``return_local_error`` the pair ``(gathered,
      shard − Q(shard))``, the owner's re-quantization error ``f32[rs, B]`` (zeros for fp32).
    """
    codec, axis = col.codec, col.axis_name
    P = axis_size(axis)
    rs, B = shard.shape
    if codec.is_exact:
        out = all_gather_invariant(shard, axis, tiled=True)
        return (out, jnp.zeros_like(shard)) if return_local_error else out
    g_payload, g_row, g_leaf, own = gather_encoded(shard, col, row_leaf, num_leaves,
                                                   rand_bits, leaf_scale, return_local_error)
    g_leaf_rows = None
    if g_leaf is not None:
        owner = np.arange(P * rs) // rs
        g_leaf_rows = g_leaf[owner, row_leaf][:, None]
    out = qk.dequantize_accumulate(
        g_payload[None], codec,
        None if g_row is None else g_row[None],
        None if g_leaf_rows is None else g_leaf_rows[None],
        backend=col.backend,
    )
    if not return_local_error:
        return out
    return out, shard - own


def gather_encoded(shard: jax.Array, col: Collective, row_leaf: jax.Array, num_leaves: int,
                   rand_bits: jax.Array | None = None, leaf_scale: jax.Array | None = None,
                   decode_own: bool = False):
    """The encoding and exchange of :func:`all_gather_rows`: the owner encodes its shard and
    every replica receives every owner's bytes and scales.

    Args:
      shard, col, row_leaf, num_leaves, rand_bits, leaf_scale: as :func:`all_gather_rows`.
      decode_own: also decode the owner's own encoded shard.

    Returns:
      ``(payload, row_scale, leaf_scale, own)``: the gathered ``u8[P·rs, row_bytes]``
      payload, its row scales ``[P·rs, 1]`` (or ``None``) and the owners' per-tensor scales
      ``f32[P, L]`` (or ``None``; row ``i`` from replica ``i``), identical on every replica;
      ``own``: with ``decode_own`` the owner's shard as every replica decodes it
      (``f32[rs, B]``), else ``None``.
    """
    codec, axis = col.codec, col.axis_name
    P = axis_size(axis)
    rs = shard.shape[0]
    mine = _rows_held(row_leaf, axis, rs)
    if leaf_scale is None:
        leaf_scale = _leaf_scales(shard, codec, mine, num_leaves, axis, col.global_scale)
    leaf_rows = _rows_of(leaf_scale, mine)
    payload, row_scale = qk.quantize(shard, codec, leaf_rows, rand_bits, backend=col.backend)
    parts = [payload.reshape(1, -1)]
    if row_scale is not None:
        parts.append(_to_bytes(row_scale).reshape(1, -1))
    if leaf_scale is not None:
        parts.append(_to_bytes(leaf_scale)[None])
    wire, wire_rows = _wire_rows(parts)
    gathered = gather_chunks(wire[0], axis, col.permute)  # [P, chunk rows, 128]
    received = iter(_wire_parts(gathered, wire_rows, tuple(p.shape[1] for p in parts)))

    g_payload = next(received).reshape(P * rs, codec.row_bytes)
    g_row = None
    if row_scale is not None:
        k = jnp.dtype(codec.row_scale_dtype).itemsize
        g_row = _from_bytes(next(received).reshape(P * rs, k), codec.row_scale_dtype)
    g_leaf = None if leaf_scale is None else _from_bytes(next(received), jnp.float32)
    own = None
    if decode_own:
        own = qk.dequantize_accumulate(payload[None], codec,
                                       None if row_scale is None else row_scale[None],
                                       None if leaf_rows is None else leaf_rows[None],
                                       backend=col.backend)
    return g_payload, g_row, g_leaf, own


# ---- pytree-level all-reduce ---------------------------------------------------------------

CodecPolicy = Callable[[tuple, jax.Array], Any] | Any


def resolve_codecs(tree, codec, block_size, policy) -> list[Codec]:
    """One :class:`Codec` per leaf: ``policy`` (callable ``(path, leaf) → codec`` or a pytree
    of codecs matching ``tree``) overrides the default ``codec``; leaves must be floats.

    Args:
      tree: the pytree to reduce (arrays or their abstract shapes).
      codec: the default codec, a name or a :class:`Codec`.
      block_size: the block size of the default codec (a policy's codec name other than
        ``codec`` gets none), or ``None``.
      policy: ``None`` (every leaf in ``codec``), a callable ``(key path, leaf) → codec name or
        Codec``, or a pytree of those matching ``tree``.

    Returns:
      The codecs, in the order of ``jax.tree_util.tree_leaves(tree)``.

    Raises:
      TypeError: a leaf whose dtype is not floating.
      ValueError: an unknown codec name or invalid block size, or a policy pytree whose
        structure does not match ``tree``.
    """
    leaves_with_path = jax.tree_util.tree_flatten_with_path(tree)[0]
    if policy is None:
        chosen = [codec] * len(leaves_with_path)
    elif callable(policy):
        chosen = [policy(path, leaf) for path, leaf in leaves_with_path]
    else:
        chosen = jax.tree_util.tree_structure(tree).flatten_up_to(policy)
    out = []
    for (path, leaf), c in zip(leaves_with_path, chosen, strict=True):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"leaf {jax.tree_util.keystr(path)} has dtype {dtype}: the quantized all-reduce "
                "reduces floating-point gradients only (mask integer leaves out of the chain)"
            )
        c = c if isinstance(c, Codec) else get_codec(c, block_size if c == codec else None)
        out.append(c)
    return out


@dataclasses.dataclass(frozen=True)
class AllReduceSpec:
    """Static settings of a pytree all-reduce (see :func:`gift_jax.allreduce`)."""

    axis_name: AxisName | None
    codec: str | Codec = "fp8_e4m3"
    block_size: int | None = None
    mean: bool = True
    policy: Any = None
    bucket_elems: int = DEFAULT_BUCKET_ELEMS
    global_scale: bool = False
    accumulate: str = "fp32"
    backend: str = "auto"
    intra_axis: AxisName | None = None
    intra_codec: str | Codec = "fp32"
    stack_axes: Any = None  # callable (path, leaf) → leading axes that stack tensors, or None
    exchange: str = "auto"  # one of EXCHANGES (see collective())
    pack: str = "bytes"  # one of PACKS (see packs_bytes())

    def __post_init__(self):
        get_codec(self.intra_codec)
        # validates codec, block size, accumulate, global_scale and backend together
        Collective(self.axis_name, get_codec(self.codec, self.block_size), self.global_scale,
                   self.accumulate, self.backend)
        if self.bucket_elems <= 0:
            raise ValueError(f"bucket_elems={self.bucket_elems} must be a positive int")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r} is not supported; allowed: "
                             f"{', '.join(EXCHANGES)}")
        if self.intra_axis is not None and self.axis_name is None:
            raise ValueError("intra_axis needs an axis_name to reduce across as well")
        if self.pack not in PACKS:
            raise ValueError(f"pack={self.pack!r} is not supported; allowed: {', '.join(PACKS)}")

    def collective(self, codec: Codec, axis) -> Collective:
        """The collective of ``codec`` over ``axis``; the outer axis of a hierarchical
        reduction exchanges by ``ppermute`` (see :class:`Collective`).

        Args:
          codec: a bucket's codec, or the intra-node codec.
          axis: ``axis_name`` or ``intra_axis``.

        Returns:
          The :class:`Collective`, with this spec's ``global_scale`` and ``accumulate`` for a
          quantized codec (fp32: no shared scale, fp32 accumulation) and its backend.
        """
        return Collective(axis, codec, self.global_scale and not codec.is_exact,
                          self.accumulate if not codec.is_exact else "fp32", self.backend,
                          permute=self.permutes(axis))

    def packs_bytes(self, codec: Codec) -> bool:
        """Whether a bucket of ``codec`` is encoded where its tensors lie and packed as bytes
        (``pack="bytes"``, the default, where the codec allows) rather than packed as floats
        into ``f32[rows, B]`` and encoded by the row kernels (``"floats"``, and every other
        codec).

        Packing is a relayout: on a TPU a layer gradient ``[2048, 5461]`` is tiled by
        ``(8, 128)``, and flattening it into 128-wide rows is a pass that reads and writes
        every element. Packed as floats, that pass moves 4 bytes per element each way, and
        unpacking the decoded floats (then writing them into a scanned layer stack) moves as
        many again; packed as bytes, the scale and cast run element-wise on the gradient as
        it lies (fused with its producer) and only 1 byte per element is relaid, each way.
        The values are bit for bit the same with round to nearest; stochastic rounding draws
        other bits. Applies to per-tensor 8-bit codecs (:func:`stale_scales`) on a flat
        reduction (a hierarchical one packs floats for its in-node leg).

        Args:
          codec: a bucket's codec.

        Returns:
          ``True`` to pack the bucket as bytes.
        """
        return self.pack == "bytes" and self.intra_axis is None and stale_scales(codec)

    def permutes(self, axis) -> bool:
        """Whether the quantized exchange over ``axis`` goes by shifted ``ppermute`` s
        (:attr:`Collective.permute`): always with ``exchange="permute"``, never with
        ``"all_to_all"``; ``"auto"``: on the outer axis of a hierarchical reduction (across
        slices, where the TPU compiler sends an ``all_to_all``'s whole operand), except on a
        GPU: NCCL's all-to-all is one grouped launch, while ``P − 1`` ppermutes are as many
        launches and network round trips (on 16 nodes, 645 of them in a Llama-600M step, about
        50 ms of latency by XLA's own launch and round-trip figures).

        ``"permute"`` is also what lets the TPU compiler overlap the reduction: it issues a
        ``ppermute`` asynchronously (``collective-permute-start``/``-done``) and schedules
        compute between the two, while it keeps ``all_to_all`` and ``all_gather``
        synchronous (docs/api/pod.md, "Reducing in the backward pass"). The bytes are the same
        by the bus model; the compile takes longer (``P − 1`` exchanges per bucket and phase).

        Args:
          axis: ``axis_name`` or ``intra_axis``.

        Returns:
          ``True`` to exchange by ``ppermute`` s.
        """
        if axis != self.axis_name or self.exchange == "all_to_all":
            return False
        if self.exchange == "permute":
            return True
        return self.intra_axis is not None and target_device()[0] != "gpu"

    @property
    def reduced_axes(self) -> AxisName | None:
        """Every axis the reduction sums over: ``axis_name``, then ``intra_axis``."""
        if self.axis_name is None or self.intra_axis is None:
            return self.axis_name
        return axis_tuple(self.axis_name) + axis_tuple(self.intra_axis)

    def num_shards(self) -> int:
        n = axis_size(self.axis_name)
        if self.intra_axis is not None:
            n *= axis_size(self.intra_axis)
        return n

    def stacks(self, tree) -> list[int]:
        """Per leaf, how many tensors it stacks: the product of its leading ``stack_axes(path,
        leaf)`` axes (at most all but the last; 1 without ``stack_axes``). Each gets its own
        scales (see :mod:`gift_jax.comm.buckets`).

        Args:
          tree: the pytree to reduce (arrays or their abstract shapes).

        Returns:
          The counts, in the order of ``jax.tree_util.tree_leaves(tree)``.

        Raises:
          ValueError: ``stack_axes`` gave a negative count.
        """
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        if self.stack_axes is None:
            return [1] * len(flat)
        out = []
        for path, leaf in flat:
            shape = jnp.shape(leaf)
            k = int(self.stack_axes(path, leaf) or 0)
            if k < 0:
                raise ValueError(f"stack_axes gave {k} for leaf {jax.tree_util.keystr(path)}; "
                                 "it counts leading axes (>= 0)")
            out.append(math.prod(shape[:min(k, max(len(shape) - 1, 0))]))
        return out

    def plan(self, tree) -> tuple[tuple[Bucket, ...], list[Codec]]:
        """The bucket plan of ``tree``: its quantized leaves packed into buckets that split
        over :meth:`num_shards` replicas (fp32 leaves are reduced by a plain ``psum`` and get
        no bucket). A static fact of the shapes; call it where the axes are bound.

        Args:
          tree: the pytree to reduce (arrays or their abstract shapes).

        Returns:
          ``(buckets, codecs)``: the :class:`~gift_jax.comm.buckets.Bucket` s of the
          non-fp32 leaves (their slots index the full leaf list of ``tree``) and every leaf's
          :class:`Codec` (:func:`resolve_codecs`).

        Raises:
          TypeError: a leaf that is not a float.
          ValueError: an invalid codec or policy (:func:`resolve_codecs`), or a negative count
            from ``stack_axes`` (:meth:`stacks`).
        """
        codecs = resolve_codecs(tree, self.codec, self.block_size, self.policy)
        shapes = [tuple(jnp.shape(x)) for x in jax.tree_util.tree_leaves(tree)]
        quantized = [c for c in codecs if not c.is_exact]
        shapes_q = [s for s, c in zip(shapes, codecs, strict=True) if not c.is_exact]
        idx_q = [i for i, c in enumerate(codecs) if not c.is_exact]
        stacks_q = [n for n, c in zip(self.stacks(tree), codecs, strict=True) if not c.is_exact]
        buckets = plan_buckets(shapes_q, quantized, self.num_shards(), self.bucket_elems,
                               stacks_q)
        # re-index slots to the full leaf list
        buckets = tuple(
            dataclasses.replace(
                b, slots=tuple(dataclasses.replace(s, leaf=idx_q[s.leaf]) for s in b.slots)
            )
            for b in buckets
        )
        return buckets, codecs


def _bits(key, idx, shape):
    return None if key is None else jax.random.bits(jax.random.fold_in(key, idx), shape,
                                                    jnp.uint32)


def _bucket_all_reduce(leaves: list, bucket: Bucket, spec: AllReduceSpec, key, residual,
                       stale=None):
    """All-reduce one bucket of ``leaves`` (the flattened tree); returns ``(sum or mean
    {leaf index: float32 array}, new local error {leaf index: array} or None, new shard
    error, new held scales, saturation counts)`` (the last two ``None`` without ``stale``).

    ``key`` (or ``None``) drives stochastic rounding of both quantizations; it is folded with
    the replica index so replicas draw independent bits. ``residual``: ``(the local error
    leaves, this bucket's shard error)`` or ``None``. ``stale``: ``(held f32[2, L], due)``,
    the held senders' and owners' scales of the bucket's groups and whether this step syncs
    them (a flat reduction only; see the module doc).
    """
    col = spec.collective(bucket.codec, spec.axis_name)
    row_leaf = jnp.asarray(bucket.row_leaf_ids())
    L = bucket.num_leaves
    P = spec.num_shards()
    k1 = k2 = None
    if key is not None:
        k1, k2 = jax.random.split(key)
    idx = jax.lax.axis_index(spec.axis_name)
    if spec.intra_axis is not None:
        idx = idx * axis_size(spec.intra_axis) + jax.lax.axis_index(spec.intra_axis)
        intra = spec.collective(get_codec(spec.intra_codec), spec.intra_axis)
        s1 = reduce_scatter_rows(bucket.pack(leaves), intra, row_leaf, L)
        rows1 = s1.shape[0]
        leaf1 = _rows_held(row_leaf, spec.intra_axis, rows1)
        s2 = reduce_scatter_rows(s1, col, leaf1, L, _bits(k1, idx, s1.shape))
        if spec.mean:
            s2 = s2 / P
        g2 = all_gather_rows(s2, col, leaf1, L, _bits(k2, idx, s2.shape))
        return bucket.unpack(all_gather_rows(g2, intra, row_leaf, L)), None, None, None, None
    local_leaves, shard_err = (None, None) if residual is None else residual
    held, due = (None, None) if stale is None else stale
    bytes_ = spec.packs_bytes(bucket.codec)
    scatter = _scatter_bytes if bytes_ else _scatter_floats
    shard, new_local, held_send, sat_send = scatter(
        leaves, bucket, col, row_leaf, (k1, idx), local_leaves,
        None if held is None else held[0], due)
    if spec.mean:
        shard = shard / P
    if shard_err is not None:
        shard = shard + shard_err
    mean_scale = saturated = None
    if stale is not None:
        rs = shard.shape[0]
        mine = _rows_held(row_leaf, spec.axis_name, rs)
        mean_scale, held_mean = _held_scale(_leaf_amax(shard, mine, L), bucket.codec,
                                            spec.axis_name, held[1], due)
        sat_mean = saturated_count(shard, bucket.codec, mean_scale, mine, L)
        held = jnp.stack([held_send, held_mean])
        saturated = jax.lax.psum(jnp.stack([sat_send, sat_mean]), spec.axis_name)
    ef = residual is not None
    bits = _bits(k2, idx, shard.shape)
    if bytes_:
        values, new_shard = _gather_bytes(shard, bucket, col, row_leaf, bits, mean_scale, ef)
    else:
        out = all_gather_rows(shard, col, row_leaf, L, bits, return_local_error=ef,
                              leaf_scale=mean_scale)
        full, new_shard = out if ef else (out, None)
        values = bucket.unpack(full)
    return values, new_local, new_shard, held, saturated


def _scatter_floats(leaves, bucket: Bucket, col: Collective, row_leaf, key_idx, local_leaves,
                    held, due):
    """The reduce-scatter of a bucket packed as floats (``f32[rows, B]``, then encoded by the
    row kernels): ``(shard, new local error {leaf: array} or None, held senders' scales,
    saturation counts)`` (the last two ``None`` without ``held``)."""
    L = bucket.num_leaves
    x = bucket.pack(leaves)
    if local_leaves is not None:
        x = x + bucket.pack(local_leaves)
    send_scale = held_send = sat_send = None
    if held is not None:
        send_scale, held_send = _held_scale(_leaf_amax(x, row_leaf, L), bucket.codec,
                                            col.axis_name, held, due)
        sat_send = saturated_count(x, bucket.codec, send_scale, row_leaf, L)
    ef = local_leaves is not None
    out = reduce_scatter_rows(x, col, row_leaf, L, _bits(*key_idx, x.shape),
                              return_local_error=ef, leaf_scale=send_scale)
    shard, new_local = out if ef else (out, None)
    return shard, None if new_local is None else bucket.unpack(new_local), held_send, sat_send


def _scatter_bytes(leaves, bucket: Bucket, col: Collective, row_leaf, key_idx, local_leaves,
                   held, due):
    """The reduce-scatter of a bucket encoded where its tensors lie: each leaf is scaled and
    cast in its own shape and layout, a stacked leaf's tensors each on its own scale (one
    element-wise pass per leaf, which the compiler fuses with the gradient's producer), and
    only the bytes are packed into the bucket's rows — the same bytes, scales and sums as
    :func:`_scatter_floats` (per-tensor 8-bit codecs, whose element math does not depend on
    the rows), without a pass over the floats to pack them. Returns as
    :func:`_scatter_floats`; stochastic rounding draws each leaf's bits in its own shape
    (other bits than the packed buffer's, from the same distribution)."""
    codec, runs = bucket.codec, bucket.runs()
    xs = [bucket.tensors(leaves[r.leaf], r).astype(jnp.float32) for r in runs]
    if local_leaves is not None:
        xs = [x + bucket.tensors(local_leaves[r.leaf], r) for x, r in zip(xs, runs, strict=True)]
    amax = jnp.concatenate([abs_max(x, axis=_inner_axes(x)) for x in xs])  # one per slot
    held_send = sat_send = None
    if held is not None:
        scale, held_send = _held_scale(amax, codec, col.axis_name, held, due)
    else:
        scale = leaf_scale_from_amax(
            jax.lax.pmax(amax, col.axis_name) if col.global_scale else amax, codec)
    scales = [_per_tensor(scale, r, x) for r, x in zip(runs, xs, strict=True)]
    if held is not None:
        sat_send = jnp.concatenate([jnp.sum(_beyond_range(x, codec, s), axis=_inner_axes(x))
                                    for x, s in zip(xs, scales, strict=True)])
    key, idx = key_idx
    codes = [encode_rows(x, codec, s, None if key is None else
                         _bits(jax.random.fold_in(key, r.leaf), idx, x.shape))[0]
             for x, s, r in zip(xs, scales, runs, strict=True)]
    shard = reduce_scatter_encoded(bucket.pack_bytes(codes), None, scale, col, row_leaf,
                                   bucket.num_leaves)
    new_local = None
    if local_leaves is not None:
        new_local = {r.leaf: (x - decode_rows(c, None, codec, s)).reshape(r.shape)
                     for x, c, s, r in zip(xs, codes, scales, runs, strict=True)}
    return shard, new_local, held_send, sat_send


def _inner_axes(x: jax.Array) -> tuple[int, ...]:
    """The axes of one tensor of a leaf's stack ``[parts, *inner]``."""
    return tuple(range(1, x.ndim))


def _per_tensor(scale: jax.Array, run, x: jax.Array) -> jax.Array:
    """``run``'s tensors' scales out of a bucket's per-slot ``scale``, shaped to broadcast
    over its stack ``x`` (``[parts, 1, …]``)."""
    return scale[run.first : run.first + run.parts].reshape((run.parts,) + (1,) * (x.ndim - 1))


def _gather_bytes(shard, bucket: Bucket, col: Collective, row_leaf, rand_bits, leaf_scale,
                  decode_own: bool):
    """The all-gather of a reduced shard decoded where the tensors lie: the gathered bytes
    are unpacked leaf by leaf into the leaf's shape and decoded there, each element with its
    owner's scale — the values :func:`all_gather_rows` decodes, without a pass over the
    floats to unpack them. Returns ``({leaf: float32 array}, the owner's re-quantization
    error or None)``."""
    codec, runs = bucket.codec, bucket.runs()
    g_payload, _, g_leaf, own = gather_encoded(shard, col, row_leaf, bucket.num_leaves,
                                               rand_bits, leaf_scale, decode_own)
    # relaid as bytes: without the barrier the compiler moves the widening decode ahead of
    # the unpacking and relays the floats (seen on the TPU compiler)
    codes = jax.lax.optimization_barrier([bucket.run_bytes(g_payload, r) for r in runs])
    values = {r.leaf: decode_rows(c, None, codec, _owner_scales(g_leaf, bucket, r, c.shape,
                                                                shard.shape[0])).reshape(r.shape)
              for r, c in zip(runs, codes, strict=True)}
    return values, None if own is None else shard - own


def _owner_scales(scales: jax.Array, bucket: Bucket, run, shape: tuple[int, ...],
                  rs: int) -> jax.Array:
    """The scale of every element of ``run``'s stack (``shape``, ``[parts, *inner]``) after
    a gather: its owner's per-tensor scale, ``scales[owner, slot]`` (``f32[P, L]``), the
    owner of an element being the replica whose ``rs`` rows hold it. Owner boundaries are
    static: a leaf inside one owner's rows gets its tensors' scales broadcast; one that
    spans several selects them by each element's index in the bucket."""
    B = bucket.codec.row_size
    chunk = rs * B  # elements per owner
    start = run.row_offset * B
    first, last = start // chunk, (start + run.parts * run.rows * B - 1) // chunk
    cols = scales[:, run.first : run.first + run.parts].reshape(
        (scales.shape[0], run.parts) + (1,) * (len(shape) - 1))
    out = cols[first]
    if first == last:
        return out
    strides = np.cumprod((1,) + shape[:0:-1])[::-1]
    strides[0] = run.rows * B  # a tensor starts on fresh rows
    index = start + sum(jax.lax.broadcasted_iota(jnp.int32, shape, a) * int(st)
                        for a, st in enumerate(strides))
    for k in range(first + 1, last + 1):
        out = jnp.where(index >= k * chunk, cols[k], out)
    return out


def all_reduce_tree(tree, spec: AllReduceSpec, key=None, residuals=None):
    """Quantized all-reduce of a pytree; the workhorse of :func:`gift_jax.allreduce`.

    Args:
      tree: pytree of float arrays (per-device values inside ``jax.shard_map``).
      spec: static settings.
      key: PRNG key (identical on every replica) switching on stochastic rounding; it is
        folded with the replica index so that replicas draw independent bits.
      residuals: error-feedback buffers from :func:`init_residuals` (or ``None``).

    Returns:
      ``(reduced tree, new residuals)`` — the reduced leaves keep their dtypes.
    """
    out, residuals, _, _ = _all_reduce_tree(tree, spec, key, residuals)
    return out, residuals


def init_stale_scales(tree, spec: AllReduceSpec) -> tuple[Any, Any]:
    """The held scales and saturation of :func:`all_reduce_tree_stale` before the first step:
    a tree like ``tree`` of zeros ``f32[2, parts]`` (each leaf's stacked tensors' senders' and
    owners' scales; 0: not synced yet) and one of zeros ``f32[2]``.

    Args:
      tree: the gradients' pytree (arrays or their abstract shapes).
      spec: the all-reduce's settings (the stacked tensors of each leaf).

    Returns:
      ``(scales, saturation)``.
    """
    stacks = iter(spec.stacks(tree))
    scales = jax.tree_util.tree_map(lambda _: jnp.zeros((2, next(stacks)), jnp.float32), tree)
    return scales, jax.tree_util.tree_map(lambda _: jnp.zeros((2,), jnp.float32), tree)


def all_reduce_tree_stale(tree, spec: AllReduceSpec, scales, due, key=None, residuals=None):
    """:func:`all_reduce_tree` with stale synced per-tensor scales (module doc): the buckets of
    per-tensor-scaled codecs (:func:`stale_scales`) quantize with the scales held in
    ``scales``, synced (fresh, ``pmax``-shared) where ``due`` or none is held yet, and count
    what saturates. A flat reduction (no ``intra_axis``).

    Args:
      tree: pytree of float arrays (per-device values inside ``jax.shard_map``).
      spec: static settings (``intra_axis`` must be ``None``).
      scales: the held scales, as :func:`init_stale_scales` makes them.
      due: a replicated () bool, whether this step syncs every scale.
      key: as :func:`all_reduce_tree`.
      residuals: as :func:`all_reduce_tree`.

    Returns:
      ``(reduced tree, new residuals, new held scales, saturation)``: saturation a tree like
      ``tree`` of ``f32[2]``, the share of the leaf's elements clipped this step ``[over the
      replicas' values, over the reduced mean's]`` (0 for leaves without stale scales);
      identical on every replica.

    Raises:
      ValueError: a hierarchical ``spec``.
    """
    if spec.intra_axis is not None:
        raise ValueError("stale synced scales need a flat reduction (intra_axis=None)")
    return _all_reduce_tree(tree, spec, key, residuals, (scales, due))


def _all_reduce_tree(tree, spec: AllReduceSpec, key, residuals, stale=None):
    """The reduction of :func:`all_reduce_tree` and :func:`all_reduce_tree_stale`:
    ``(tree, residuals, held scales or None, saturation or None)``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if spec.axis_name is None:
        resolve_codecs(tree, spec.codec, spec.block_size, spec.policy)  # validates leaves
        sat = None if stale is None else jax.tree_util.tree_map(jnp.zeros_like, stale[0])
        return tree, residuals, None if stale is None else stale[0], (
            None if sat is None else jax.tree_util.tree_map(lambda x: x[:, 0], sat))
    buckets, codecs = spec.plan(tree)
    held_leaves = sat_leaves = None
    if stale is not None:
        held_leaves = list(jax.tree_util.tree_leaves(stale[0]))
        sat_leaves = [jnp.zeros((2,), jnp.float32) for _ in leaves]
    out = list(leaves)
    for i, (leaf, c) in enumerate(zip(leaves, codecs, strict=True)):
        if c.is_exact:  # one psum over every data axis: XLA picks the hierarchy (in-slice
            # reduce-scatter, across slices on the shard, all-gather); two psums in a row would
            # send the whole leaf across the outer axis
            red = jax.lax.psum(leaf, spec.reduced_axes)
            out[i] = red / spec.num_shards() if spec.mean else red
    keys = [None] * len(buckets) if key is None else list(jax.random.split(key, len(buckets)))
    new_res = []
    local_leaves = None if residuals is None else [
        r[0] for r in jax.tree_util.tree_leaves(residuals[0])]
    for b, bucket in enumerate(buckets):
        res = None if residuals is None else (local_leaves, residuals[1][b][0])
        held = None
        if stale is not None and stale_scales(bucket.codec):
            held = (jnp.stack([held_leaves[s.leaf][:, s.part] for s in bucket.slots], axis=1),
                    stale[1])
        values, new_local, new_shard, new_held, saturated = _bucket_all_reduce(
            leaves, bucket, spec, keys[b], res, held)
        for leaf_idx, value in values.items():
            out[leaf_idx] = value.astype(jnp.result_type(leaves[leaf_idx]))
        if residuals is not None:
            new_res.append((new_local, new_shard))
        if new_held is not None:
            _stale_out(bucket, new_held, saturated, held_leaves, sat_leaves, leaves,
                       spec.num_shards())
    if residuals is not None:
        residuals = _residuals_out(residuals, new_res, treedef)
    held_out = sat_out = None
    if stale is not None:
        held_out = jax.tree_util.tree_unflatten(treedef, held_leaves)
        sat_out = jax.tree_util.tree_unflatten(treedef, sat_leaves)
    return jax.tree_util.tree_unflatten(treedef, out), residuals, held_out, sat_out


def _stale_out(bucket: Bucket, held: jax.Array, saturated: jax.Array, held_leaves: list,
               sat_leaves: list, leaves: list, P: int) -> None:
    """Writes a bucket's held scales ``f32[2, L]`` and saturation counts ``f32[2, L]`` back to
    its leaves' entries (in place in the lists): scales by stacked tensor, the counts summed
    over a leaf's tensors and divided by its elements (``P`` replicas' values, one mean)."""
    by_leaf: dict[int, list[int]] = {}
    for j, slot in enumerate(bucket.slots):
        by_leaf.setdefault(slot.leaf, []).append(j)
    for leaf, cols in by_leaf.items():
        held_leaves[leaf] = held[:, jnp.asarray(cols)]
        n = float(np.prod(jnp.shape(leaves[leaf]), dtype=np.int64))
        count = jnp.sum(saturated[:, jnp.asarray(cols)], axis=1)
        sat_leaves[leaf] = count / jnp.asarray([P * n, n], jnp.float32)


# ---- error-feedback buffers ----------------------------------------------------------------


def init_residuals(tree, spec: AllReduceSpec):
    """Zero error-feedback buffers ``(local, shard)`` (call where ``spec.axis_name`` is bound).

    ``local`` is a pytree like the gradients with a leading axis of 1 — each replica's own
    quantization error, added to its next gradient; ``shard`` holds one ``f32[1, rows/P, B]``
    per bucket — the owner's re-quantization error of its reduced shard. Both differ per
    replica: inside ``jax.shard_map`` give them the out-spec ``P(axis_name)`` (see
    :func:`gift_jax.partition_specs`).

    Args:
      tree: the gradients' pytree (arrays or their abstract shapes).
      spec: the all-reduce's settings (its bucket plan sizes ``shard``).

    Returns:
      ``(local, shard)``, float32 zeros typed as varying over ``spec.axis_name``.
    """
    buckets, _ = spec.plan(tree)
    P = spec.num_shards()

    def zeros(shape):
        return as_varying(jnp.zeros(shape, jnp.float32), spec.axis_name)

    local = jax.tree_util.tree_map(lambda x: zeros((1, *jnp.shape(x))), tree)
    shard = tuple(zeros((1, b.rows // P, b.codec.row_size)) for b in buckets)
    return (local, shard)


def reframe_residuals(residuals, tree, change: Callable[[Any], Any], moved,
                      spec: AllReduceSpec | None = None):
    """Error-feedback buffers ``(local, shard)`` after some leaves of ``tree`` changed frame.

    The protocol by which a stage around the all-reduce that re-expresses its leaves (GIFT,
    whose whitening ``W`` changes at a refresh) keeps what each replica owes, without knowing
    how the buffers are laid out:

    * each replica's own error ``local`` (leaf-shaped) is mapped exactly: ``change`` takes a
      tree like ``tree`` in the old frame and returns it in the new one (leaves that did not
      move must come back unchanged);
    * the shard owners' re-quantization errors ``shard`` are row slices of packed buckets
      (a slice spans whole input columns of no single leaf), which cannot be mapped locally:
      the rows of leaves where ``moved`` (a tree of bools like ``tree``) is True are zeroed,
      one step's re-quantization error of those rows being dropped. Without ``spec`` (the
      bucket plan is unknown: the buffers belong to a stage other than a bare
      :func:`gift_jax.allreduce`) every shard row is zeroed.

    Run where ``spec.axis_name`` is bound (inside ``jax.shard_map``).

    Args:
      residuals: as :func:`init_residuals` made them (``None`` is returned unchanged).
      tree: the tree the all-reduce reduces (its structure and shapes give the bucket plan).
      change: ``tree → tree``, from the old frame to the new one.
      moved: a tree like ``tree`` of static Python bools: the leaves whose frame changed.
      spec: the all-reduce's settings, or ``None`` (bucket plan unknown: every shard row is
        zeroed).

    Returns:
      ``(local, shard)`` in the new frame, or ``None``.
    """
    if residuals is None:
        return None
    local, shard = residuals
    local = jax.tree_util.tree_map(lambda x: x[None],
                                   change(jax.tree_util.tree_map(lambda x: x[0], local)))
    if spec is None:
        return local, jax.tree_util.tree_map(jnp.zeros_like, shard)
    moved_leaves = {i for i, m in enumerate(jax.tree_util.tree_leaves(moved)) if m}
    buckets, _ = spec.plan(tree)
    out = []
    for bucket, res in zip(buckets, shard, strict=True):
        ids = bucket.row_leaf_ids()
        keep = np.ones((bucket.rows,), bool)
        for j, slot in enumerate(bucket.slots):
            if slot.leaf in moved_leaves:
                keep[ids == j] = False
        rs = res.shape[1]
        mine = _rows_held(keep, spec.axis_name, rs)
        out.append(jnp.where(mine[None, :, None], res, 0.0))
    return local, tuple(out)


def _residuals_out(residuals, new_res, treedef):
    local, _ = residuals
    local_leaves = list(jax.tree_util.tree_leaves(local))
    shards = []
    for unpacked, shard in new_res:
        for leaf_idx, value in unpacked.items():
            local_leaves[leaf_idx] = value[None]
        shards.append(shard[None])
    return (jax.tree_util.tree_unflatten(treedef, local_leaves), tuple(shards))


# ---- array-level functions -----------------------------------------------------------------


def reduce_scatter_along(g: jax.Array, dim: int, col: Collective, mean: bool, key=None,
                  residual=None) -> tuple[jax.Array, jax.Array | None]:
    """Reduce-scatter ``g`` (this replica's whole gradient) over ``col.axis_name`` into this
    replica's slice of dimension ``dim``: ``Σ_r g_r[..., i·n/P : (i+1)·n/P, ...]`` on device
    ``i`` of ``P`` (the shard ``jax.lax.all_gather(..., tiled=True)`` along ``dim`` puts back),
    in ``col.codec`` (one scale per leaf, or per block) with fp32 sums; each slice is padded
    to whole codec rows so that the shard boundaries are the slices'. An exact codec is a
    ``psum_scatter`` in ``g``'s dtype.

    Args:
      g: this replica's gradient (any float dtype; quantized from fp32).
      dim: the dimension split over the axis (its size divisible by the axis size).
      col: the axis and codec.
      mean: divide by the axis size.
      key: a PRNG key for stochastic rounding (each replica folds in its index), or ``None``.
      residual: this replica's error-feedback buffer (``g``-shaped, fp32), added first, or
        ``None``.

    Returns:
      ``(shard in g's dtype, this replica's new residual or None)``.
    """
    axis, codec = col.axis_name, col.codec
    P = jax.lax.axis_size(axis)
    x = g if residual is None else g.astype(jnp.float32) + residual
    moved = jnp.moveaxis(x, dim, 0)
    shard_shape = (moved.shape[0] // P, *moved.shape[1:])
    err = None
    if codec.is_exact:
        out = jax.lax.psum_scatter(moved, axis, scatter_dimension=0, tiled=True)
        if residual is not None:
            err = jnp.zeros_like(residual)
    else:
        per = moved.reshape(P, -1).astype(jnp.float32)
        n = per.shape[1]
        padded = -(-n // codec.row_size) * codec.row_size
        rows = jnp.pad(per, ((0, 0), (0, padded - n))).reshape(-1, codec.row_size)
        bits = None
        if key is not None:
            bits = jax.random.bits(jax.random.fold_in(key, jax.lax.axis_index(axis)),
                                   rows.shape, jnp.uint32)
        res = reduce_scatter_rows(rows, col, jnp.zeros((rows.shape[0],), jnp.int32), 1, bits,
                                  return_local_error=residual is not None)
        out, e = res if residual is not None else (res, None)
        out = out.reshape(-1)[:n].reshape(shard_shape)
        if e is not None:
            err = jnp.moveaxis(e.reshape(P, padded)[:, :n].reshape(moved.shape), 0, dim)
    if mean:
        out = out / P
    return jnp.moveaxis(out.astype(g.dtype), 0, dim), err


def quantized_psum(tree, axis_name: AxisName | None, *, codec: str | Codec = "fp8_e4m3",
                   mean: bool = False, key=None, **settings):
    """Quantized ``psum`` (or ``pmean`` with ``mean=True``) of an array or pytree.

    ``settings`` are those of :class:`AllReduceSpec` (``block_size``, ``policy``,
    ``bucket_elems``, ``global_scale``, ``accumulate``, ``backend``, ``intra_axis``,
    ``intra_codec``, ``stack_axes``). ``key`` switches on stochastic rounding.

    Args:
      tree: an array or pytree of float arrays (per-device values inside ``shard_map``).
      axis_name: the mesh axis (or axes) to reduce over; ``None``: one device.
      codec: the wire format.
      mean: divide by the number of replicas.
      key: a PRNG key for stochastic rounding, or ``None``.
      **settings: further :class:`AllReduceSpec` settings.

    Returns:
      The reduced tree, each leaf in its own dtype, bit-identical on every replica.
    """
    spec = AllReduceSpec(axis_name, codec, mean=mean, **settings)
    return all_reduce_tree(tree, spec, key=key)[0]


def _flat_rows(x: jax.Array, codec: Codec, multiple: int) -> tuple[jax.Array, int]:
    flat = x.astype(jnp.float32).reshape(-1)
    B = codec.row_size
    rows = max(1, -(-flat.shape[0] // B))
    rows = -(-rows // multiple) * multiple
    return jnp.pad(flat, (0, rows * B - flat.shape[0])).reshape(rows, B), rows


def quantized_reduce_scatter(x: jax.Array, axis_name: AxisName, *,
                             codec: str | Codec = "fp8_e4m3", block_size: int | None = None,
                             backend: str = "auto", key=None) -> jax.Array:
    """Quantized reduce-scatter of an array: the fp32 sum of this replica's shard.

    ``x`` is flattened and zero-padded to ``P·rows_per_shard·row_size`` elements; replica ``i``
    receives elements ``[i·L, (i+1)·L)`` of the padded sum, ``L = len(result)``. Each sender
    scales the whole array with one per-tensor scale, or, with ``block_size``, one scale per
    block of ``block_size`` elements.

    Args:
      x: this replica's array (any shape).
      axis_name: the mesh axis (or axes) to reduce over.
      codec: the wire format.
      block_size: elements per scale, or ``None`` for one scale per sender.
      backend: ``"auto"``, ``"pallas"`` or ``"xla"``.
      key: a PRNG key for stochastic rounding, or ``None``.

    Returns:
      This replica's fp32 shard of the sum.
    """
    codec = get_codec(codec, block_size)
    P = axis_size(axis_name)
    x2, rows = _flat_rows(x, codec, P)
    bits = None
    if key is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        bits = jax.random.bits(key, x2.shape, jnp.uint32)
    col = Collective(axis_name, codec, backend=backend)
    shard = reduce_scatter_rows(x2, col, jnp.zeros((rows,), jnp.int32), 1, bits)
    return shard.reshape(-1)


def quantized_all_gather(shard: jax.Array, axis_name: AxisName, *,
                         codec: str | Codec = "fp8_e4m3", block_size: int | None = None,
                         backend: str = "auto", key=None) -> jax.Array:
    """Quantized, tiled all-gather of ``shard`` (any shape) → ``f32[P·shard.size]``.

    Each owner scales its shard (per tensor or per block); every replica decodes the same
    bytes, so the result is bit-identical everywhere.

    Args:
      shard: this replica's shard.
      axis_name: the mesh axis (or axes) to gather over.
      codec: the wire format.
      block_size: elements per scale, or ``None`` for one scale per shard.
      backend: ``"auto"``, ``"pallas"`` or ``"xla"`` (the quantize kernels).
      key: a PRNG key for stochastic rounding, or ``None``.

    Returns:
      The gathered fp32 vector of ``P·shard.size`` elements.
    """
    codec = get_codec(codec, block_size)
    P = axis_size(axis_name)
    x2, rows = _flat_rows(shard, codec, 1)
    bits = None
    if key is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
        bits = jax.random.bits(key, x2.shape, jnp.uint32)
    col = Collective(axis_name, codec, backend=backend)
    out = all_gather_rows(x2, col, jnp.zeros((P * rows,), jnp.int32), 1, bits)
    n = shard.size
    return out.reshape(P, rows * codec.row_size)[:, :n].reshape(-1)


def local_roundtrip(tree, codec: str | Codec = "fp8_e4m3", block_size=None):
    """Per-leaf local quantize→dequantize (what one replica's contribution looks like).

    Args:
      tree: an array or pytree of float arrays.
      codec: a codec name or :class:`~gift_jax.comm.codecs.Codec`.
      block_size: elements per scale, or ``None`` for one scale per leaf.

    Returns:
      The tree after quantize→dequantize, each leaf in its own dtype.
    """
    return jax.tree_util.tree_map(lambda x: roundtrip(x, codec, block_size).astype(x.dtype), tree)
