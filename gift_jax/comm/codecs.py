"""Wire formats of the quantized all-reduce: codecs, scales and the element-wise math.

A *codec* says how a float32 gradient travels: the element format, how it is scaled and how
its bytes are laid out. Every codec works on *rows*: a flat buffer is viewed as ``[rows, B]``
where ``B`` is the codec's row size, and each row carries at most one scale of its own
(per-block codecs) plus, optionally, a scale shared by all rows of the same leaf (per-tensor
codecs and NVFP4's second level). The functions here are pure ``jnp`` and are the single source
of the element math: the Pallas kernels in :mod:`gift_jax.comm.kernels.quantize` call the very same
functions on the tiles they load, and the XLA path calls them on whole arrays, so both paths
are bit-identical by construction (and tested to be).

Formats (``ml_dtypes`` provides every dtype):

========== ================ ========================= ==============================
name       element          row scale                 leaf scale
========== ================ ========================= ==============================
fp32       float32          none (plain ``psum``)     none
bf16       bfloat16         none                      none
fp8_e4m3   float8_e4m3fn    fp32 per block (optional) fp32 per tensor (default)
fp8_e5m2   float8_e5m2      fp32 per block (optional) fp32 per tensor (default)
mxfp8      float8_e4m3fn    E8M0 per 32 (OCP MX)      none
nvfp4      float4_e2m1fn    float8_e4m3fn per 16      fp32 per tensor
int8       int8             fp32 per block (optional) fp32 per tensor (default)
========== ================ ========================= ==============================

Each row of the table is one entry of :data:`FORMATS`; :class:`Codec` derives every fact the
rest of the library asks (bits, scales, whether block scaling or the FP8 ring applies) from it.

Scaling maps the absolute maximum ``amax`` of the scaled group onto the format maximum:
``s = amax / fmax`` and ``q = sat(x · (1/s))``, decoded as ``q · s``. Casts saturate: an fp32 value
beyond ``fmax`` becomes ``±fmax`` (``float8_e4m3fn`` has no infinity, and XLA's plain convert
would turn an overflow into NaN). A zero group gets ``s = 1`` and encodes exact zeros. A
non-finite ``amax`` gives a NaN scale, so the whole group decodes as NaN on every replica:
garbage never passes silently as finite numbers. Per-tensor scales detect NaN/Inf with an
explicit check (:func:`abs_max`); per-block scales use a plain ``max`` on the hot path, so an
Inf poisons its block and a NaN poisons at least its own element (a fused ``max`` may drop a
NaN, but the element itself encodes to the format's NaN code).

MXFP8 (OCP Microscaling formats v1.0: e4m3 elements, one E8M0 power-of-two scale per 32): the
shared exponent is ``ceil(log2(amax / 448))``, stored as a biased byte. The spec's suggested
``floor(log2 amax) − 8`` lets ``amax / 2^e`` reach 511 and clamps everything above 448 (up to
12.5 % error on the largest elements of a block); rounding the exponent up, as NVIDIA's MXFP8
recipe does, never saturates and costs at most one bit of resolution. The exponent is
computed from the float32 bits, not by casting to ``float8_e8m0fnu`` (that cast turns 0 into
NaN and rounds 3 up to 4).

NVFP4: a per-tensor fp32 scale ``g = amax_tensor / (448 · 6)`` and a per-16 e4m3 block scale
``b = sat_e4m3(amax_block / (6 g))``; elements are ``e2m1(x / (b g))``, packed two per byte:
element ``j`` of a block in the low nibble, element ``j + 8`` in the high nibble (see "wire
layout of a row" below: no lane interleaving, so the GPU and TPU kernels lower it).

INT8 (symmetric, as in ZeRO++'s quantized gradients): ``s = amax / 127`` per tensor or per
block, ``q = clip(round(x / s), −127, 127)``, round half to even. Integers have no NaN code, so
per-block int8 scales take the explicit non-finite check that per-tensor scales always take.

Stochastic rounding (optional): with uniform ``u ∈ [0, 1)`` per element (from random bits made
outside the kernel), ``q = sign(y) · floor(|y| / ulp(y) + u) · ulp(y)`` where ``ulp(y)`` is the
spacing of the target format at ``y`` (constant below the smallest normal; 1 for int8). This is
unbiased, ``E[q] = y``, up to float32 resolution, and ``q`` is exactly representable, so the
final cast is exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

CodecName = Literal["fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4", "int8"]

#: Row size of codecs without per-block scales: each leaf is padded to a multiple of it.
DEFAULT_ROW_SIZE = 128
MX_BLOCK = 32
NVFP4_BLOCK = 16

_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
_E2M1_MAX = float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)  # 6
_MX_EMAX_ELEM = 8  # floor(log2(448))


@dataclasses.dataclass(frozen=True)
class Format:
    """The static facts of one wire format: everything the library asks about a codec.

    Attributes:
      element_dtype: dtype of one element on the wire (an ``ml_dtypes`` float, or ``int8``).
      scaling: ``"none"`` (values travel as they are), ``"amax"`` (``s = amax / fmax`` in fp32,
        per tensor by default or per block of ``block_size``), ``"mx"`` (an E8M0 power of two
        per fixed block) or ``"nvfp4"`` (an e4m3 scale per fixed block under an fp32 per-tensor
        scale).
      fixed_block: the block size the format prescribes (``mx``, ``nvfp4``), else ``None``.
      label: how reports name the wire (``"FP8"``).
    """

    element_dtype: Any
    scaling: str
    fixed_block: int | None = None
    label: str = ""


#: Every codec and its format, in the order reports list them.
FORMATS: dict[str, Format] = {
    "fp32": Format(jnp.float32, "none", label="FP32"),
    "bf16": Format(jnp.bfloat16, "none", label="BF16"),
    "fp8_e4m3": Format(jnp.float8_e4m3fn, "amax", label="FP8"),
    "fp8_e5m2": Format(jnp.float8_e5m2, "amax", label="FP8"),
    "mxfp8": Format(jnp.float8_e4m3fn, "mx", fixed_block=MX_BLOCK, label="MXFP8"),
    "nvfp4": Format(jnp.float4_e2m1fn, "nvfp4", fixed_block=NVFP4_BLOCK, label="NVFP4"),
    "int8": Format(jnp.int8, "amax", label="INT8"),
}
CODEC_NAMES: tuple[str, ...] = tuple(FORMATS)


@dataclasses.dataclass(frozen=True)
class Codec:
    """A wire format. Build it with :func:`get_codec`, which validates the settings.

    Every question the library asks about a codec is answered here, from :data:`FORMATS`: no
    module outside this one compares codec names.

    Attributes:
      name: one of :data:`CODEC_NAMES`.
      block_size: elements per row scale, or ``None`` for per-tensor scaling (for ``mxfp8``
        and ``nvfp4`` it is fixed by the format: 32 and 16).
    """

    name: str
    block_size: int | None = None

    # ---- derived, static facts -------------------------------------------------------------
    @property
    def format(self) -> Format:
        return FORMATS[self.name]

    @property
    def element_dtype(self):
        return self.format.element_dtype

    @property
    def is_integer(self) -> bool:
        """Integer elements (``int8``): rounded to the nearest integer, no NaN code."""
        return jnp.issubdtype(self.element_dtype, jnp.integer)

    @property
    def bits(self) -> int:
        return int(ml_dtypes.iinfo(self.element_dtype).bits if self.is_integer
                   else ml_dtypes.finfo(self.element_dtype).bits)

    @property
    def fmax(self) -> float:
        """Largest magnitude the scaled elements are mapped onto (127 for ``int8``)."""
        if self.is_integer:
            return float(ml_dtypes.iinfo(self.element_dtype).max)
        return float(ml_dtypes.finfo(self.element_dtype).max)

    @property
    def mantissa_bits(self) -> int:
        """Bits below the leading one (floats); for integers, the bits of the magnitude."""
        if self.is_integer:
            return self.bits - 1
        return int(ml_dtypes.finfo(self.element_dtype).nmant)

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number of the element format (0 for integers,
        whose spacing is 1 everywhere)."""
        if self.is_integer:
            return 0
        return int(np.log2(float(ml_dtypes.finfo(self.element_dtype).smallest_normal)))

    @property
    def label(self) -> str:
        """How reports name the wire: ``FP8``, ``MXFP8``, ``NVFP4``…"""
        return self.format.label

    @property
    def row_size(self) -> int:
        return self.block_size if self.block_size is not None else DEFAULT_ROW_SIZE

    @property
    def row_bytes(self) -> int:
        """Payload bytes of one row."""
        return self.row_size * self.bits // 8

    @property
    def row_scale_dtype(self):
        """dtype of the per-row scale on the wire, or ``None`` when rows carry no scale."""
        scaling = self.format.scaling
        if scaling in ("mx", "nvfp4"):
            return jnp.uint8  # biased E8M0 exponent / float8_e4m3fn bits
        if scaling == "amax" and self.block_size is not None:
            return jnp.float32
        return None

    @property
    def has_leaf_scale(self) -> bool:
        """True when one fp32 scale per leaf travels with the data."""
        scaling = self.format.scaling
        return scaling == "nvfp4" or (scaling == "amax" and self.block_size is None)

    @property
    def is_exact(self) -> bool:
        """fp32: the collective is a plain ``psum``."""
        return self.name == "fp32"

    @property
    def is_scaled(self) -> bool:
        """Whether values are scaled before the cast (every codec but fp32 and bf16): the
        low-precision codecs, which error feedback, GIFT and the intra-node codec act on."""
        return self.format.scaling != "none"

    @property
    def supports_block_scaling(self) -> bool:
        """Whether ``block_size`` may choose per-block fp32 scales instead of one per tensor."""
        return self.format.scaling == "amax"

    @property
    def supports_ring_accumulation(self) -> bool:
        """Whether the FP8-ring emulation (``accumulate="fp8"``) applies: a per-tensor scale
        that every sender can share, so that partial sums can travel in the format."""
        return self.format.scaling == "amax" and self.block_size is None

    @property
    def ideal_ratio(self) -> float:
        """Bytes per element relative to fp32, including per-row scales (not per-leaf ones)."""
        scale = 0.0
        if self.row_scale_dtype is not None:
            scale = jnp.dtype(self.row_scale_dtype).itemsize / self.row_size
        return (self.bits / 8 + scale) / 4


