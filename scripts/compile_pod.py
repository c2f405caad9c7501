"""Compile (never run) the train step of a large config on a simulated pod mesh: per-device
memory and per-step bytes across the data axis, in every communication mode.

    python scripts/compile_pod.py --config llama_1b --mesh 8,8,1 --mesh 8,4,2 \
        --set mesh.rules.mlp= --out docs/pod
    python scripts/compile_pod.py --config llama_7b --mesh 8,8,1 --mesh 8,4,2 --out docs/pod
    python scripts/compile_pod.py --config tiny --devices 16 --mesh 2,4,2 --set model.num_layers=2

The devices are simulated CPU devices (``--devices``, 64 by default); nothing is allocated
beyond the compiler's own memory. See :mod:`gift_jax.apps.pod` for what a CPU compile does and
does not say about a GPU/TPU compile.
"""

import argparse
import json
import os
import pathlib
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama_1b", help="a name in configs/ or a path")
    parser.add_argument("--devices", type=int, default=64, help="simulated CPU devices")
    parser.add_argument("--mesh", action="append", default=None,
                        help="data,fsdp,tensor (repeatable; default 8,8,1 and 8,4,2)")
    parser.add_argument("--modes", default="fp32,fp8,gift_fp8,plumage_fp8",
                        help="comma-separated, of: fp32, fp8, gift_fp8, plumage_fp8")
    parser.add_argument("--refresh", action="store_true",
                        help="also compile the GIFT/PLUMAGE refresh variants")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="config override, e.g. mesh.rules.mlp= or model.num_layers=2")
    parser.add_argument("--out", default=None, help="directory for pod.json and pod.md")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from gift_jax.apps.pod import MODES, compile_mode, markdown_table
    from gift_jax.training.config import ConfigError, apply_overrides, load_config

    configs = pathlib.Path(__file__).resolve().parent.parent / "configs"
    try:
        config = load_config(args.config, configs)
        config = apply_overrides(config, [tuple(s.split("=", 1)) for s in args.set])
        modes = args.modes.split(",")
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise ConfigError(f"--modes {unknown} unknown; allowed: {', '.join(MODES)}")
        meshes = [tuple(int(v) for v in m.split(",")) for m in (args.mesh or ["8,8,1", "8,4,2"])]
        if len(jax.devices()) != args.devices:
            raise ConfigError(f"--devices={args.devices} but JAX sees {len(jax.devices())} "
                              "devices (XLA_FLAGS was set before this script)")
        rows = []
        for mesh in meshes:
            for mode in modes:
                for row in compile_mode(config, mode, mesh, refresh=args.refresh):
                    rows.append(row)
                    print(json.dumps(row.row()), flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(rows)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = pathlib.Path(args.config).stem
        (out / f"{name}.json").write_text(json.dumps([r.row() for r in rows], indent=1))
        (out / f"{name}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
