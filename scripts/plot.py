"""Loss curves of several training runs in one PNG.

    python scripts/plot.py runs/a runs/b --labels fp32,gift --out runs/loss.png
"""

import argparse
import os

from gift_jax.apps.plotting import plot_runs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdirs", nargs="+", help="training workdirs (with metrics.jsonl)")
    ap.add_argument("--labels", default=None, help="comma-separated, one per workdir")
    ap.add_argument("--out", default="loss.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.normpath(w))
                                                         for w in args.workdirs]
    if len(labels) != len(args.workdirs):
        ap.error(f"--labels has {len(labels)} names for {len(args.workdirs)} workdirs")
    print(plot_runs(dict(zip(labels, args.workdirs, strict=True)), args.out, args.title))


if __name__ == "__main__":
    main()