def low_precision_codecs() -> tuple[str, ...]:
    """The codecs that scale their values: what GIFT, PLUMAGE and error feedback act on."""
    return tuple(n for n in CODEC_NAMES if Codec(n).is_scaled)


def get_codec(codec: str | Codec, block_size: int | None = None) -> Codec:
    """Validated :class:`Codec` from a name and an optional block size.

    Args:
      codec: one of :data:`CODEC_NAMES` (or a :class:`Codec`, returned as it is).
      block_size: elements per fp32 scale for the codecs that
        :attr:`~Codec.supports_block_scaling`; ``None``: one scale per tensor. ``mxfp8`` and
        ``nvfp4`` accept only their own block size.

    Returns:
      The :class:`Codec`.

    Raises:
      ValueError: an unknown name or a block size the format does not allow.
    """
    if isinstance(codec, Codec):
        return codec
    if not isinstance(codec, str) or codec not in CODEC_NAMES:
        raise ValueError(f"codec={codec!r} is not supported; allowed values: {CODEC_NAMES}")
    fmt = FORMATS[codec]
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive int or None")
        if fmt.scaling == "none":
            raise ValueError(
                f"block_size={block_size} has no meaning for codec={codec!r} (no scales); "
                f"use it with one of {block_scaled_codecs()}"
            )
        if fmt.fixed_block is not None and block_size != fmt.fixed_block:
            raise ValueError(f"{codec} uses block_size={fmt.fixed_block}, got {block_size}")
    if fmt.fixed_block is not None:
        block_size = fmt.fixed_block
    return Codec(codec, block_size)


