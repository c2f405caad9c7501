"""The precision frontier: final eval-loss gap to fp32 against wire bytes, over paired seeds.

Example (the measurement in docs/frontier_results.md)::

    python scripts/frontier.py --out /tmp/frontier --slices primary,harsh,muon,plumage

Every run is the library's trainer (``gift_jax.training.Trainer``) data-parallel over
``--cpu_devices`` simulated CPU devices (8). Each finished run is written to
``OUT/records/<codec>/<transport>/acc-<accumulate>/<optimizer>/seed<S>.json`` at once, so an
interrupted grid resumes where it stopped (runs with other settings are not reused). Then
``OUT/table.md``, ``OUT/summary.json`` and the Pareto plot ``OUT/frontier.png`` are written
(``--report_only``: only this, from the records on disk).

The grid is ``--slices`` (see ``gift_jax.apps.experiments.frontier.SLICES``) or, with
``--codecs/--transports/--accumulations/--optimizers``, their cross product.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/frontier")
    ap.add_argument("--slices", default="primary,harsh,muon,plumage",
                    help="named slices of the grid, comma-separated, or 'all'")
    ap.add_argument("--codecs", default="", help="cross product instead of --slices: codecs")
    ap.add_argument("--transports", default="", help="... transports")
    ap.add_argument("--accumulations", default="", help="... accumulations (fp32,fp8)")
    ap.add_argument("--optimizers", default="", help="... optimizers (adamw,muon)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--config", default="tiny", help="configs/<config>.py")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--refresh_every", type=int, default=50)
    ap.add_argument("--min_refresh_every", type=int, default=10)
    ap.add_argument("--max_refresh_every", type=int, default=200)
    ap.add_argument("--cpu_devices", type=int, default=8,
                    help="simulated CPU devices: the replicas R (data-parallel)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a model.*/train.*/optimizer.* override of every run (repeatable), "
                    "e.g. train.global_batch_size=64 for 64 x 1 sequences at --cpu_devices 64")
    ap.add_argument("--report_only", action="store_true")
    ap.add_argument("--plot", default="", help="also write the Pareto plot here")
    a = ap.parse_args()

    from gift_jax.utils.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(a.cpu_devices)
    from gift_jax.apps.experiments import frontier as F

    try:
        model, train = F.parse_overrides(a.set)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    s = F.FrontierSettings(config=a.config, steps=a.steps, eval_every=a.eval_every,
                           eval_batches=a.eval_batches, refresh_every=a.refresh_every,
                           min_refresh_every=a.min_refresh_every,
                           max_refresh_every=a.max_refresh_every, model=model, train=train)
    if a.codecs or a.transports or a.accumulations or a.optimizers:
        cells = F.cross_product(_csv(a.codecs) or F.CODECS, _csv(a.transports) or F.TRANSPORTS,
                                _csv(a.accumulations) or F.ACCUMULATIONS,
                                _csv(a.optimizers) or F.OPTIMIZERS)
    else:
        cells = F.slice_cells(_csv(a.slices))
    seeds = [int(x) for x in _csv(a.seeds)]
    print(f"settings: {s}\n{len(cells)} cells x {len(seeds)} seeds")
    t0 = time.perf_counter()
    if a.report_only:
        records = F.load_records(a.out, s)
        if not records:  # never overwrite a report with an empty one
            other = F.load_records(a.out)
            hint = (f"; its {len(other)} records were run with other settings, e.g. "
                    f"{other[0]['settings']} on {other[0]['devices']} devices: pass the same "
                    "--config, --steps, --set and --cpu_devices" if other else "")
            print(f"error: no records under {a.out}/records were run with {s}{hint}",
                  file=sys.stderr)
            return 2
    else:
        records = F.run_grid(cells, seeds, s, a.out, configs_dir=CONFIGS)
    rows = F.summarize(records)
    md = (F.format_table(rows) + "\n\nTransports head to head (paired over seeds; negative: "
          "a ends lower than b):\n\n" + F.format_comparisons(F.transport_comparisons(records)))
    print(md)
    print(f"total {time.perf_counter() - t0:.0f} s")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "table.md"), "w") as fh:
        fh.write(md + "\n")
    with open(os.path.join(a.out, "summary.json"), "w") as fh:
        json.dump({"settings": s.asdict(), "rows": rows}, fh, indent=1)
    title = (f"{s.config}, {s.steps} steps, {a.cpu_devices} replicas: final eval loss gap to "
             "the same seed's fp32 run (paired 95% interval; filled = beyond seed noise)")
    for path in filter(None, (os.path.join(a.out, "frontier.png"), a.plot)):
        F.plot_frontier(rows, path, title=title)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
