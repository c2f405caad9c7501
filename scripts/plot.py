"""Loss curves of several training runs in one PNG.

    python scripts/plot.py runs/a runs/b --labels fp32,gift --out runs/loss.png
    python scripts/plot.py runs/a/fp8 runs/b/fp8 --reference a/fp8   # + difference panel

With ``--reference``, a markdown table of each run's differences to it is printed as well.

Runs are labelled by the shortest path suffix that tells them apart (``a/fp8``, ``b/fp8``);
no run is dropped. A missing workdir ends with one ``error:`` line (exit status 2).
"""

import argparse
import sys

from gift_jax.apps.plotting import difference_table, path_labels, plot_runs, unique_labels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdirs", nargs="+", help="training workdirs (with metrics.jsonl)")
    ap.add_argument("--labels", default=None, help="comma-separated, one per workdir")
    ap.add_argument("--out", default="loss.png")
    ap.add_argument("--title", default="")
    ap.add_argument("--reference", default=None,
                    help="label of a run to subtract: adds a panel of loss differences to it")
    args = ap.parse_args(argv)
    labels = (unique_labels(args.labels.split(",")) if args.labels
              else path_labels(args.workdirs))
    if len(labels) != len(args.workdirs):
        ap.error(f"--labels has {len(labels)} names for {len(args.workdirs)} workdirs")
    if args.reference is not None and args.reference not in labels:
        ap.error(f"--reference {args.reference!r} is not a run label; labels: "
                 f"{', '.join(labels)}")
    runs = list(zip(labels, args.workdirs, strict=True))
    try:
        png = plot_runs(runs, args.out, args.title, reference=args.reference)
        if args.reference is not None:
            print(difference_table(runs, args.reference))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