def block_scaled_codecs() -> tuple[str, ...]:
    """The codecs whose ``block_size`` is a free choice (per-block fp32 scales)."""
    return tuple(n for n in CODEC_NAMES if Codec(n).supports_block_scaling)


def codec_variants(block_size: int = 128) -> tuple[Codec, ...]:
    """Every wire format the quantized all-reduce produces (all but fp32's plain ``psum``):
    each codec per tensor (or on its fixed blocks), and each that
    :attr:`~Codec.supports_block_scaling` on blocks of ``block_size`` too. What a check over
    "every codec" iterates, so that a new codec is checked everywhere.

    Args:
      block_size: elements per fp32 scale of the per-block variants.

    Returns:
      The :class:`Codec` s: every codec but fp32 per tensor (``mxfp8`` and ``nvfp4`` on their
      fixed blocks), then each block-scalable codec on blocks of ``block_size``.
    """
    per_tensor = tuple(get_codec(n) for n in CODEC_NAMES if not Codec(n).is_exact)
    return per_tensor + tuple(get_codec(n, block_size) for n in block_scaled_codecs())


def ring_codecs() -> tuple[str, ...]:
    """The codecs the FP8-ring emulation takes (per tensor, without ``block_size``)."""
    return tuple(n for n in CODEC_NAMES if Codec(n).supports_ring_accumulation)


# ---- float32 bit helpers -------------------------------------------------------------------


