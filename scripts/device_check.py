"""The quantize hot path, kernel by kernel: roofline statement, lowering proof, device check.

1. Roofline (any host): bytes read and written per element by each kernel and codec, and the
   loads/stores of each kernel lowered for GPU (Triton) and TPU (Mosaic) through jax.export,
   against those of a one-pass kernel.
2. On a GPU/TPU: each kernel compiled for real, bit-equality with its XLA reference, and
   throughput of the Pallas and XLA paths (GB/s by the roofline's bytes, and as a fraction of
   ``--hbm_GBps``; goal ≥ 0.8 on H200). On CPU the kernels run in the Pallas interpreter, so
   only the bit-equality means something there (use a small ``--elements``).

    python scripts/device_check.py --out $OUT/device_check.json              # on a device
    python scripts/device_check.py --elements 65536 --repeats 1 --out /tmp/dc.json   # CPU
"""

import argparse
import json
import pathlib

import jax

from gift_jax.apps.bench import kernel_check
from gift_jax.comm import codecs as C
from gift_jax.comm.kernels.roofline import roofline_rows

CASES = (("bf16", None), ("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3", 128),
         ("mxfp8", None), ("nvfp4", None))


def _table(rows, columns) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 26)
    ap.add_argument("--chunks", type=int, default=8, help="replicas summed per shard")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--hbm_GBps", type=float, default=4800.0,
                    help="memory bandwidth for the fraction column (H200: 4800)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    print(f"backend {jax.default_backend()}, devices {jax.devices()}")

    codecs = [C.get_codec(n, b) for n, b in CASES]
    roofline = roofline_rows(codecs, num_chunks=args.chunks)
    print("\nRoofline and lowering (loads/stores in the lowered kernel vs a one-pass kernel):")
    print(_table(roofline, ["kernel", "codec", "block_size", "read_B_per_elem",
                            "written_B_per_elem", "one_pass_loads_stores", "gpu", "tpu"]))

    on_device = jax.default_backend() in ("gpu", "tpu")
    checks = []
    for name, block in CASES:
        try:
            r = kernel_check(name, block, elements=args.elements, num_chunks=args.chunks,
                             repeats=args.repeats,
                             hbm_GBps=args.hbm_GBps if on_device else None)
        except Exception as e:  # report what failed, keep checking the rest
            r = {"codec": name, "block_size": block, "error": f"{type(e).__name__}: {e}"[:500]}
        checks.append(r)
        print(json.dumps(r))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps({"roofline": roofline, "device": checks},
                                                     indent=2))
    return roofline, checks


if __name__ == "__main__":
    main()
