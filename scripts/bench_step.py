"""Whole train-step time ratios measured in the same run (GIFT and PLUMAGE issues).

Two comparisons on the trainer's own compiled step (forward, backward, data-parallel
reduction, optimizer) over 8 simulated CPU devices when there is no accelerator, timed
interleaved (:func:`gift_jax.apps.step_timing.step_times`):

* ``gift``: ``fp8`` (comm.method ``none``: Euclidean FP8 all-reduce) vs ``gift_fp8``
  (comm.method ``gift``) — ordinary-step ratio
  (goal <= 1.05) and the refresh step's extra time amortised over K.
* ``gift_adaptive``: ``gift_fp8`` with ``gift.refresh=adaptive`` vs the fixed clock: the cost of
  the staleness signal (input coverage of a token sample, every ordinary step).
* ``lowrank``: PLUMAGE vs GaLore projector (comm.method ``plumage``) — ordinary-step ratio
  (goal <= 1.05) and refresh steps.
* ``gift_spread`` / ``plumage_spread``: refresh steps with the per-layer decompositions spread
  over the replicas (``comm.distribute_refresh=true``, the default) vs every replica
  computing all of them.

Every configuration communicates in the config's low-precision ``comm.codec`` (``fp8_e4m3``
when the config sets ``fp32`` or ``bf16``, as ``tiny`` does).

    python scripts/bench_step.py --out /tmp/bench_step
    python scripts/bench_step.py --compare gift --config tiny --repeats 30 --out /tmp/x
"""

import argparse
import json
import pathlib
import sys

from gift_jax.utils.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)  # a data-parallel mesh on a CPU host (an XLA_FLAGS count wins)

import jax  # noqa: E402

from gift_jax.apps.step_timing import step_times  # noqa: E402
from gift_jax.training.config import (  # noqa: E402
    apply_overrides,
    complete_config,
    load_config,
)
from gift_jax.training.mesh import make_mesh  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"

# ("comm.codec", None): the config's low-precision codec (fp8_e4m3 when it sets fp32 or bf16)
FP8 = [("comm.codec", None), ("comm.method", "none")]
GIFT_FP8 = [("comm.codec", None), ("comm.method", "gift")]
PLUMAGE_FP8 = [("comm.codec", None), ("comm.method", "plumage")]
COMPARISONS = {
    "gift": ("fp8", {"fp8": FP8, "gift_fp8": GIFT_FP8}),
    "gift_adaptive": ("gift_fp8", {"gift_fp8": GIFT_FP8,
                                   "gift_fp8 adaptive": [*GIFT_FP8, ("gift.refresh", "adaptive")]}),
    "lowrank": ("galore", {
        "galore": [*PLUMAGE_FP8, ("plumage.projector", "galore")],
        "plumage": [*PLUMAGE_FP8, ("plumage.projector", "plumage")]}),
    "gift_spread": ("gift_fp8 replicated", {
        "gift_fp8 replicated": [*GIFT_FP8, ("comm.distribute_refresh", "false")],
        "gift_fp8 spread": [*GIFT_FP8, ("comm.distribute_refresh", "true")]}),
    "plumage_spread": ("plumage replicated", {
        "plumage replicated": [*PLUMAGE_FP8, ("comm.distribute_refresh", "false")],
        "plumage spread": [*PLUMAGE_FP8, ("comm.distribute_refresh", "true")]}),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="tiny", help="config name under configs/ or a path")
    ap.add_argument("--compare", default=",".join(COMPARISONS),
                    help=f"comma list of: {', '.join(COMPARISONS)}")
    ap.add_argument("--repeats", type=int, default=20, help="ordinary steps per config")
    ap.add_argument("--refresh_repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="config override for every configuration, e.g. "
                         "train.global_batch_size=64 (repeatable)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(["scripts/bench_step.py", *(argv or sys.argv[1:])])
    sets = [tuple(kv.split("=", 1)) for kv in args.set]
    if any(len(kv) != 2 for kv in sets):
        raise SystemExit("--set takes NAME=VALUE, e.g. --set train.global_batch_size=64")
    base_config = apply_overrides(complete_config(load_config(args.config, CONFIGS)), sets)
    mesh = make_mesh()
    md = [f"<!-- {command} -->",
          f"platform {jax.default_backend()}, {len(jax.devices())} devices, config "
          f"`{args.config}` {' '.join(args.set)}, interleaved rounds: {args.repeats} ordinary, "
          f"{args.refresh_repeats} refresh steps per configuration", "",
          "| comparison | config | ordinary step best (ms) | median (ms) | ratio to baseline "
          "(best / median) | refresh step best (ms) | refresh / baseline's | refresh extra "
          "amortised over K |",
          "|---|---|---|---|---|---|---|---|"]
    result = {"command": command, "rows": []}
    for name in args.compare.split(","):
        if name not in COMPARISONS:
            raise SystemExit(f"--compare: unknown {name!r}; allowed: {', '.join(COMPARISONS)}")
        baseline, variants = COMPARISONS[name]
        codec = base_config.comm.codec
        codec = "fp8_e4m3" if codec in ("fp32", "bf16") else codec
        configs = {label: apply_overrides(base_config, [(k, codec if v is None else v)
                                                        for k, v in ov])
                   for label, ov in variants.items()}
        rows = step_times(configs, mesh, repeats=args.repeats,
                          refresh_repeats=args.refresh_repeats)
        base = next(r for r in rows if r["config"] == baseline)
        for r in rows:
            ratio = (f"{r['ordinary_best'] / base['ordinary_best']:.3f} / "
                     f"{r['ordinary_median'] / base['ordinary_median']:.3f}")
            extra = refresh = refresh_ratio = "—"
            if r["refresh_best"] is not None:
                refresh = f"{1e3 * r['refresh_best']:.1f}"
                if base["refresh_best"] is not None:
                    refresh_ratio = f"{r['refresh_best'] / base['refresh_best']:.3f}"
                amortised = (r["refresh_best"] - r["ordinary_best"]) / r["refresh_every"]
                extra = (f"{1e3 * amortised:.2f} ms/step (K={r['refresh_every']}; "
                         f"{amortised / r['ordinary_best']:.3f} of a step)")
            md.append(f"| {name} | {r['config']} | {1e3 * r['ordinary_best']:.1f} | "
                      f"{1e3 * r['ordinary_median']:.1f} | {ratio} | {refresh} | "
                      f"{refresh_ratio} | {extra} |")
            result["rows"].append({"comparison": name, **r})
        print("\n".join(md[-len(rows):]), flush=True)
    (out / "bench_step.md").write_text("\n".join(md) + "\n")
    (out / "bench_step.json").write_text(json.dumps(result, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
