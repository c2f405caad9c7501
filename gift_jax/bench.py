"""Communication benchmarks (library side of ``scripts/bench_comm.py``).

* :func:`wire_table` — bytes per device per step of the quantized all-reduce of a model's
  gradient pytree, for each codec, as a ratio to the fp32 all-reduce, read from compiled HLO
  (shapes only: nothing is allocated or run).
* :func:`quantize_throughput` — elements/s of the XLA quantize path (per-block and per-tensor
  scales) against a plain ``astype`` to the same 8-bit dtype measured in the same run.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gift_jax.codecs import get_codec, leaf_scale_from_amax
from gift_jax.collectives import quantized_psum
from gift_jax.kernels import quantize as qk
from gift_jax.wire import WireReport, wire_bytes

DEFAULT_CODECS = (("fp32", None), ("bf16", None), ("fp8_e4m3", None), ("fp8_e5m2", None),
                  ("fp8_e4m3", 128), ("mxfp8", None), ("nvfp4", None))


def allreduce_wire(shapes: dict, mesh, codec: str, block_size: int | None = None,
                   axis: str = "data") -> WireReport:
    """HLO wire report of one quantized all-reduce of gradients with these shapes."""
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
    """Best wall time of ``fn(*args)`` over ``repeats`` calls, after one warm-up call."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def quantize_throughput(num_elements: int = 1 << 24, codec: str = "fp8_e4m3",
                        block_size: int = 128, repeats: int = 5, seed: int = 0) -> dict:
    """Best-of-``repeats`` times of the XLA quantize path vs a plain cast, in the same run.

    ``cast``: ``x.astype(float8)`` (no scaling, no saturation: the floor any quantizer pays);
    ``per_block``: block absmax → scale → saturating cast → uint8 bytes + fp32 scales;
    ``per_tensor``: one absmax pass over the tensor, then scale → cast (one more read).
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
