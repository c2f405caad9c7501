"""GIFT round-trip fidelity on real gradients (Tables I/II of arXiv 2607.07494) + staleness.

Trains the config's model briefly (AdamW, one device), takes per-replica gradients of R
simulated data-parallel replicas, simulates the quantized all-reduce (fp32 or FP8 ring
accumulation, with/without error feedback) in every whitening frame, and writes markdown
tables, JSON and PNG plots into --out.

    python scripts/roundtrip.py --out /tmp/gift_exp/roundtrip
    python scripts/roundtrip.py --train_steps 20 --capture_steps 2 --staleness_steps 0 --out /tmp/x
    # refresh schedules only (fresh, fixed K, adaptive; docs/gift_refresh_schedule.png):
    python scripts/roundtrip.py --skip_tables --staleness_steps 0 --schedule_steps 100 --out /tmp/s
    # does the factor follow the model (GIFT runs, EMA vs held-out A at every refresh):
    python scripts/roundtrip.py --factor_distance 400 --out /tmp/fd
    # which transport model gives the paper's Table I/II (every model, R = 8 and 64):
    python scripts/roundtrip.py --transport_study 8,64 --replicas 64 --capture_steps 2 --out /tmp/t
"""

import argparse
import json
import pathlib
import sys
import time

from gift_jax.apps.experiments import roundtrip as rt
from gift_jax.training.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="config name under configs/ or a path")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--train_steps", type=int, default=200, help="AdamW steps before capture")
    ap.add_argument("--capture_steps", type=int, default=4,
                    help="consecutive captured steps (error feedback acts over them)")
    ap.add_argument("--replicas", type=int, default=8, help="R simulated replicas")
    ap.add_argument("--local_batch", type=int, default=2, help="sequences per replica")
    ap.add_argument("--codecs", default="fp8_e4m3,fp8_e5m2")
    ap.add_argument("--accumulate", default="fp32,fp8", help="fp32 and/or fp8 (ring)")
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--remainder", default="diag", choices=("diag", "isotropic"),
                    help="remainder of the rank-r factors")
    ap.add_argument("--damping", type=float, default=1e-3, help="relative damping of A and B")
    ap.add_argument("--staleness_steps", type=int, default=100,
                    help="largest k of the staleness ablation (0 skips it)")
    ap.add_argument("--staleness_codec", default="fp8_e4m3")
    ap.add_argument("--schedule_steps", type=int, default=0,
                    help="steps of the refresh-schedule comparison (fixed K vs adaptive; 0 "
                    "skips it)")
    ap.add_argument("--skip_tables", action="store_true",
                    help="skip the round-trip tables (run only the ablations asked for)")
    ap.add_argument("--fixed", default="5,10,50", help="refresh schedules: fixed intervals K")
    ap.add_argument("--thresholds", default="0.97,0.975,0.98",
                    help="refresh schedules: adaptive thresholds τ")
    ap.add_argument("--min_refresh_every", type=int, default=5,
                    help="refresh schedules: the adaptive rule's minimum interval")
    ap.add_argument("--replica_sweep", default="",
                    help="comma list of replica counts R: the one-step round trip of Euclidean, "
                    "full A and rank-32 A at each (the first R of --replicas captured "
                    "replicas); writes replica_sweep.md/.json/.png")
    ap.add_argument("--transport_study", default="",
                    help="comma list of replica counts R: the paper's Table I/II frames "
                    "(down_proj) through every transport model of --transports at each R, "
                    "beside the paper's numbers (this study alone; writes transport.md/.json)")
    ap.add_argument("--transports", default="",
                    help="--transport_study: comma list of TRANSPORTS keys (default: all)")
    ap.add_argument("--stale_steps", type=int, default=0,
                    help="--transport_study: the stale transports' scales come from the step "
                    "this many steps before the first captured one (0: no stale transports)")
    ap.add_argument("--factor_distance", type=int, default=0,
                    help="steps of GIFT runs whose EMA of A is compared at every refresh with "
                    "the current model's A on a held-out batch, per gift.ema_scheme (this "
                    "study alone; writes factor_distance.md/.json)")
    ap.add_argument("--factor_scheme", action="append", default=[],
                    help="NAME=setting:value,setting:value: a scheme of --factor_distance in "
                    "place of the default two (artifact, bias-corrected), e.g. "
                    "'k1h25=gift.stats_every:1,gift.stats_half_life:25'; repeatable")
    ap.add_argument("--heldout", type=int, default=256,
                    help="--factor_distance: sequences of the held-out batch")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    command = "python " + " ".join(["scripts/roundtrip.py", *(argv or sys.argv[1:])])
    if args.factor_distance > 0:
        factor_distance(args, out, command)
        print(f"\nwrote {out}/factor_distance.* in {time.perf_counter() - t0:.0f}s")
        return
    print(f"training {args.train_steps} steps, capturing {args.capture_steps} steps "
          f"x {args.replicas} replicas", flush=True)
    # The replica sweep alone consumes the captures one at a time (one in memory, and no
    # output-side B_r, which only the tables' Kronecker frames read).
    sweep_only = bool(args.replica_sweep and args.skip_tables and args.staleness_steps == 0
                      and args.schedule_steps == 0)
    if args.transport_study:
        transport_study(args, out, command, t0)
        return
    trainer, _ = rt.train_and_capture(
        load_config(args.config, CONFIGS), train_steps=args.train_steps, capture_steps=0,
        seed=args.seed,
        schedule_steps=args.train_steps + args.capture_steps + max(args.staleness_steps,
                                                                   args.schedule_steps))
    caps = rt.iter_captures(trainer, args.capture_steps, replicas=args.replicas,
                            local_batch=args.local_batch, output_stats=not sweep_only)
    if not sweep_only:
        caps = list(caps)
    if args.replica_sweep:
        counts = [int(r) for r in args.replica_sweep.split(",")]
        rows = rt.replica_sweep_experiment(caps, counts, codecs=args.codecs.split(","),
                                           accumulations=args.accumulate.split(","),
                                           damping=args.damping)
        md = (f"<!-- {command} -->\nModel `{args.config}` after {args.train_steps} AdamW steps, "
              f"steps {args.train_steps}..{args.train_steps + args.capture_steps - 1} captured, "
              f"R replicas x {args.local_batch} sequences each; one-step round trip with a "
              "fresh factor, mean over the captured steps; in brackets the change against "
              "Euclidean at the same R.\n" + rt.replica_sweep_markdown(rows))
        (out / "replica_sweep.md").write_text(md)
        (out / "replica_sweep.json").write_text(json.dumps({"command": command, "rows": rows},
                                                           indent=1, default=float))
        rt.plot_replica_sweep(rows, str(out / "replica_sweep.png"))
        print(md)
        if sweep_only:
            print(f"\nwrote {out}/replica_sweep.* in {time.perf_counter() - t0:.0f}s")
            return
    methods = rt.default_methods([int(r) for r in args.ranks.split(",")], args.remainder)
    rows = [] if args.skip_tables else rt.roundtrip_experiment(
        caps, methods=methods, codecs=args.codecs.split(","),
        accumulations=args.accumulate.split(","), damping=args.damping)
    md = [f"<!-- {command} -->",
          f"Model `{args.config}` after {args.train_steps} AdamW steps (captured steps "
          f"{args.train_steps}..{args.train_steps + args.capture_steps - 1}), R={args.replicas} "
          f"replicas x {args.local_batch} sequences; last logged training loss "
          f"{trainer.losses[-1] if trainer.losses else float('nan'):.3f}.",
          rt.roundtrip_markdown(rows) if rows else ""]
    if rows:
        rt.plot_roundtrip(rows, str(out / "roundtrip.png"), args.codecs.split(",")[0])
    result = {"command": command, "rows": rows}
    (out / "roundtrip.md").write_text("\n".join(md))  # the tables, before the ablation
    print("\n".join(md), flush=True)
    if args.staleness_steps > 0:
        offs = [k for k in (0, 2, 5, 9, 15, 24, 35, 49, 75, 99, 149, 199)
                if k <= args.staleness_steps]
        st = rt.staleness_experiment(trainer, offsets=offs, replicas=args.replicas,
                                     local_batch=args.local_batch, codec=args.staleness_codec,
                                     damping=args.damping)
        md.append(rt.staleness_markdown(st))
        rt.plot_staleness(st, str(out / "staleness.png"))
        result["staleness"] = st
    if args.schedule_steps > 0:
        sch = rt.refresh_schedule_experiment(trainer, steps=args.schedule_steps,
                                             fixed=[int(k) for k in args.fixed.split(",")],
                                             thresholds=[float(t) for t in
                                                         args.thresholds.split(",")],
                                             min_every=args.min_refresh_every,
                                             replicas=args.replicas,
                                             local_batch=args.local_batch,
                                             codec=args.staleness_codec, damping=args.damping)
        md.append(rt.refresh_schedule_markdown(sch))
        rt.plot_refresh_schedules(sch, str(out / "refresh_schedule.png"))
        result["refresh_schedules"] = sch
    (out / "roundtrip.md").write_text("\n".join(md))
    (out / "roundtrip.json").write_text(json.dumps(result, indent=1, default=float))
    print("\n".join(md))
    print(f"\nwrote {out}/roundtrip.md, roundtrip.json, *.png in {time.perf_counter() - t0:.0f}s")


