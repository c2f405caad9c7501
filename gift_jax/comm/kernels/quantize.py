"""Pallas kernels of the quantized all-reduce's hot path, each beside its jnp reference.

* :func:`quantize_pallas` — fused ``row absmax → scale → (stochastic) round → saturating cast →
  uint8 bytes + row scales`` over a ``[rows, B]`` buffer; reference :func:`quantize_reference`.
* :func:`dequantize_accumulate_pallas` — ``N`` received chunks ``[N, rows, bytes]`` → their fp32
  sum, added in the fixed order ``0, 1, …, N−1`` so that every backend and every replica
  produces the same bits; reference :func:`dequantize_accumulate_reference`.

The kernel bodies call the same pure element functions as the references
(:func:`gift_jax.comm.codecs.encode_row_parts` /
:func:`~gift_jax.comm.codecs.decode_row_parts`) on the column slices they load, so a kernel and
its reference can only differ through lowering, which the tests check bit for bit (on CPU
with ``platform="interpret"``).

Each kernel is one pass: every input byte is loaded once and every output byte stored once
(``gift_jax.comm.kernels.roofline`` counts the loads and stores in the lowered IR). The wire layout
(:mod:`gift_jax.comm.codecs`, "wire layout of a row") packs bytes without lane reshapes, so the
bodies are plain loads, element-wise math, row reductions and stores, which lower through

* ``platform="gpu"``: Pallas' Triton lowering, chosen explicitly with
  ``pallas.triton.CompilerParams`` (registers only, no shared-memory tiles; tile shapes must be
  powers of two, so per-block fp8 codecs with a block size that is not one do not build there);
* ``platform="tpu"``: Mosaic TPU, with a ``parallel`` grid;
* ``platform="interpret"``: the Pallas interpreter (CPU; tests).

Which backend a collective uses is decided in :mod:`gift_jax.comm.kernels.backend`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gift_jax.comm.codecs import (
    Codec,
    decode_row_parts,
    decode_rows,
    encode_row_parts,
    encode_rows,
    payload_planes,
    row_parts,
)

PLATFORMS = ("interpret", "gpu", "tpu")

#: Elements per program (one row tile).
TILE_ELEMENTS = {"gpu": 8192, "tpu": 65536, "interpret": 65536}


def _compiler_params(platform: str):
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4, num_stages=2)
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    return None


def tile_rows(rows: int, row_size: int, platform: str, block_rows: int | None = None) -> int:
    """Rows per program: a power of two of about ``TILE_ELEMENTS[platform]`` elements (or
    ``block_rows``), or all rows when there are fewer (rounded up to a power of two on GPU,
    where Triton tiles must be one). The grid is ``ceil(rows / tile)``: nothing is padded;
    the last tile is masked on GPU and clipped by Pallas elsewhere.

    Args:
      rows: rows of the ``[rows, B]`` buffer.
      row_size: ``B``, elements per row.
      platform: ``"gpu"``, ``"tpu"`` or ``"interpret"``.
      block_rows: rows per program to aim for (rounded down to a power of two), or ``None``:
        ``TILE_ELEMENTS[platform] // row_size``.

    Returns:
      The rows per program.
    """
    target = block_rows or max(1, TILE_ELEMENTS[platform] // row_size)
    target = 1 << (target.bit_length() - 1)
    if rows >= target:
        return target
    return 1 << (rows - 1).bit_length() if platform == "gpu" else rows


class _Tile:
    """Loads and stores of one program's row tile: plain ref indexing, or on GPU, when the
    rows do not fill the last tile, Triton loads and stores masked to the rows that exist."""

    def __init__(self, rows: int, tr: int, platform: str):
        self.masked = platform == "gpu" and rows % tr != 0
        self.rows, self.tr = rows, tr

    def _mask(self, shape):
        row = pl.program_id(0) * self.tr + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        return row < self.rows

    def load(self, ref, idx):
        if not self.masked:
            return ref[idx]
        from jax.experimental.pallas import triton as pltriton

        view = ref.at[idx]
        return pltriton.load(view, mask=self._mask(view.shape[-2:]), other=0)

    def store(self, ref, idx, value):
        if not self.masked:
            ref[idx] = value
            return
        from jax.experimental.pallas import triton as pltriton

        pltriton.store(ref.at[idx], value, mask=self._mask(value.shape))

    def load_parts(self, ref, n: int, lead=()):
        """A ref's block as ``n`` column slices (one load each; no value slicing)."""
        return [self.load(ref, (*lead, slice(None), s))
                for s in _column_slices(ref.shape[-1], n)]

    def store_parts(self, ref, parts):
        for s, p in zip(_column_slices(ref.shape[-1], len(parts)), parts, strict=True):
            self.store(ref, (slice(None), s), p)


