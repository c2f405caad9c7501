"""Pallas kernels of the quantized all-reduce's hot path, each beside its jnp reference.

* :func:`quantize` — fused ``block absmax → scale → (stochastic) round → saturating cast →
  uint8 bytes + row scales`` over a ``[rows, B]`` buffer.
* :func:`dequantize_accumulate` — ``N`` received chunks ``[N, rows, bytes]`` → their fp32 sum,
  added in the fixed order ``0, 1, …, N−1`` so that every backend and every replica produces the
  same bits.

The kernel bodies call the same pure element functions as the references
(:func:`gift_jax.codecs.encode_rows` / :func:`~gift_jax.codecs.decode_rows`), so a kernel and its
reference can only differ through lowering, which the tests check bit for bit (on CPU with
``interpret=True``; compiled on GPU/TPU).

Backends: ``"xla"`` runs the reference (XLA fuses it well on every platform), ``"pallas"`` runs
the kernel (interpreted on CPU), ``"auto"`` picks Pallas on GPU/TPU and XLA on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gift_jax.codecs import Codec, decode_rows, encode_rows

BACKENDS = ("auto", "xla", "pallas")
#: Rows per kernel tile (the wrappers pad ``rows`` up to a multiple of it).
DEFAULT_BLOCK_ROWS = 256


def resolve_backend(backend: str) -> str:
    """``"xla"`` or ``"pallas"`` for a user setting (validated)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed values: {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    return backend


def _interpret() -> bool:
    return jax.default_backend() not in ("gpu", "tpu")


def _tile_rows(rows: int, block_rows: int) -> int:
    return max(1, min(block_rows, rows))


def _out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """An output spec that varies over the same mesh axes as ``like`` (inside shard_map with
    ``check_vma=True`` Pallas needs to be told)."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def _pad_rows(a: jax.Array | None, rows: int, axis: int = 0):
    if a is None or a.shape[axis] == rows:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, rows - a.shape[axis])
    return jnp.pad(a, pad)


# ---- quantize ------------------------------------------------------------------------------


def quantize_reference(x, codec: Codec, leaf_scale=None, rand_bits=None):
    """``x: f32[rows, B]`` → ``(payload u8[rows, row_bytes], row_scale [rows, 1] | None)``."""
    return encode_rows(x, codec, leaf_scale, rand_bits)


@functools.partial(jax.jit, static_argnames=("codec", "block_rows", "interpret"))
def quantize_pallas(x, leaf_scale, rand_bits, *, codec: Codec, block_rows: int, interpret: bool):
    """Pallas version of :func:`quantize_reference` (same arguments; ``None`` allowed)."""
    rows, B = x.shape
    tr = _tile_rows(rows, block_rows)
    padded = -(-rows // tr) * tr
    inputs = [_pad_rows(x, padded)]
    specs = [pl.BlockSpec((tr, B), lambda i: (i, 0))]
    if leaf_scale is not None:
        inputs.append(_pad_rows(leaf_scale, padded))
        specs.append(pl.BlockSpec((tr, 1), lambda i: (i, 0)))
    if rand_bits is not None:
        inputs.append(_pad_rows(rand_bits, padded))
        specs.append(pl.BlockSpec((tr, B), lambda i: (i, 0)))
    has_leaf, has_rand = leaf_scale is not None, rand_bits is not None
    scale_dtype = codec.row_scale_dtype

    def kernel(*refs):
        it = iter(refs)
        x_t = next(it)[...]
        leaf_t = next(it)[...] if has_leaf else None
        rand_t = next(it)[...] if has_rand else None
        payload_ref = next(it)
        payload, scale = encode_rows(x_t, codec, leaf_t, rand_t)
        payload_ref[...] = payload
        if scale_dtype is not None:
            next(it)[...] = scale

    out_shape = [_out_struct((padded, codec.row_bytes), jnp.uint8, x)]
    out_specs = [pl.BlockSpec((tr, codec.row_bytes), lambda i: (i, 0))]
    if scale_dtype is not None:
        out_shape.append(_out_struct((padded, 1), scale_dtype, x))
        out_specs.append(pl.BlockSpec((tr, 1), lambda i: (i, 0)))
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(padded // tr,),
        in_specs=specs,
        out_specs=tuple(out_specs),
        interpret=interpret,
    )(*inputs)
    payload = outs[0][:rows]
    scale = outs[1][:rows] if scale_dtype is not None else None
    return payload, scale


def quantize(x, codec: Codec, leaf_scale=None, rand_bits=None, *, backend: str = "auto",
             block_rows: int = DEFAULT_BLOCK_ROWS):
    """Quantize ``x: f32[rows, B]`` with the chosen backend (see module docstring)."""
    if resolve_backend(backend) == "xla":
        return quantize_reference(x, codec, leaf_scale, rand_bits)
    return quantize_pallas(x, leaf_scale, rand_bits, codec=codec, block_rows=block_rows,
                           interpret=_interpret())


# ---- dequantize and accumulate -------------------------------------------------------------


def dequantize_accumulate_reference(payload, codec: Codec, row_scale=None, leaf_scale=None):
    """``Σ_n decode(payload[n])`` in fp32, summed in order ``n = 0 … N−1``.

    ``payload: u8[N, rows, row_bytes]``, ``row_scale: [N, rows, 1] | None``,
    ``leaf_scale: f32[N, rows, 1] | None`` → ``f32[rows, B]``.
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


@functools.partial(jax.jit, static_argnames=("codec", "block_rows", "interpret"))
def dequantize_accumulate_pallas(payload, row_scale, leaf_scale, *, codec: Codec,
                                 block_rows: int, interpret: bool):
    """Pallas version of :func:`dequantize_accumulate_reference`."""
    N, rows, nbytes = payload.shape
    B = codec.row_size
    tr = _tile_rows(rows, block_rows)
    padded = -(-rows // tr) * tr
    inputs = [_pad_rows(payload, padded, axis=1)]
    specs = [pl.BlockSpec((N, tr, nbytes), lambda i: (0, i, 0))]
    for extra in (row_scale, leaf_scale):
        if extra is not None:
            inputs.append(_pad_rows(extra, padded, axis=1))
            specs.append(pl.BlockSpec((N, tr, 1), lambda i: (0, i, 0)))
    has_row, has_leaf = row_scale is not None, leaf_scale is not None

    def kernel(*refs):
        it = iter(refs)
        p_t = next(it)[...]
        r_t = next(it)[...] if has_row else None
        l_t = next(it)[...] if has_leaf else None
        out_ref = next(it)
        out_ref[...] = dequantize_accumulate_reference(p_t, codec, r_t, l_t)

    out = pl.pallas_call(
        kernel,
        out_shape=_out_struct((padded, B), jnp.float32, payload),
        grid=(padded // tr,),
        in_specs=specs,
        out_specs=pl.BlockSpec((tr, B), lambda i: (i, 0)),
        interpret=interpret,
    )(*inputs)
    return out[:rows]


def dequantize_accumulate(payload, codec: Codec, row_scale=None, leaf_scale=None, *,
                          backend: str = "auto", block_rows: int = DEFAULT_BLOCK_ROWS):
    """Sum of ``N`` received chunks in fp32 with the chosen backend."""
    if resolve_backend(backend) == "xla":
        return dequantize_accumulate_reference(payload, codec, row_scale, leaf_scale)
    return dequantize_accumulate_pallas(payload, row_scale, leaf_scale, codec=codec,
                                        block_rows=block_rows, interpret=_interpret())