def _scheme(text: str) -> tuple[str, dict]:
    """``NAME=setting:value,...`` → ``(NAME, {setting: value})`` (values as Python literals
    where they parse, else strings)."""
    import ast

    name, _, body = text.partition("=")
    settings = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition(":")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = value
    return name, settings


def transport_study(args, out, command, t0):
    """``--transport_study``: the Table I/II frames through every transport model."""
    counts = [int(r) for r in args.transport_study.split(",")]
    k = args.stale_steps
    trainer, _ = rt.train_and_capture(
        load_config(args.config, CONFIGS), train_steps=args.train_steps - k, capture_steps=0,
        seed=args.seed, schedule_steps=args.train_steps + args.capture_steps)
    capture = dict(replicas=max(counts), local_batch=args.local_batch, output_stats=False,
                   layers=("*/mlp/down_proj",))
    stale = None
    if k > 0:
        stale = next(rt.iter_captures(trainer, 1, **capture))
        trainer.advance(k)
    caps = rt.iter_captures(trainer, args.capture_steps, **capture)
    transports = [t for t in args.transports.split(",") if t] or list(rt.TRANSPORTS)
    rows = rt.transport_study(caps, transports=transports, replica_counts=counts,
                              codecs=args.codecs.split(","), damping=args.damping, stale=stale)
    transports = list(dict.fromkeys(r["transport"] for r in rows))
    head = (f"<!-- {command} -->\nModel `{args.config}` after {args.train_steps} AdamW steps, "
            f"steps {args.train_steps}..{args.train_steps + args.capture_steps - 1} captured, "
            f"R replicas x {args.local_batch} sequences; down_proj, one-step round trip with "
            "fresh factors, relative L2 error (mean over the captured steps); a transport "
            "'reproduces' the paper where every entry is within 25 % of it and diagonal A "
            "within ±10 % of Euclidean.\n\n"
            + "\n".join(f"- `{k}`: {rt.TRANSPORT_TITLES[k]}" for k in transports) + "\n")
    md = (head + rt.transport_markdown(rows)
          + "\n### The same errors over the replicas' rms gradient norm\n"
          + rt.transport_markdown(rows, "rel_l2_local"))
    (out / "transport.md").write_text(md)
    (out / "transport.json").write_text(json.dumps({"command": command, "rows": rows},
                                                   indent=1, default=float))
    print(md)
    print(f"\nwrote {out}/transport.* in {time.perf_counter() - t0:.0f}s")


