"""Benchmark the quantized all-reduce: HLO wire bytes for the papers' model sizes and the
quantize throughput against a plain cast.

    python scripts/bench_comm.py                       # both GIFT models, 8 simulated devices
    python scripts/bench_comm.py --models tiny --elements 4194304 --json runs/bench.json
"""

import argparse
import json
import pathlib

from gift_jax.utils.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)  # a data-parallel mesh on a CPU host (an XLA_FLAGS count wins)

import jax  # noqa: E402
import ml_collections  # noqa: E402, F401  (configs use it)

from gift_jax.apps.bench import quantize_throughput, wire_table  # noqa: E402
from gift_jax.models import count_params, model_config_of, param_shapes  # noqa: E402
from gift_jax.training.config import load_config  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def model_config(name: str):
    cfg = load_config(name, CONFIGS)
    return model_config_of(cfg.model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gift_llama_300m,gift_llama_600m",
                    help="comma-separated config names under configs/")
    ap.add_argument("--elements", type=int, default=1 << 24,
                    help="array size of the throughput measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("data",))
    results = {"platform": jax.default_backend(), "devices": len(devices), "wire": {}}
    print(f"platform {results['platform']}, {len(devices)} devices on the 'data' axis\n")
    for name in args.models.split(","):
        cfg = model_config(name)
        shapes = param_shapes(cfg)
        rows = wire_table(shapes, mesh)
        results["wire"][name] = rows
        print(f"## {name} ({count_params(cfg):,} parameters): all-reduce bytes per device "
              "per step, from compiled HLO")
        print("| codec | block | MB/device/step | ratio to fp32 | ideal | ratio/ideal |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['codec']} | {r['block_size'] or 'tensor'} | "
                  f"{r['bytes_per_device'] / 1e6:.1f} | {r['ratio_to_fp32']:.4f} | "
                  f"{r['ideal_ratio']:.4f} | {r['over_ideal']:.4f} |")
        print()
    tp = quantize_throughput(args.elements, repeats=args.repeats)
    results["throughput"] = tp
    print(f"## quantize throughput, XLA path, {tp['elements']:,} fp32 elements "
          f"({tp['platform']})")
    print("| path | time (ms) | GB/s of fp32 read | ratio to plain cast |")
    print("|---|---|---|---|")
    for key, label in (("cast", "plain astype(float8_e4m3fn)"),
                       ("per_block", f"per-block scales ({tp['block_size']})"),
                       ("per_tensor", "per-tensor scale (amax pass + quantize)")):
        ratio = tp[f"{key}_s"] / tp["cast_s"]
        print(f"| {label} | {tp[f'{key}_s'] * 1e3:.2f} | {tp[f'{key}_GBps']:.2f} | "
              f"{ratio:.2f} |")
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
