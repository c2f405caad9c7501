"""GIFT-FP8 step cost as a ratio to the plain FP8 all-reduce in the same run, plus the added
FLOPs at the paper's GIFT-600M shapes (analytic).

Runs the GIFT stage (whiten → FP8 all-reduce → unwhiten) and the plain FP8 all-reduce inside
``jax.shard_map`` over the 'data' axis (8 simulated CPU devices when there is no accelerator),
on tiny-model gradients (GIFT on the down_proj layers) and on one GIFT-600M down_proj shape.

    python scripts/bench_gift.py --out /tmp/gift_exp/bench
"""

import argparse
import json
import pathlib
import sys

from gift_jax.utils.cpu_devices import simulate_cpu_devices

simulate_cpu_devices(8)  # a data-parallel mesh on a CPU host (an XLA_FLAGS count wins)

import jax  # noqa: E402

from gift_jax.apps.experiments import profile as pf  # noqa: E402
from gift_jax.apps.experiments import roundtrip as rt  # noqa: E402
from gift_jax.models import count_params, model_config_of, param_shapes  # noqa: E402
from gift_jax.training.config import load_config  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--codec", default="fp8_e4m3")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--refresh_every", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--large_eig", default="subspace", choices=("eigh", "subspace"),
                    help="eigensolver of the refresh on the 600M shape")
    ap.add_argument("--skip_large", action="store_true", help="only the tiny model")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(["scripts/bench_gift.py", *(argv or sys.argv[1:])])

    tiny = model_config_of(load_config("tiny", CONFIGS).model)
    shapes = {p: tuple(s.shape) for p, s in param_shapes(tiny, flat=True).items()}
    rows = []
    r = pf.bench_gift_step(shapes, ["*/mlp/down_proj"], rank=args.rank, codec=args.codec,
                           eig_method="eigh", refresh_every=args.refresh_every,
                           repeats=args.repeats)
    rows.append({"case": f"tiny, all grads, GIFT on 4 down_proj (344x128), rank {args.rank}",
                 **r})
    print(rows[-1], flush=True)
    if not args.skip_large:
        r = pf.bench_gift_step({"layers/0/mlp/down_proj/kernel": (3456, 1280)},
                               ["*/mlp/down_proj"], rank=args.rank, codec=args.codec,
                               eig_method=args.large_eig, refresh_every=args.refresh_every,
                               repeats=args.repeats)
        rows.append({"case": f"600M down_proj 3456x1280, rank {args.rank}, "
                             f"refresh {args.large_eig}", **r})
        print(rows[-1], flush=True)
    big = model_config_of(load_config("gift_llama_600m", CONFIGS).model)
    params = count_params(big)
    tokens = 512 * 2048 // 8
    fl = pf.gift_flops(big.d_ff, big.d_model, rank=args.rank, layers=13,
                       refresh_every=args.refresh_every, tokens_per_device=tokens,
                       model_params=params)
    md = [f"<!-- {command} -->",
          f"platform {jax.default_backend()}, {len(jax.devices())} devices; codec {args.codec}",
          pf.cost_markdown(rows),
          f"Analytic added FLOPs per device, GIFT-600M ({params:,} params), 13 down_proj layers "
          f"{big.d_ff}x{big.d_model}, rank {args.rank}, K={args.refresh_every}, "
          f"{tokens} tokens/device/step (global batch 512 x 2048 over 8 replicas):",
          "",
          rt.markdown_table([{"quantity": k, "value": v} for k, v in fl.items()],
                            ["quantity", "value"])]
    (out / "bench_gift.md").write_text("\n".join(md) + "\n")
    (out / "bench_gift.json").write_text(json.dumps({"command": command, "rows": rows,
                                                     "flops": fl}, indent=1, default=str))
    print("\n".join(md))


if __name__ == "__main__":
    main()