def _pow2(e: jax.Array) -> jax.Array:
    """Exact ``2.0**e`` as float32 for integer ``e`` in [-126, 127]."""
    return jax.lax.bitcast_convert_type(((e + 127).astype(jnp.uint32)) << 23, jnp.float32)


def _floor_log2(y: jax.Array) -> jax.Array:
    """``floor(log2 |y|)`` from the float32 exponent bits (−127 for zero and subnormals)."""
    bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
    return ((bits >> 23) & 0xFF).astype(jnp.int32) - 127


# ---- scales --------------------------------------------------------------------------------


def abs_max(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """``max |x|``, and ``+inf`` whenever the group holds a NaN or Inf.

    The non-finite check is an explicit boolean reduction: a float ``max`` reduction is not
    guaranteed to propagate NaN once XLA fuses and vectorises it (on CPU it does not).

    Args:
      x: a float array (not empty).
      axis: the axis or axes reduced over, as in ``jnp.max``; ``None``: all of ``x``.
      keepdims: keep the reduced axes with size 1.

    Returns:
      float32 ``max |x|`` per group, ``+inf`` for a group holding a NaN or Inf.
    """
    finite = jnp.isfinite(x)
    amax = jnp.max(jnp.abs(jnp.where(finite, x, 0.0)), axis=axis, keepdims=keepdims)
    bad = jnp.any(~finite, axis=axis, keepdims=keepdims)
    return jnp.where(bad, jnp.float32(jnp.inf), amax.astype(jnp.float32))


def amax_to_scale(amax: jax.Array, fmax: float) -> jax.Array:
    """``amax / fmax``; 1 for an all-zero group; NaN for a non-finite ``amax``.

    Args:
      amax: absolute maxima of the scaled groups, any shape (cast to float32).
      fmax: the magnitude ``amax`` is mapped onto (:attr:`Codec.fmax`; ``448 · 6`` for NVFP4's
        leaf scale).

    Returns:
      The float32 scales, shaped like ``amax``.
    """
    amax = amax.astype(jnp.float32)
    scale = jnp.where(amax == 0, jnp.float32(1.0), amax / jnp.float32(fmax))
    return jnp.where(jnp.isfinite(amax), scale, jnp.float32(jnp.nan))


def leaf_scale_from_amax(amax: jax.Array, codec: Codec) -> jax.Array:
    """The per-leaf fp32 scale (per-tensor fp8, and NVFP4's second level).

    Args:
      amax: each leaf's absolute maximum (:func:`abs_max`), any shape.
      codec: the wire format: NVFP4 maps ``amax`` onto ``448 · 6`` (the largest e4m3 block
        scale times the largest e2m1 element), every other codec onto its :attr:`Codec.fmax`.

    Returns:
      The float32 scales, shaped like ``amax`` (see :func:`amax_to_scale`).
    """
    fmax = codec.fmax * _E4M3_MAX if codec.format.scaling == "nvfp4" else codec.fmax
    return amax_to_scale(amax, fmax)


def _mx_exponent_byte(amax: jax.Array) -> jax.Array:
    """Biased E8M0 shared exponent ``ceil(log2(amax / 448)) + 127``; 255 (NaN) if non-finite.

    Computed exactly from the float32 bits: ``e₀ = floor(log2 amax) − 8``, plus one when
    ``amax · 2^−e₀ > 448``.
    """
    e0 = jnp.clip(_floor_log2(amax) - _MX_EMAX_ELEM, -126, 127)
    e = e0 + (amax * _pow2(-jnp.clip(e0, -127, 126)) > _E4M3_MAX).astype(jnp.int32)
    e = jnp.clip(e + 127, 1, 254)
    return jnp.where(jnp.isfinite(amax), e, 255).astype(jnp.uint8)


def _mx_scale(byte: jax.Array) -> jax.Array:
    e = byte.astype(jnp.int32)
    return jnp.where(e == 255, jnp.float32(jnp.nan), _pow2(jnp.clip(e, 1, 254) - 127))


def _e4m3_byte(x: jax.Array) -> jax.Array:
    x = jnp.clip(x, 0.0, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def _e4m3_from_byte(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32)


def row_amax(parts: list[jax.Array]) -> jax.Array:
    """``max |x|`` over each row of a row split into column ``parts``: ``[rows, 1]``.

    Args:
      parts: the column slices ``[rows, w]`` of one row buffer (:func:`split_columns`).

    Returns:
      ``[rows, 1]`` in the parts' dtype; a plain ``max`` (no explicit non-finite check).
    """
    amax = None
    for p in parts:
        m = jnp.max(jnp.abs(p), axis=1, keepdims=True)
        amax = m if amax is None else jnp.maximum(amax, m)
    return amax


def row_scales(parts: list[jax.Array], leaf_scale: jax.Array | None, codec: Codec):
    """Per-row scale of a ``[rows, B]`` row buffer given as its column ``parts``:
    ``(wire_value [rows, 1], fp32 divisor [rows, 1])``.

    For codecs without per-row scales the wire value is ``None`` and the divisor is the leaf
    scale (or 1).

    Args:
      parts: the buffer's :func:`row_parts` column slices, float32 ``[rows, B / n]`` each.
      leaf_scale: ``f32[rows, 1]``, the scale of the leaf each row belongs to (needed by
        per-tensor codecs and NVFP4), or ``None``.
      codec: the wire format.

    Returns:
      ``(wire_value, divisor)``: the row scale as it travels (fp32 for per-block ``amax``
      codecs, the biased E8M0 exponent byte for mxfp8, the e4m3 bits for nvfp4; ``None``
      without per-row scales) and the fp32 ``[rows, 1]`` the elements are divided by.
    """
    if codec.row_scale_dtype is None:
        if leaf_scale is not None:
            return None, leaf_scale
        return None, jnp.ones((parts[0].shape[0], 1), jnp.float32)
    # A plain max: no separate non-finite pass on the hot path. An Inf makes the row's scale
    # NaN (whole row NaN); a NaN either does the same or, where a fused max drops it, stays a
    # NaN code in place (fp8 formats have NaN codes): never finite garbage. NVFP4 (no NaN
    # code) is covered by its per-tensor scale, computed with the explicit check.
    amax = row_amax(parts)
    if codec.is_integer:  # no NaN code to fall back on: an explicit non-finite check
        amax = jnp.where(row_amax([jnp.where(jnp.isfinite(p), 0.0, 1.0) for p in parts]) > 0,
                         jnp.float32(jnp.inf), amax)
    scaling = codec.format.scaling
    if scaling == "mx":
        byte = _mx_exponent_byte(amax)
        return byte, _mx_scale(byte)
    if scaling == "nvfp4":
        byte = _e4m3_byte(amax / (_E2M1_MAX * leaf_scale))
        return byte, _e4m3_from_byte(byte) * leaf_scale
    scale = amax_to_scale(amax, codec.fmax)
    return scale, scale


def decode_row_scales(wire: jax.Array | None, leaf_scale: jax.Array | None, codec: Codec):
    """fp32 divisor ``[rows, 1]`` from the wire row scales and the leaf scales.

    Args:
      wire: the received row scales ``[rows, 1]`` (the wire value of :func:`row_scales`), or
        ``None`` for codecs without per-row scales.
      leaf_scale: ``f32[rows, 1]``, the scale of each row's leaf (per-tensor codecs and
        NVFP4), or ``None``.
      codec: the wire format.

    Returns:
      The divisor the sender's :func:`row_scales` used; ``None`` when the codec has no scales
      at all (bf16).
    """
    scaling = codec.format.scaling
    if scaling == "mx":
        return _mx_scale(wire)
    if scaling == "nvfp4":
        return _e4m3_from_byte(wire) * leaf_scale
    if wire is not None:
        return wire
    return leaf_scale


# ---- element rounding ----------------------------------------------------------------------


def uniform_from_bits(bits: jax.Array, codec: Codec) -> jax.Array:
    """Uniform ``[0, 1)`` with ``23 − mantissa_bits`` fractional bits, from uint32 bits.

    The resolution is chosen so that ``|y|/ulp + u`` is exact in float32 for normal ``y``.

    Args:
      bits: uint32 random bits, any shape (their top ``23 − mantissa_bits`` bits are used).
      codec: the element format (:attr:`~Codec.mantissa_bits`).

    Returns:
      float32 uniforms shaped like ``bits``.
    """
    frac_bits = 23 - codec.mantissa_bits
    return (bits >> (32 - frac_bits)).astype(jnp.float32) * jnp.float32(2.0**-frac_bits)


def stochastic_round(y: jax.Array, u: jax.Array, codec: Codec) -> jax.Array:
    """Unbiased stochastic rounding of float32 ``y`` onto the element grid (see module doc).

    Args:
      y: scaled float32 values (already divided by their scales).
      u: uniforms in ``[0, 1)`` shaped like ``y`` (:func:`uniform_from_bits`).
      codec: the element format (for ``int8`` the grid is the integers).

    Returns:
      float32 values on the format's grid, shaped like ``y``, not yet saturated; non-finite
      ``y`` pass through unchanged.
    """
    if codec.is_integer:  # spacing 1 everywhere
        return jnp.where(jnp.isfinite(y), jnp.sign(y) * jnp.floor(jnp.abs(y) + u), y)
    emin = max(codec.min_exponent, -126 + codec.mantissa_bits)
    e = jnp.maximum(_floor_log2(y), emin)
    ulp = _pow2(e - codec.mantissa_bits)
    mag = jnp.floor(jnp.abs(y) / ulp + u) * ulp
    return jnp.where(jnp.isfinite(y), jnp.sign(y) * mag, y)


def _round_half_even(y: jax.Array) -> jax.Array:
    """``rint(y)`` from ``floor`` alone (Pallas' Triton lowering has no ``round``): exact, as
    ``y − floor(y)`` is exact in float32."""
    r = jnp.floor(y)
    f = y - r
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return r + ((f > 0.5) | ((f == 0.5) & odd)).astype(y.dtype)


def _saturating_cast(y: jax.Array, codec: Codec) -> jax.Array:
    if codec.is_integer:  # saturate, then round half to even (a NaN becomes 0; it is never
        # seen: its group's scale is NaN)
        y = _round_half_even(jnp.clip(jnp.where(jnp.isnan(y), 0.0, y), -codec.fmax, codec.fmax))
        return y.astype(codec.element_dtype)
    return jnp.clip(y, -codec.fmax, codec.fmax).astype(codec.element_dtype)


# ---- wire layout of a row: column parts in, byte planes out ---------------------------------
#
# The packing never reshapes or interleaves lanes, so the Pallas kernels (Triton on GPU,
# Mosaic on TPU) lower it with plain loads and stores of column slices:
#   fp8 codecs  one plane of B bytes, byte j = code of element j;
#   bf16        two planes of B bytes: the low bytes of the B bit patterns, then the high bytes;
#   nvfp4       the row is read as two halves of B/2 elements; one plane of B/2 bytes,
#               byte j = code(element j) | code(element j + B/2) << 4.


def row_parts(codec: Codec) -> int:
    """Column slices a row is read as before packing (2 for 4-bit codes, else 1).

    Args:
      codec: the wire format.

    Returns:
      The number of column slices.
    """
    return 2 if codec.bits == 4 else 1


def payload_planes(codec: Codec) -> int:
    """Byte planes a row's payload is written as (2 for 16-bit elements, else 1).

    Args:
      codec: the wire format.

    Returns:
      The number of byte planes.
    """
    return 2 if codec.bits == 16 else 1


def split_columns(a: jax.Array, n: int) -> list[jax.Array]:
    """``a[..., W]`` → ``n`` equal column slices (``[a]`` for ``n == 1``).

    Args:
      a: an array whose last axis ``W`` is a multiple of ``n``.
      n: the number of slices (:func:`row_parts` or :func:`payload_planes`).

    Returns:
      The slices ``a[..., i·W/n : (i+1)·W/n]``, in order.
    """
    if n == 1:
        return [a]
    w = a.shape[-1] // n
    return [a[..., i * w : (i + 1) * w] for i in range(n)]


def join_columns(parts: list[jax.Array]) -> jax.Array:
    """Inverse of :func:`split_columns`: column slices concatenated along the last axis.

    Args:
      parts: arrays alike but for their last axis.

    Returns:
      ``parts[0]`` itself when there is one part, else their concatenation.
    """
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _e2m1_codes(q: jax.Array) -> jax.Array:
    """float4_e2m1fn values → their 4-bit codes (uint8).

    e2m1 codes 0..7 are the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 in order; bit 3 is the sign.
    Computed arithmetically so it lowers on every backend.
    """
    v = q.astype(jnp.float32)
    a = jnp.abs(v)
    code = sum((a >= t).astype(jnp.uint8) for t in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    return code | jnp.where(jnp.signbit(v) & (a > 0), jnp.uint8(8), jnp.uint8(0))


_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_values(codes: jax.Array) -> jax.Array:
    mag = jnp.zeros(codes.shape, jnp.float32)
    for c, val in enumerate(_E2M1_VALUES[1:], start=1):
        mag = jnp.where((codes & 7) == c, jnp.float32(val), mag)
    return jnp.where(codes >= 8, -mag, mag)


def encode_parts(ys: list[jax.Array], codec: Codec,
                 us: list[jax.Array] | None = None) -> list[jax.Array]:
    """Scaled float32 column parts (:func:`row_parts` of them) → uint8 byte planes.

    Args:
      ys: the column parts ``[..., B / n]``, already divided by their scales.
      codec: the wire format.
      us: uniforms in ``[0, 1)`` shaped like ``ys`` (stochastic rounding), or ``None`` (round
        to nearest).

    Returns:
      The :func:`payload_planes` byte planes: the codes ``[..., B]`` of an 8-bit codec; the low
      then the high bytes ``[..., B]`` of bf16; for nvfp4 one ``[..., B/2]`` plane, byte ``j``
      = ``code(ys[0][j]) | code(ys[1][j]) << 4``. Values beyond the format saturate.
    """
    qs = []
    for i, y in enumerate(ys):
        if us is not None:
            y = stochastic_round(y, us[i], codec)
        qs.append(_saturating_cast(y, codec))
    if codec.bits == 4:
        return [_e2m1_codes(qs[0]) | (_e2m1_codes(qs[1]) << 4)]
    if codec.bits == 16:
        bits = jax.lax.bitcast_convert_type(qs[0], jnp.uint16)
        return [(bits & 0xFF).astype(jnp.uint8), (bits >> 8).astype(jnp.uint8)]
    return [jax.lax.bitcast_convert_type(qs[0], jnp.uint8)]


def decode_planes(planes: list[jax.Array], codec: Codec) -> list[jax.Array]:
    """Inverse of :func:`encode_parts`: uint8 byte planes → unscaled float32 column parts.

    Args:
      planes: the byte planes, as :func:`encode_parts` made them.
      codec: the wire format.

    Returns:
      The :func:`row_parts` column parts of the element values (not multiplied by the scales).
    """
    if codec.bits == 4:
        return [_e2m1_values(planes[0] & 0xF), _e2m1_values(planes[0] >> 4)]
    if codec.bits == 16:
        bits = planes[0].astype(jnp.uint16) | (planes[1].astype(jnp.uint16) << 8)
        return [jax.lax.bitcast_convert_type(bits, codec.element_dtype).astype(jnp.float32)]
    return [jax.lax.bitcast_convert_type(planes[0], codec.element_dtype).astype(jnp.float32)]


def encode_elements(y: jax.Array, codec: Codec, u: jax.Array | None = None) -> jax.Array:
    """Scaled float32 ``y[..., B]`` → wire bytes ``uint8[..., B·bits/8]``.

    Args:
      y: the values, already divided by their scales (``B`` even for 4-bit codecs).
      codec: the wire format.
      u: uniforms in ``[0, 1)`` shaped like ``y`` (stochastic rounding), or ``None``.

    Returns:
      The byte planes of :func:`encode_parts` concatenated along the last axis.
    """
    n = row_parts(codec)
    us = None if u is None else split_columns(u, n)
    return join_columns(encode_parts(split_columns(y, n), codec, us))


def decode_elements(raw: jax.Array, codec: Codec) -> jax.Array:
    """Wire bytes ``uint8[..., B·bits/8]`` → unscaled float32 ``[..., B]``.

    Args:
      raw: the bytes, as :func:`encode_elements` made them.
      codec: the wire format.

    Returns:
      The element values, not multiplied by any scale.
    """
    return join_columns(decode_planes(split_columns(raw, payload_planes(codec)), codec))


def encode_row_parts(
    parts: list[jax.Array],
    codec: Codec,
    leaf_scale: jax.Array | None = None,
    rand_parts: list[jax.Array] | None = None,
):
    """:func:`encode_rows` on a row buffer given as its :func:`row_parts` column parts:
    ``(byte planes, row_scale [rows, 1] | None)``. The kernels call this on the slices they
    load; the reference calls it through :func:`encode_rows`.

    Args:
      parts: the row buffer's column parts, float32 ``[rows, B / n]`` each.
      codec: the wire format.
      leaf_scale: ``f32[rows, 1]``, the scale of the leaf each row belongs to (required when
        ``codec.has_leaf_scale``), or ``None``.
      rand_parts: uint32 random bits shaped like ``parts`` (stochastic rounding), or ``None``
        (round to nearest).

    Returns:
      ``(planes, row_scale)``: the :func:`payload_planes` uint8 byte planes and the row scales
      as they travel (see :func:`row_scales`), ``None`` for codecs without per-row scales.
    """
    wire_scale, divisor = row_scales(parts, leaf_scale, codec)
    if codec.row_scale_dtype is None and codec.has_leaf_scale is False:
        ys = parts  # bf16: no scaling at all
    else:
        # one reciprocal per row, then a multiply per element (exact for power-of-two scales;
        # within one fp32 ulp of x / s otherwise, far below the 8-bit rounding that follows).
        # A zero divisor (an NVFP4 block scale that underflowed) encodes zeros.
        inv = jnp.where(divisor == 0, jnp.float32(0.0), 1.0 / divisor)
        ys = [p * inv for p in parts]
    us = None if rand_parts is None else [uniform_from_bits(r, codec) for r in rand_parts]
    return encode_parts(ys, codec, us), wire_scale


def encode_rows(
    x: jax.Array,
    codec: Codec,
    leaf_scale: jax.Array | None = None,
    rand_bits: jax.Array | None = None,
):
    """Quantize ``x: f32[rows, B]`` → ``(payload u8[rows, row_bytes], row_scale [rows, 1] | None)``.

    Zero rows encode to zeros; NaN/Inf make the row (or leaf) decode as NaN.

    Args:
      x: the row buffer, ``B = codec.row_size``.
      codec: the wire format.
      leaf_scale: ``f32[rows, 1]``, the scale of the leaf each row belongs to (required when
        ``codec.has_leaf_scale``), or ``None``.
      rand_bits: ``u32[rows, B]`` random bits; they switch on stochastic rounding (``None``:
        round to nearest).

    Returns:
      ``(payload, row_scale)``: the wire bytes ``u8[rows, row_bytes]`` and the row scales as
      they travel (fp32, or uint8 for mxfp8 and nvfp4), ``None`` for codecs without per-row
      scales.
    """
    n = row_parts(codec)
    rand = None if rand_bits is None else split_columns(rand_bits, n)
    planes, wire_scale = encode_row_parts(split_columns(x, n), codec, leaf_scale, rand)
    return join_columns(planes), wire_scale


def decode_row_parts(
    planes: list[jax.Array],
    row_scale: jax.Array | None,
    codec: Codec,
    leaf_scale: jax.Array | None = None,
) -> list[jax.Array]:
    """Inverse of :func:`encode_row_parts`: byte planes → float32 column parts.

    Args:
      planes: the uint8 byte planes.
      row_scale: the row scales ``[rows, 1]`` as they travelled, or ``None`` for codecs
        without per-row scales.
      codec: the wire format.
      leaf_scale: ``f32[rows, 1]``, the scale of each row's leaf (per-tensor codecs and
        NVFP4), or ``None``.

    Returns:
      The :func:`row_parts` column parts of the decoded values, scales applied.
    """
    values = decode_planes(planes, codec)
    if codec.row_scale_dtype is None and not codec.has_leaf_scale:
        return values
    divisor = decode_row_scales(row_scale, leaf_scale, codec)
    return [v * divisor for v in values]


def decode_rows(
    payload: jax.Array,
    row_scale: jax.Array | None,
    codec: Codec,
    leaf_scale: jax.Array | None = None,
) -> jax.Array:
    """Inverse of :func:`encode_rows`: ``f32[rows, B]``.

    Args:
      payload: the wire bytes ``u8[rows, row_bytes]``.
      row_scale, leaf_scale: as :func:`decode_row_parts`.
      codec: the wire format.

    Returns:
      The decoded ``f32[rows, B]``, scales applied.
    """
    planes = split_columns(payload, payload_planes(codec))
    return join_columns(decode_row_parts(planes, row_scale, codec, leaf_scale))


def roundtrip(x: jax.Array, codec: str | Codec, block_size: int | None = None) -> jax.Array:
    """Local quantize→dequantize of any float array (per-tensor = one scale for all of ``x``).

    The reference semantics of one replica's contribution, handy for measurements.

    Args:
      x: a float array.
      codec: a codec name or :class:`Codec`.
      block_size: elements per scale, or ``None`` for one scale.

    Returns:
      ``x`` after quantize→dequantize: float32, in ``x``'s shape (whatever ``x``'s dtype).
    """
    codec = get_codec(codec, block_size)
    if codec.is_exact:
        return x.astype(jnp.float32)
    flat = x.astype(jnp.float32).reshape(-1)
    B = codec.row_size
    n = flat.shape[0]
    rows = -(-n // B) if n else 1
    padded = jnp.pad(flat, (0, rows * B - n)).reshape(rows, B)
    leaf = None
    if codec.has_leaf_scale:
        scale = leaf_scale_from_amax(abs_max(flat) if n else jnp.float32(0), codec)
        leaf = jnp.broadcast_to(scale, (rows, 1))
    payload, wire_scale = encode_rows(padded, codec, leaf)
    out = decode_rows(payload, wire_scale, codec, leaf).reshape(-1)[:n]
    return out.reshape(x.shape)
