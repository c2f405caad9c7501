"""Quantized fsdp collectives against fp32: final eval loss paired over seeds.

Example (the measurement in docs/api/pod.md, "Quantized fsdp collectives")::

    python scripts/fsdp_study.py --out /tmp/fsdp_study --config tiny --seeds 0,1,2

Every run is the library's trainer on ``--mesh`` (data, fsdp, tensor) of ``--cpu_devices``
simulated CPU devices, once per variant of how the blocks' weights cross ``fsdp``
(``gift_jax.apps.experiments.fsdp_study.VARIANTS``: XLA's collectives, the gradients in fp8,
the gradients and the weights in fp8), each with fp32 and fp8 across ``data``. Runs are
written as they finish (``OUT/<variant>/records``; an interrupted study resumes), then
``OUT/table.md`` (``--report_only``: only this, from the records on disk).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/fsdp_study")
    ap.add_argument("--config", default="tiny", help="configs/<config>.py")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--eval_batches", type=int, default=8)
    ap.add_argument("--mesh", default="2,4,1", help="data,fsdp,tensor (fsdp > 1)")
    ap.add_argument("--cpu_devices", type=int, default=8)
    ap.add_argument("--variants", default="", help="comma-separated; default: all")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a model.*/train.*/optimizer.* override of every run (repeatable)")
    ap.add_argument("--report_only", action="store_true")
    a = ap.parse_args()
    mesh = tuple(int(x) for x in a.mesh.split(","))
    if len(mesh) != 3 or mesh[1] < 2 or mesh[0] * mesh[1] * mesh[2] != a.cpu_devices:
        ap.error(f"--mesh={a.mesh!r}: data,fsdp,tensor with fsdp > 1 and a product of "
                 f"--cpu_devices={a.cpu_devices}")

    from gift_jax.utils.cpu_devices import simulate_cpu_devices

    simulate_cpu_devices(a.cpu_devices)
    from gift_jax.apps.experiments import fsdp_study as S
    from gift_jax.apps.experiments.frontier import FrontierSettings, parse_overrides

    try:
        model, train = parse_overrides(a.set)
    except ValueError as e:
        ap.error(str(e))
    s = FrontierSettings(config=a.config, steps=a.steps, eval_every=a.eval_every,
                         eval_batches=a.eval_batches, model=model, train=train)
    csv = lambda text: [x for x in text.split(",") if x]
    variants = csv(a.variants) or list(S.VARIANTS)
    unknown = sorted(set(variants) - set(S.VARIANTS))
    if unknown:
        ap.error(f"--variants {unknown}: allowed {sorted(S.VARIANTS)}")
    seeds = [int(x) for x in csv(a.seeds)]
    t0 = time.perf_counter()
    if a.report_only:
        records = S.load_study(a.out, s, mesh, variants)
        if not records:
            print(f"error: no records under {a.out} were run with {s} on mesh {mesh}",
                  file=sys.stderr)
            return 2
    else:
        records = S.run_study(a.out, seeds, s, mesh, variants, configs_dir=str(CONFIGS))
    md = S.format_table(S.summarize(records))
    print(md)
    print(f"total {time.perf_counter() - t0:.0f} s")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "table.md"), "w") as fh:
        fh.write(md + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
