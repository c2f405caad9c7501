"""Low-rank optimizer benchmarks: state bytes (60M-1B) and update step time on CPU.

Example (the measurement in docs/lowrank_results.md)::

    python scripts/bench_lowrank.py --out /tmp/lowrank_exp/bench

State bytes come from ``jax.eval_shape`` of ``init`` (nothing is allocated); times are the
best of ``--repeats`` calls of the jitted optimizer update on one 60M-shaped block set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gift_jax.apps.experiments import lowrank as E

CONFIGS = ("configs/llama_60m.py", "configs/llama_130m.py", "configs/llama_350m.py",
           "configs/llama_1b.py")


def _mib(b: int) -> str:
    return f"{b / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/lowrank_exp/bench")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--skip_memory", action="store_true")
    ap.add_argument("--skip_time", action="store_true")
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--d_ff", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30, help="best of N, ordinary steps")
    ap.add_argument("--refresh_repeats", type=int, default=3, help="best of N, refresh steps")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    out: dict = {}

    if not a.skip_memory:
        rows = E.state_memory_table(a.configs.split(","))
        out["memory"] = rows
        print("| config | rank | projected leaves | params MiB | Adam MiB | optax galore MiB | "
              "ours galore MiB | ours plumage MiB | ours flora MiB | plumage/Adam | "
              "plumage/optax galore |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['config']} | {r['rank']} | {r['projected_leaves']}/{r['leaves']} | "
                  f"{_mib(r['params'])} | {_mib(r['adam'])} | {_mib(r['optax_galore'])} | "
                  f"{_mib(r['ours_galore'])} | {_mib(r['ours_plumage'])} | "
                  f"{_mib(r['ours_flora'])} | {r['ours_plumage'] / r['adam']:.3f} | "
                  f"{r['ours_plumage'] / r['optax_galore']:.4f} |")

    if not a.skip_time:
        rows = E.time_updates(a.d_model, a.d_ff, a.layers, a.rank, repeats=a.repeats,
                              refresh_repeats=a.refresh_repeats)
        out["time"] = rows
        base = {r["step"]: r["seconds"] for r in rows if r["optimizer"] == "ours[galore]"}
        ox = {r["step"]: r["seconds"] for r in rows if r["optimizer"] == "optax.contrib.galore"}
        print(f"\nupdate time, {a.layers} block(s) d_model={a.d_model} d_ff={a.d_ff} "
              f"rank={a.rank}, best of {a.repeats} (ordinary) / {a.refresh_repeats} (refresh)")
        print("| optimizer | step | ms | / ours[galore] | / optax.contrib.galore |")
        print("|---|---|---|---|---|")
        for r in rows:
            t = r["seconds"]
            print(f"| {r['optimizer']} | {r['step']} | {1e3 * t:.3f} | "
                  f"{t / base[r['step']]:.3f} | {t / ox[r['step']]:.3f} |")
        sys.stdout.flush()
    with open(os.path.join(a.out, "bench.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
