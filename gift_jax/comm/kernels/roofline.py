"""What the kernels must move, and proof from the lowered IR that they move nothing more.

Both kernels are memory-bound element-wise passes, so their roofline is bytes: a kernel at the
roofline streams its inputs once and writes its outputs once, and its time is
``bytes / memory bandwidth``.

* :func:`traffic` — bytes read and written per element of the ``[rows, B]`` buffer, for a
  codec (quantize: the fp32 input, the leaf scale per row and, with stochastic rounding, 4
  random bytes; out the payload and the row scale. Dequantize-accumulate over ``N`` chunks:
  ``N`` payloads and their scales in, the fp32 sum out).
* :func:`memory_ops` — the loads and stores in the kernel's lowered module (Triton IR on GPU,
  Mosaic on TPU), lowered through ``jax.export`` on any host. A kernel makes one pass when
  every input block is loaded exactly once (one load per column part / byte plane / scale
  ref, per chunk) and every output block stored once. Pallas lowers ``ref[...] = v`` on Triton
  as a swap whose load has no users; Triton removes it as dead code, so only loads whose
  result is used are counted.
* :func:`collective_calls` — the kernel calls (and argument shapes) that the quantized
  all-reduce makes for a model's gradient buckets, so the lowering tests and
  ``scripts/device_check.py`` check the shapes users run.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp

from gift_jax.comm.buckets import DEFAULT_BUCKET_ELEMS, plan_buckets
from gift_jax.comm.codecs import Codec, payload_planes, row_parts
from gift_jax.comm.kernels.backend import export_kernel

S = jax.ShapeDtypeStruct


def traffic(kind: str, codec: Codec, num_chunks: int = 1,
            stochastic: bool = False) -> tuple[float, float]:
    """``(bytes read, bytes written)`` per element for one kernel call at the roofline.

    Args:
      kind: ``"quantize"`` or ``"dequantize_accumulate"``.
      codec: the wire format.
      num_chunks: the chunks ``N`` a dequantize-accumulate sums (ignored by ``quantize``).
      stochastic: quantize with stochastic rounding (4 random bytes read per element).

    Returns:
      Bytes read and written per element of the ``[rows, B]`` buffer (scales included).

    Raises:
      ValueError: another ``kind``.
    """
    scale = 0.0 if codec.row_scale_dtype is None else (
        jnp.dtype(codec.row_scale_dtype).itemsize / codec.row_size)
    leaf = 4 / codec.row_size if codec.has_leaf_scale else 0.0
    payload = codec.bits / 8
    if kind == "quantize":
        return 4 + leaf + (4 if stochastic else 0), payload + scale
    if kind == "dequantize_accumulate":
        return num_chunks * (payload + scale + leaf), 4.0
    raise ValueError(f"kind={kind!r}; allowed values: ('quantize', 'dequantize_accumulate')")


def expected_memory_ops(kind: str, codec: Codec, args) -> tuple[int, int]:
    """``(loads, stores)`` a one-pass kernel issues for arguments ``args``.

    Args:
      kind: ``"quantize"``; any other value is read as ``"dequantize_accumulate"``.
      codec: the wire format.
      args: the kernel's positional arguments (arrays or ``jax.ShapeDtypeStruct`` s, ``None``
        for absent ones): ``(x, leaf_scale, rand_bits)`` or ``(payload, row_scale,
        leaf_scale)``.

    Returns:
      Quantize: one load per column part (twice with random bits) plus one for the leaf
      scale, one store per byte plane plus one for the row scale. Dequantize-accumulate: per
      chunk one load per byte plane and scale, one store per column part.
    """
    if kind == "quantize":
        x, leaf, rand = args
        loads = row_parts(codec) * (1 + (rand is not None)) + (leaf is not None)
        return loads, payload_planes(codec) + (codec.row_scale_dtype is not None)
    payload, row, leaf = args
    per_chunk = payload_planes(codec) + (row is not None) + (leaf is not None)
    return payload.shape[0] * per_chunk, row_parts(codec)


_MODULE_HEADER = re.compile(r"^The (Triton|Mosaic) module for pallas_call", re.M)
_LOAD = re.compile(r"^\s*(%[\w#]+) = (?:tt\.load|vector\.load|tpu\.vector_load)\b", re.M)
_STORE = re.compile(r"^\s*(?:tt\.store|vector\.store|tpu\.vector_store)\b", re.M)


def count_memory_ops(module_text: str) -> tuple[int, int]:
    """``(used loads, stores)`` in one lowered kernel module's text.

    Args:
      module_text: one Triton or Mosaic module, as Pallas prints it with ``debug=True``.

    Returns:
      The loads whose result is used at least once, and the stores.
    """
    loads = 0
    for name in _LOAD.findall(module_text):
        uses = re.findall(re.escape(name) + r"(?![\w#])", module_text)
        loads += len(uses) > 1  # the definition plus at least one use
    return loads, len(_STORE.findall(module_text))


def memory_ops(kind: str, codec: Codec, args, platform: str) -> tuple[int, int]:
    """``(used loads, stores)`` of kernel ``kind`` lowered for ``platform`` on ``args``.

    Args:
      kind: ``"quantize"`` or ``"dequantize_accumulate"``.
      codec: the wire format.
      args: the kernel's abstract arguments, as :func:`~gift_jax.comm.kernels.backend.export_kernel`
        takes them.
      platform: ``"gpu"`` or ``"tpu"``.

    Returns:
      :func:`count_memory_ops` of the lowered module.

    Raises:
      RuntimeError: the lowering printed no or several kernel modules.
    """
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        export_kernel(kind, codec, args, platform, debug=True)
    text = text.getvalue()
    starts = [m.start() for m in _MODULE_HEADER.finditer(text)]
    if len(starts) != 1:
        raise RuntimeError(f"expected one lowered kernel module, found {len(starts)}")
    module = text[starts[0]:]
    end = module.find("\nThe kernel jaxpr")
    return count_memory_ops(module if end < 0 else module[:end])


def collective_calls(shapes, codec: Codec, num_shards: int,
                     bucket_elems: int = DEFAULT_BUCKET_ELEMS) -> list[tuple[str, tuple]]:
    """``(kernel, abstract args)`` of one quantized all-reduce of leaves ``shapes`` over
    ``num_shards`` replicas, for its smallest and its largest bucket: per bucket of ``R``
    rows, the reduce-scatter quantizes ``[R, B]`` and sums ``num_shards`` chunks of
    ``R/num_shards`` rows; the all-gather quantizes the shard and decodes the gathered
    ``[1, R, bytes]`` (error feedback decodes the same shapes).

    Args:
      shapes: the gradient leaves' shapes (all of them in ``codec``).
      codec: the wire format.
      num_shards: the replicas the reduction splits over.
      bucket_elems: the bucket capacity, as :func:`gift_jax.allreduce`'s.

    Returns:
      ``(kernel name, args)`` without repeats, ``args`` the kernel's positional arguments as
      ``jax.ShapeDtypeStruct`` s (``None`` for absent scales and random bits).
    """
    buckets = plan_buckets([tuple(s) for s in shapes], [codec] * len(shapes), num_shards,
                           bucket_elems)
    B, nbytes = codec.row_size, codec.row_bytes
    calls = {}
    sizes = sorted({b.rows for b in buckets})
    for rows in dict.fromkeys((sizes[0], sizes[-1])):
        rs = rows // num_shards
        for r in (rows, rs):
            leaf = S((r, 1), jnp.float32) if codec.has_leaf_scale else None
            calls[("quantize", r)] = (S((r, B), jnp.float32), leaf, None)
        for n, r in ((num_shards, rs), (1, rows)):
            row = S((n, r, 1), codec.row_scale_dtype) if codec.row_scale_dtype else None
            leaf = S((n, r, 1), jnp.float32) if codec.has_leaf_scale else None
            calls[("dequantize_accumulate", n, r)] = (S((n, r, nbytes), jnp.uint8), row, leaf)
    return [(key[0], args) for key, args in calls.items()]


def roofline_rows(codecs, num_chunks: int = 8, rows: int = 4096,
                  platforms=("gpu", "tpu")) -> list[dict]:
    """Per codec and kernel: bytes read/written per element at the roofline, and per platform
    the loads/stores of the lowered kernel against a one-pass kernel's (``rows`` rows; the
    dequantize-accumulate sums ``num_chunks`` chunks), or why it does not lower.

    Args:
      codecs: the :class:`~gift_jax.comm.codecs.Codec` s to report on.
      num_chunks: the chunks the dequantize-accumulate sums.
      rows: rows of the ``[rows, B]`` buffer.
      platforms: the kernel platforms to lower for.

    Returns:
      One dict per codec and kernel: ``kernel``, ``codec``, ``block_size``, ``chunks``,
      ``read_B_per_elem``, ``written_B_per_elem``, ``one_pass_loads_stores``, and per platform
      ``"<n> loads, <m> stores (one pass)"`` (or ``(NOT one pass)``, or ``"does not lower:
      ..."``).
    """
    out = []
    for codec in codecs:
        B, nbytes = codec.row_size, codec.row_bytes
        leaf = S((rows, 1), jnp.float32) if codec.has_leaf_scale else None
        n_leaf = S((num_chunks, rows, 1), jnp.float32) if codec.has_leaf_scale else None
        n_row = (S((num_chunks, rows, 1), codec.row_scale_dtype)
                 if codec.row_scale_dtype is not None else None)
        calls = {"quantize": (S((rows, B), jnp.float32), leaf, None),
                 "dequantize_accumulate": (S((num_chunks, rows, nbytes), jnp.uint8), n_row,
                                           n_leaf)}
        for kind, args in calls.items():
            read, written = traffic(kind, codec, num_chunks)
            row = {"kernel": kind, "codec": codec.name, "block_size": codec.block_size,
                   "chunks": num_chunks if kind == "dequantize_accumulate" else None,
                   "read_B_per_elem": read, "written_B_per_elem": written,
                   "one_pass_loads_stores": expected_memory_ops(kind, codec, args)}
            for platform in platforms:
                try:
                    ops = memory_ops(kind, codec, args, platform)
                except Exception as e:  # report what does not lower, check the rest
                    row[platform] = f"does not lower: {type(e).__name__}: {e}"[:200]
                    continue
                one_pass = ops == row["one_pass_loads_stores"]
                row[platform] = f"{ops[0]} loads, {ops[1]} stores" + (
                    " (one pass)" if one_pass else " (NOT one pass)")
            out.append(row)
    return out