def factor_distance(args, out, command):
    """``--factor_distance``: the EMA's distance to the held-out statistic at every refresh."""
    from gift_jax.apps.experiments import factor_tracking as ft

    schemes = dict(_scheme(s) for s in args.factor_scheme) or None
    seed = 0 if args.seed is None else args.seed
    res = ft.factor_distance_experiment(load_config(args.config, CONFIGS),
                                        steps=args.factor_distance, schemes=schemes,
                                        heldout_sequences=args.heldout, seed=seed)
    md = (f"<!-- {command} -->\nModel `{args.config}`, GIFT runs of {args.factor_distance} "
          f"steps (seed {seed}); at every refresh the relative Frobenius distance "
          "‖A_EMA − A_held-out‖/‖A_held-out‖ of the EMA the factors are built from to the "
          f"current model's A on {args.heldout} held-out sequences: mean over the whitened "
          "layers (worst layer); last column: the step's own training batch.\n\n"
          + ft.factor_distance_markdown(res)
          + "\nThe same between trace-normalised matrices (what the factor sees: with relative "
          "damping the factor of cA is c^-1/2 times A's, which the per-tensor scale absorbs):"
          "\n\n" + ft.factor_distance_markdown(res, shape=True))
    (out / "factor_distance.md").write_text(md)
    (out / "factor_distance.json").write_text(json.dumps({"command": command, **res},
                                                         indent=1, default=float))
    print(md)


if __name__ == "__main__":
    main()
