"""What checkpoint checksums cost (:func:`gift_jax.training.checkpoint.checksum_cost`): a
float32 state of ``--params`` values saved and restored with and without the CRC-32
manifest, on this host's CPU and disk; one JSON line (seconds; the checksums' own share).

    python scripts/bench_checkpoint.py --params 1e9 --dir /tmp/ckpt_cost
    python scripts/bench_checkpoint.py --params 1e7 --repeats 1   # a quick look
"""

import argparse
import json
import sys
import tempfile


def main(argv=None) -> int:
    """Runs the measurement and prints it.

    Args:
      argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
      The exit status (0).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="float32 values in the state")
    parser.add_argument("--leaves", type=int, default=8, help="arrays the values are split into")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; the best is reported")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    from gift_jax.training.checkpoint import checksum_cost

    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        result = checksum_cost(scratch, int(args.params), leaves=args.leaves,
                               repeats=args.repeats)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                      for k, v in result.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
