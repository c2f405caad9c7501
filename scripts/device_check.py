"""Accelerator check of the quantize hot path: compiled Pallas kernels against their jnp
references (bit for bit), and throughput of the Pallas and XLA paths against a plain cast,
as a fraction of the device's memory bandwidth.

    python scripts/device_check.py --out $OUT/device_check.json          # on a GPU/TPU
    python scripts/device_check.py --elements 65536 --repeats 1          # CPU smoke (interpret)

On CPU the kernels run in interpret mode, so the figures say nothing about speed there.
"""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from gift_jax import codecs as C
from gift_jax.bench import best_time
from gift_jax.kernels import quantize as qk

CASES = (("bf16", None), ("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3", 128),
         ("mxfp8", None), ("nvfp4", None))


def check_case(name, block, elements, repeats, interpret):
    codec = C.get_codec(name, block)
    rows = elements // codec.row_size
    x = jax.random.normal(jax.random.key(0), (rows, codec.row_size)) * 3.0
    leaf = None
    if codec.has_leaf_scale:
        leaf = jnp.broadcast_to(C.leaf_scale_from_amax(jnp.max(jnp.abs(x)), codec), (rows, 1))
    ref = jax.jit(qk.quantize_reference, static_argnums=1)(x, codec, leaf)
    kernel = jax.jit(lambda a, s: qk.quantize_pallas(a, s, None, codec=codec,
                                                     block_rows=qk.DEFAULT_BLOCK_ROWS,
                                                     interpret=interpret))
    ker = kernel(x, leaf)
    equal = bool(np.array_equal(np.asarray(ker[0]), np.asarray(ref[0])))
    if ref[1] is not None:
        equal &= bool(np.array_equal(np.asarray(ker[1]).view(np.uint8),
                                     np.asarray(ref[1]).view(np.uint8)))
    chunks = jnp.stack([ref[0]] * 8)
    row = None if ref[1] is None else jnp.stack([ref[1]] * 8)
    lrows = None if leaf is None else jnp.stack([leaf] * 8)
    acc_ref = jax.jit(qk.dequantize_accumulate_reference, static_argnums=1)(chunks, codec, row,
                                                                            lrows)
    acc_fn = jax.jit(lambda p, r, s: qk.dequantize_accumulate_pallas(
        p, r, s, codec=codec, block_rows=qk.DEFAULT_BLOCK_ROWS, interpret=interpret))
    acc = acc_fn(chunks, row, lrows)
    acc_equal = bool(np.array_equal(np.asarray(acc), np.asarray(acc_ref)))
    acc_maxdiff = float(jnp.max(jnp.abs(acc - acc_ref)))
    dtype = codec.element_dtype
    cast = jax.jit(lambda a: a.astype(dtype))
    t_cast = best_time(cast, x, repeats=repeats)
    t_xla = best_time(jax.jit(lambda a, s: qk.quantize_reference(a, codec, s)), x, leaf,
                  repeats=repeats)
    t_pallas = best_time(kernel, x, leaf, repeats=repeats)
    nbytes = 4 * x.size
    return {"codec": name, "block_size": block, "quantize_bitwise_equal": equal,
            "accumulate_bitwise_equal": acc_equal, "accumulate_max_abs_diff": acc_maxdiff,
            "cast_ms": t_cast * 1e3, "xla_ms": t_xla * 1e3, "pallas_ms": t_pallas * 1e3,
            "xla_over_cast": t_xla / t_cast, "pallas_over_cast": t_pallas / t_cast,
            "pallas_GBps": nbytes / t_pallas / 1e9, "xla_GBps": nbytes / t_xla / 1e9}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 26)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hbm_GBps", type=float, default=4800.0,
                    help="nominal memory bandwidth for the fraction column (H200: 4800)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    interpret = jax.default_backend() not in ("gpu", "tpu")
    print(f"backend {jax.default_backend()}, devices {jax.devices()}, interpret={interpret}")
    results = []
    for name, block in CASES:
        try:
            r = check_case(name, block, args.elements, args.repeats, interpret)
        except Exception as e:  # report what failed to lower, keep checking the rest
            r = {"codec": name, "block_size": block, "error": f"{type(e).__name__}: {e}"[:500]}
        if "pallas_GBps" in r:
            r["pallas_fraction_of_hbm"] = r["pallas_GBps"] * 1.25 / args.hbm_GBps  # r+w bytes
        results.append(r)
        print(json.dumps(r))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