def _out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """An output spec that varies over the same mesh axes as ``like`` (inside shard_map with
    ``check_vma=True`` Pallas needs to be told)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _column_slices(width: int, n: int) -> list[slice]:
    if n == 1:
        return [slice(None)]
    w = width // n
    return [slice(i * w, (i + 1) * w) for i in range(n)]


# ---- quantize ------------------------------------------------------------------------------


def quantize_reference(x, codec: Codec, leaf_scale=None, rand_bits=None):
    """``x: f32[rows, B]`` → ``(payload u8[rows, row_bytes], row_scale [rows, 1] | None)``.

    Args:
      x: the row buffer (``B = codec.row_size``).
      codec: the wire format.
      leaf_scale: ``f32[rows, 1]``, the scale of each row's leaf (required when
        ``codec.has_leaf_scale``), or ``None``.
      rand_bits: ``u32[rows, B]`` random bits for stochastic rounding, or ``None``.

    Returns:
      ``(payload, row_scale)`` of :func:`gift_jax.comm.codecs.encode_rows`.
    """
    return encode_rows(x, codec, leaf_scale, rand_bits)


@functools.partial(jax.jit, static_argnames=("codec", "platform", "block_rows", "debug"))
def quantize_pallas(x, leaf_scale, rand_bits, *, codec: Codec, platform: str,
                    block_rows: int | None = None, debug: bool = False):
    """Pallas version of :func:`quantize_reference` (same arguments; ``None`` allowed).

    Args:
      x, leaf_scale, rand_bits: as :func:`quantize_reference` (``None`` for an absent leaf
        scale or random bits).
      codec: the wire format (static).
      platform: ``"interpret"``, ``"gpu"`` or ``"tpu"`` (static): the lowering.
      block_rows: rows per program to aim for (:func:`tile_rows`), or ``None``.
      debug: ``True`` makes Pallas print the kernel's jaxpr and lowered module while
        lowering.

    Returns:
      ``(payload, row_scale)``, bit for bit those of :func:`quantize_reference`.

    Raises:
      ValueError: an unknown ``platform``.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is not supported; allowed values: {PLATFORMS}")
    rows, B = x.shape
    tr = tile_rows(rows, B, platform, block_rows)
    tile = _Tile(rows, tr, platform)
    inputs = [x]
    specs = [pl.BlockSpec((tr, B), lambda i: (i, 0))]
    if leaf_scale is not None:
        inputs.append(leaf_scale)
        specs.append(pl.BlockSpec((tr, 1), lambda i: (i, 0)))
    if rand_bits is not None:
        inputs.append(rand_bits)
        specs.append(pl.BlockSpec((tr, B), lambda i: (i, 0)))
    has_leaf, has_rand = leaf_scale is not None, rand_bits is not None
    scale_dtype = codec.row_scale_dtype
    n_parts = row_parts(codec)
    whole = (slice(None), slice(None))

    def kernel(*refs):
        it = iter(refs)
        parts = tile.load_parts(next(it), n_parts)
        leaf = tile.load(next(it), whole) if has_leaf else None
        rand = tile.load_parts(next(it), n_parts) if has_rand else None
        planes, scale = encode_row_parts(parts, codec, leaf, rand)
        tile.store_parts(next(it), planes)
        if scale_dtype is not None:
            tile.store(next(it), whole, scale)

    out_shape = [_out_struct((rows, codec.row_bytes), jnp.uint8, x)]
    out_specs = [pl.BlockSpec((tr, codec.row_bytes), lambda i: (i, 0))]
    if scale_dtype is not None:
        out_shape.append(_out_struct((rows, 1), scale_dtype, x))
        out_specs.append(pl.BlockSpec((tr, 1), lambda i: (i, 0)))
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(pl.cdiv(rows, tr),),
        in_specs=specs,
        out_specs=tuple(out_specs),
        interpret=platform == "interpret",
        compiler_params=_compiler_params(platform),
        debug=debug,
        name=f"quantize_{codec.name}",
    )(*inputs)
    return outs[0], (outs[1] if scale_dtype is not None else None)


