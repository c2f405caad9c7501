"""Communication benchmarks (library side of ``scripts/bench_comm.py``).

* :func:`wire_table` — bytes per device per step of the quantized all-reduce of a model's
  gradient pytree, for each codec, as a ratio to the fp32 all-reduce, read from compiled HLO
  (shapes only: nothing is allocated or run).
* :func:`quantize_throughput` — elements/s of the XLA quantize path (per-block and per-tensor
  scales) against a plain ``astype`` to the same 8-bit dtype measured in the same run.
* :func:`kernel_check` — the Pallas kernels compiled for the device at hand (interpreted on
  CPU): bit-equality with their references, and throughput against the XLA path, a plain
  cast and the device's memory bandwidth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gift_jax.comm.codecs import get_codec, leaf_scale_from_amax
from gift_jax.comm.collectives import quantized_psum
from gift_jax.comm.kernels import backend as qk
from gift_jax.comm.kernels import quantize as kq
from gift_jax.comm.kernels.roofline import traffic
from gift_jax.comm.wire import WireReport, wire_bytes
from gift_jax.utils.timing import interleaved_times

DEFAULT_CODECS = (("fp32", None), ("bf16", None), ("fp8_e4m3", None), ("fp8_e5m2", None),
                  ("fp8_e4m3", 128), ("mxfp8", None), ("nvfp4", None))


def allreduce_wire(shapes: dict, mesh, codec: str, block_size: int | None = None,
                   axis: str = "data") -> WireReport:
    """HLO wire report of one quantized all-reduce of gradients with these shapes.

    The reduction is :func:`~gift_jax.comm.collectives.quantized_psum` (``mean=True``) inside
    ``jax.shard_map``, lowered and compiled for fp32 gradients but never run.

    Args:
      shapes: a pytree of the per-device gradient leaves, anything with ``.shape`` (e.g.
        ``jax.ShapeDtypeStruct`` from :func:`gift_jax.models.param_shapes`); dtypes are
        ignored (fp32).
      mesh: the device mesh; it must have the axis ``axis``.
      codec: a codec name (:data:`gift_jax.comm.codecs.CODEC_NAMES`), e.g. ``"fp8_e4m3"``.
      block_size: elements per fp32 scale for block-scaled codecs; ``None``: one scale per
        tensor (``mxfp8``/``nvfp4``: their fixed blocks).
      axis: the mesh axis the gradients are reduced over.

    Returns:
      The :class:`~gift_jax.comm.wire.WireReport` of the compiled function (``.total``: bytes
      per device).
    """
    n = mesh.shape[axis]

    def body(tree):
        local = jax.tree.map(lambda x: x[0], tree)
        out = quantized_psum(local, axis, codec=codec, block_size=block_size, mean=True)
        return jax.tree.map(lambda x: x[None], out)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))
    args = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((n, *s.shape), jnp.float32,
                                       sharding=NamedSharding(mesh, P(axis))),
        shapes)
    return wire_bytes(f, args)


def wire_table(shapes: dict, mesh, codecs=DEFAULT_CODECS) -> list[dict]:
    """One row per codec: bytes/device/step, ratio to fp32, the ideal ratio, and their quotient.

    The ideal ratio counts element bits and per-row scales; the measured one also includes
    per-leaf scales and the padding of leaves to whole rows and of buckets to whole shards.

    Args:
      shapes: the per-device gradient shapes, as for :func:`allreduce_wire`.
      mesh: a mesh with a ``data`` axis (the axis reduced over).
      codecs: ``(codec name, block_size)`` pairs, one row each; ``"fp32"`` rows reuse the
        baseline.

    Returns:
      One dict per codec with ``codec``, ``block_size``, ``bytes_per_device`` (per step),
      ``ratio_to_fp32``, ``ideal_ratio`` (:attr:`~gift_jax.comm.codecs.Codec.ideal_ratio`)
      and ``over_ideal`` (measured / ideal ratio).
    """
    base = allreduce_wire(shapes, mesh, "fp32").total
    rows = []
    for name, block in codecs:
        report = base if name == "fp32" else allreduce_wire(shapes, mesh, name, block).total
        codec = get_codec(name, block)
        ratio = report / base
        rows.append({"codec": name, "block_size": block, "bytes_per_device": report,
                     "ratio_to_fp32": ratio, "ideal_ratio": codec.ideal_ratio,
                     "over_ideal": ratio / codec.ideal_ratio})
    return rows


def best_time(fn, *args, repeats: int) -> float:
    """Best wall time of ``fn(*args)`` over ``repeats`` blocked calls, after one warm-up.

    Args:
      fn: the callable to time (usually jitted).
      *args: its arguments, the same on every call.
      repeats: timed calls (at least 1).

    Returns:
      The fastest call's wall-clock seconds.
    """
    return min(interleaved_times({"case": lambda: fn(*args)}, repeats)["case"])


def quantize_throughput(num_elements: int = 1 << 24, codec: str = "fp8_e4m3",
                        block_size: int = 128, repeats: int = 5, seed: int = 0) -> dict:
    """Best-of-``repeats`` times of the XLA quantize path vs a plain cast, in the same run.

    ``cast``: ``x.astype(float8)`` (no scaling, no saturation: the floor any quantizer pays);
    ``per_block``: block absmax → scale → saturating cast → uint8 bytes + fp32 scales;
    ``per_tensor``: one absmax pass over the tensor, then scale → cast (one more read).

    Args:
      num_elements: length of the fp32 input (standard normal); a multiple of
        ``block_size`` and of :data:`~gift_jax.comm.codecs.DEFAULT_ROW_SIZE` (128).
      codec: an 8-bit codec name that takes ``block_size`` (e.g. ``"fp8_e4m3"``,
        ``"fp8_e5m2"``).
      block_size: elements per scale of the ``per_block`` path.
      repeats: timed calls per path (best of).
      seed: PRNG seed of the input.

    Returns:
      A dict: ``platform``, ``elements``, ``codec``, ``block_size``; seconds ``cast_s``,
      ``per_block_s``, ``per_tensor_s``; ``per_block_over_cast`` and ``per_tensor_over_cast``
      (time ratios); and ``cast_GBps``, ``per_block_GBps``, ``per_tensor_GBps`` (GB/s of fp32
      read).
    """
    blocked = get_codec(codec, block_size)
    tensor = get_codec(codec)
    x = jax.random.normal(jax.random.key(seed), (num_elements,), jnp.float32)
    dtype = blocked.element_dtype
    cast = jax.jit(lambda v: jax.lax.bitcast_convert_type(v.astype(dtype), jnp.uint8))

    @jax.jit
    def per_block(v):
        return qk.quantize(v.reshape(-1, blocked.row_size), blocked, backend="xla")

    @jax.jit
    def per_tensor(v):
        rows = v.reshape(-1, tensor.row_size)
        scale = leaf_scale_from_amax(jnp.max(jnp.abs(v)), tensor)
        return qk.quantize(rows, tensor, jnp.broadcast_to(scale, (rows.shape[0], 1)),
                           backend="xla")[0]

    t_cast = best_time(cast, x, repeats=repeats)
    t_block = best_time(per_block, x, repeats=repeats)
    t_tensor = best_time(per_tensor, x, repeats=repeats)
    gbs = lambda t: 4 * num_elements / t / 1e9  # fp32 bytes read per second
    return {
        "platform": jax.default_backend(), "elements": num_elements, "codec": codec,
        "block_size": block_size,
        "cast_s": t_cast, "per_block_s": t_block, "per_tensor_s": t_tensor,
        "per_block_over_cast": t_block / t_cast, "per_tensor_over_cast": t_tensor / t_cast,
        "cast_GBps": gbs(t_cast), "per_block_GBps": gbs(t_block),
        "per_tensor_GBps": gbs(t_tensor),
    }


def _bits_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def kernel_check(name: str, block_size: int | None = None, elements: int = 1 << 26,
                 num_chunks: int = 8, repeats: int = 10, hbm_GBps: float | None = None,
                 seed: int = 0) -> dict:
    """Both kernels of one codec on the default device against their XLA references.

    Bit-equality: quantize (round to nearest and stochastic) must match bit for bit; the fp32
    sum of dequantize-accumulate may differ in the last bit where one compiler contracts
    ``decode × scale + sum`` into an FMA and the other does not (reported as a max
    difference). Throughput: bytes per :func:`gift_jax.comm.kernels.roofline.traffic` over the best
    time, and, with ``hbm_GBps``, as a fraction of that bandwidth.

    Args:
      name: the codec name (:data:`gift_jax.comm.codecs.CODEC_NAMES`).
      block_size: elements per fp32 scale; ``None``: one scale per tensor (``mxfp8``/
        ``nvfp4``: their fixed blocks).
      elements: input size, rounded down to whole rows of the codec; the rows get
        log-normally spread magnitudes.
      num_chunks: stacked copies of the quantized input that dequantize-accumulate sums (the
        replicas summed per shard).
      repeats: timed calls per kernel (best of).
      hbm_GBps: the device's memory bandwidth in GB/s; ``None`` (or 0): no
        ``*_fraction_of_hbm`` entries.
      seed: PRNG seed of the input and of the stochastic-rounding bits.

    Returns:
      A dict: ``codec``, ``block_size``, ``platform``, ``elements``, ``chunks``; the bit
      checks ``quantize_bitwise_equal``, ``quantize_stochastic_bitwise_equal``,
      ``accumulate_bitwise_equal`` and ``accumulate_max_rel_diff`` (max abs difference over
      max abs reference); per timed case (``cast``, ``quantize_pallas``, ``quantize_xla``,
      ``accumulate_pallas``, ``accumulate_xla``) ``<case>_ms``, and except ``cast``
      ``<case>_GBps`` (and ``<case>_fraction_of_hbm``); ``quantize_pallas_over_xla`` and
      ``accumulate_pallas_over_xla`` (time ratios).
    """
    platform = qk.device_platform()
    codec = get_codec(name, block_size)
    rows = elements // codec.row_size
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (rows, codec.row_size)) * jnp.exp(
        2 * jax.random.normal(k2, (rows, 1)))
    leaf = None
    if codec.has_leaf_scale:
        leaf = jnp.broadcast_to(leaf_scale_from_amax(jnp.max(jnp.abs(x)), codec), (rows, 1))
    bits = jax.random.bits(k3, x.shape, jnp.uint32)
    quant = jax.jit(lambda a, s, r: kq.quantize_pallas(a, s, r, codec=codec, platform=platform))
    ref_q = jax.jit(lambda a, s, r: kq.quantize_reference(a, codec, s, r))
    out = {"codec": name, "block_size": block_size, "platform": platform, "elements": rows *
           codec.row_size, "chunks": num_chunks}
    for key, r in (("quantize_bitwise_equal", None), ("quantize_stochastic_bitwise_equal", bits)):
        out[key] = all(_bits_equal(a, b) for a, b in
                       zip(quant(x, leaf, r), ref_q(x, leaf, r), strict=True))
    payload, row_scale = ref_q(x, leaf, None)
    stack = lambda a: None if a is None else jnp.stack([a] * num_chunks)
    chunks = (stack(payload), stack(row_scale), stack(leaf))
    acc = jax.jit(lambda p, r, s: kq.dequantize_accumulate_pallas(p, r, s, codec=codec,
                                                                 platform=platform))
    ref_acc = jax.jit(lambda p, r, s: kq.dequantize_accumulate_reference(p, codec, r, s))
    a, b = acc(*chunks), ref_acc(*chunks)
    out["accumulate_bitwise_equal"] = _bits_equal(a, b)
    out["accumulate_max_rel_diff"] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    cast = jax.jit(lambda v: v.astype(codec.element_dtype))
    times = {
        "cast": best_time(cast, x, repeats=repeats),
        "quantize_pallas": best_time(quant, x, leaf, None, repeats=repeats),
        "quantize_xla": best_time(ref_q, x, leaf, None, repeats=repeats),
        "accumulate_pallas": best_time(acc, *chunks, repeats=repeats),
        "accumulate_xla": best_time(ref_acc, *chunks, repeats=repeats),
    }
    n = rows * codec.row_size
    moved = {"quantize": sum(traffic("quantize", codec)) * n,
             "accumulate": sum(traffic("dequantize_accumulate", codec, num_chunks)) * n}
    for key, t in times.items():
        out[f"{key}_ms"] = t * 1e3
        if key != "cast":
            gbs = moved[key.split("_")[0]] / t / 1e9
            out[f"{key}_GBps"] = gbs
            if hbm_GBps:
                out[f"{key}_fraction_of_hbm"] = gbs / hbm_GBps
    out["quantize_pallas_over_xla"] = times["quantize_pallas"] / times["quantize_xla"]
    out["accumulate_pallas_over_xla"] = times["accumulate_pallas"] / times["accumulate_xla"]
    return out
