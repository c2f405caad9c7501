"""Adam vs GaLore vs FLORA vs PLUMAGE (± realignment) on the Llama, several seeds.

Example (the measurement in docs/lowrank_results.md)::

    python scripts/lowrank_compare.py --out /tmp/lowrank_exp/compare

Every run is the library's trainer (``gift_jax.training.Trainer`` on one device, the settings
over ``configs/base.py``). Writes ``results.json`` (every
curve), ``table.md`` and ``curves.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

from gift_jax.apps.experiments import lowrank as E
from gift_jax.training.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    d = E.CompareSettings()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/lowrank_exp/compare")
    ap.add_argument("--methods", default=",".join(E.METHODS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--reuse", default="", help="results.json of an earlier run: add its runs "
                    "of --reuse_methods (their settings must match) instead of rerunning them")
    ap.add_argument("--reuse_methods", default="")
    for f in dataclasses.fields(E.CompareSettings):
        if f.name != "model":
            v = getattr(d, f.name)
            ap.add_argument(f"--{f.name}", type=type(v), default=v)
    ap.add_argument("--d_model", type=int, default=dict(d.model)["d_model"])
    ap.add_argument("--num_layers", type=int, default=dict(d.model)["num_layers"])
    ap.add_argument("--d_ff", type=int, default=dict(d.model)["d_ff"])
    ap.add_argument("--num_heads", type=int, default=dict(d.model)["num_heads"])
    a = ap.parse_args()

    model = dict(d.model)
    model.update(d_model=a.d_model, num_layers=a.num_layers, d_ff=a.d_ff, num_heads=a.num_heads,
                 max_seq_len=a.seq_len)
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(E.CompareSettings)
          if f.name != "model"}
    s = E.CompareSettings(**kw).replace(model=model)
    methods = a.methods.split(",")
    seeds = [int(x) for x in a.seeds.split(",")]
    os.makedirs(a.out, exist_ok=True)

    table = E.projection_table(E.param_shapes(s.model_config), s.rank)
    print(f"settings: {s}")
    print("leaves (rank", s.rank, "):")
    for r in table:
        how = (f"projected {r['side']} side, M={r['m']} N={r['n']} k={r['rank']}"
               if r["projected"] else f"dense ({r['reason']})")
        print(f"  {r['path']:36s} {str(r['shape']):12s} {how}")
    if not any(r["projected"] for r in table):
        raise SystemExit("no leaf is projected at this rank: the comparison would be Adam vs Adam")

    t0 = time.perf_counter()
    results = E.run_comparison(s, methods, seeds, base_config=load_config("base", CONFIGS))
    if a.reuse:
        results += E.load_runs(a.reuse, s, a.reuse_methods.split(","))
    summary = E.summarize(results)
    md = E.format_compare_markdown(summary)
    print(md)
    print(f"total {time.perf_counter() - t0:.0f} s")
    with open(os.path.join(a.out, "table.md"), "w") as fh:
        fh.write(md + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as fh:
        json.dump({"settings": dataclasses.asdict(s), "summary": summary,
                   "projection": table,
                   "runs": [dataclasses.asdict(r) for r in results]}, fh, default=str)
    E.plot_curves(results, os.path.join(a.out, "curves.png"))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
