"""Per-layer FP8 vulnerability profile and GIFT layer selection (arXiv 2607.07494).

For every linear layer's kernel gradient, under the artifact's stale synced scales (computed
at the checkpoint step and reused for --window steps): saturation ratio, underflow fraction,
round-trip error in the Euclidean and whitened frames (and with GIFT rank-32), and the share of
elements the library's own all-reduce clips under ``scale_sync_every`` (its stale synced
scales, on R simulated CPU devices), averaged over the window; ranking; the top-n selection
written as a Python config snippet; re-profiled at later checkpoints with the overlap of the
selections.

    python scripts/profile_layers.py --out /tmp/gift_exp/profile
    python scripts/profile_layers.py --checkpoints 0,100,300 --window 50 --stride 5 --top_n 4 \
        --candidates '*/mlp/down_proj' --out /tmp/gift_exp/profile_fc2
"""

import argparse
import json
import pathlib
import sys
import time

from gift_jax.apps.experiments import profile as pf
from gift_jax.apps.experiments import roundtrip as rt
from gift_jax.training.config import load_config
from gift_jax.utils.cpu_devices import simulate_cpu_devices

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoints", default="0,100,300",
                    help="training steps at which a profiling window starts")
    ap.add_argument("--window", type=int, default=50, help="steps a synced scale is reused")
    ap.add_argument("--stride", type=int, default=5, help="profile every stride-th step")
    ap.add_argument("--codec", default="fp8_e5m2", help="the artifact uses e5m2")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--local_batch", type=int, default=1)
    ap.add_argument("--top_n", type=int, default=4)
    ap.add_argument("--candidates", default="",
                    help="comma-separated patterns the selection is restricted to "
                         "(e.g. '*/mlp/down_proj', as the artifact); empty = all layers")
    ap.add_argument("--gift_rank", type=int, default=32)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    # the library's all-reduce reduces the replicas on R devices (an XLA_FLAGS count wins)
    simulate_cpu_devices(args.replicas)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(["scripts/profile_layers.py", *(argv or sys.argv[1:])])
    checkpoints = [int(s) for s in args.checkpoints.split(",")]
    cands = [c for c in args.candidates.split(",") if c] or None
    t0 = time.perf_counter()
    cfg = load_config(args.config, CONFIGS)
    trainer = rt.Trainer(cfg, seed=args.seed,
                         schedule_steps=max(checkpoints[-1] + args.window, cfg.train.num_steps))
    result = pf.profile_layers(trainer, checkpoints, window=args.window, stride=args.stride,
                               codec=args.codec, replicas=args.replicas,
                               local_batch=args.local_batch, gift_rank=args.gift_rank)
    md, selections = pf.profile_markdown(result, args.top_n, cands, args.codec)
    md = f"<!-- {command} -->\n" + md
    (out / "profile.md").write_text(md)
    (out / "profile.json").write_text(json.dumps({"command": command, "profile": result,
                                                   "selections": selections}, indent=1))
    (out / "gift_layers.py").write_text(
        pf.selection_snippet(selections, checkpoints[0], args.codec, args.window, command))
    pf.plot_profile(result, str(out / "profile.png"))
    print(md)
    print(f"wrote {out}/profile.md, profile.json, gift_layers.py, profile.png in "
          f"{time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
