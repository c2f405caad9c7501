"""The demo: the tiny Llama trained on 8 simulated devices with fp32, Euclidean FP8, GIFT-FP8
and PLUMAGE communication from the same seed; prints a comparison table and writes the
loss-curve PNG (with a panel of each mode's loss difference to fp32).

    python scripts/demo.py                         # runs/demo/, 100 steps per mode
    python scripts/demo.py --steps 60 --modes fp32,fp8
"""

import argparse
import os
import pathlib


def main(argv=None):
    from gift_jax.utils.cpu_devices import pin_cpu_isa, simulate_cpu_devices

    simulate_cpu_devices(8)  # 8 data-parallel devices on a CPU host (XLA_FLAGS may say more)
    # the same vector code on every x86-64 CPU, so the table reproduces across machines
    # (XLA_FLAGS=--xla_cpu_max_isa=... overrides; see gift_jax.utils.cpu_devices.pin_cpu_isa)
    pinned = pin_cpu_isa("AVX2")

    from gift_jax.apps.demo import DEMO_MODES, format_table, run_demo
    from gift_jax.apps.plotting import plot_runs

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo", help="one workdir per mode below this")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--modes", default=",".join(DEMO_MODES))
    ap.add_argument("--data", default=None, help="corpus spec (default: bundled Shakespeare)")
    ap.add_argument("--data_dir", default=None)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    tiny = pathlib.Path(__file__).resolve().parent.parent / "configs" / "tiny.py"
    rows = run_demo(args.out, tiny, args.steps, modes, args.data, args.data_dir)
    png = plot_runs({r["mode"]: r["workdir"] for r in rows}, os.path.join(args.out, "loss.png"),
                    title=f"tiny Llama, 8 devices, {args.steps} steps", reference="fp32")
    print()
    print(format_table(rows))
    if pinned:
        print("\n(XLA:CPU compiled for AVX2 whatever this host's widest vector ISA: the same "
              "vector code on every x86-64 CPU with AVX2)")
    print(f"\nloss curves: {png}")


if __name__ == "__main__":
    main()