# ---- dequantize and accumulate -------------------------------------------------------------


def dequantize_accumulate_reference(payload, codec: Codec, row_scale=None, leaf_scale=None):
    """``Σ_n decode(payload[n])`` in fp32, summed in order ``n = 0 … N−1``.

    Args:
      payload: ``u8[N, rows, row_bytes]``, the ``N`` received chunks.
      codec: the wire format.
      row_scale: ``[N, rows, 1]``, the chunks' row scales as they travelled, or ``None``.
      leaf_scale: ``f32[N, rows, 1]``, the leaf scale of every row of every chunk, or
        ``None``.

    Returns:
      ``f32[rows, B]``.
    """
    acc = None
    for n in range(payload.shape[0]):
        term = decode_rows(
            payload[n],
            None if row_scale is None else row_scale[n],
            codec,
            None if leaf_scale is None else leaf_scale[n],
        )
        acc = term if acc is None else acc + term
    return acc


@functools.partial(jax.jit, static_argnames=("codec", "platform", "block_rows", "debug"))
def dequantize_accumulate_pallas(payload, row_scale, leaf_scale, *, codec: Codec,
                                 platform: str, block_rows: int | None = None,
                                 debug: bool = False):
    """Pallas version of :func:`dequantize_accumulate_reference`.

    Each program loads its row tile of chunk ``n`` for ``n = 0 … N−1`` (one load per byte
    plane and scale, nothing held beyond the running sum) and stores the sum once. The chunk
    loop is unrolled: ``N`` is the data-axis size, so the kernel's code grows with it.

    Args:
      payload, row_scale, leaf_scale: as :func:`dequantize_accumulate_reference` (``None``
        for an absent scale).
      codec, platform, block_rows, debug: as :func:`quantize_pallas`.

    Returns:
      ``f32[rows, B]``, bit for bit that of :func:`dequantize_accumulate_reference`.

    Raises:
      ValueError: an unknown ``platform``.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is not supported; allowed values: {PLATFORMS}")
    N, rows, nbytes = payload.shape
    B = codec.row_size
    tr = tile_rows(rows, B, platform, block_rows)
    tile = _Tile(rows, tr, platform)
    inputs = [payload]
    specs = [pl.BlockSpec((N, tr, nbytes), lambda i: (0, i, 0))]
    for extra in (row_scale, leaf_scale):
        if extra is not None:
            inputs.append(extra)
            specs.append(pl.BlockSpec((N, tr, 1), lambda i: (0, i, 0)))
    has_row, has_leaf = row_scale is not None, leaf_scale is not None
    n_planes = payload_planes(codec)

    def kernel(*refs):
        it = iter(refs)
        p_ref = next(it)
        r_ref = next(it) if has_row else None
        l_ref = next(it) if has_leaf else None
        out_ref = next(it)

        def term(n):
            return decode_row_parts(
                tile.load_parts(p_ref, n_planes, lead=(n,)),
                None if r_ref is None else tile.load(r_ref, (n, slice(None), slice(None))),
                codec,
                None if l_ref is None else tile.load(l_ref, (n, slice(None), slice(None))),
            )

        acc = term(0)
        for n in range(1, N):  # unrolled like the reference, so XLA contracts them alike
            acc = [a + t for a, t in zip(acc, term(n), strict=True)]
        tile.store_parts(out_ref, acc)

    return pl.pallas_call(
        kernel,
        out_shape=_out_struct((rows, B), jnp.float32, payload),
        grid=(pl.cdiv(rows, tr),),
        in_specs=specs,
        out_specs=pl.BlockSpec((tr, B), lambda i: (i, 0)),
        interpret=platform == "interpret",
        compiler_params=_compiler_params(platform),
        debug=debug,
        name=f"dequantize_accumulate_{codec.name}",
    )(*inputs)


#: The kernels by name, with their references (used by the backend probe and the tests).
KERNELS = {
    "quantize": (quantize_pallas, quantize_reference),
    "dequantize_accumulate": (dequantize_accumulate_pallas, dequantize_accumulate_reference),
}
