"""Two compiled TPU or GPU steps of one model side by side, op by op: where one step's
estimated compute and exposed communication differ from the other's
(:func:`gift_jax.apps.pod_estimate.compare`). The HLO texts come from ``compile_pod.py --hlo
DIR``::

    python scripts/compile_pod.py --config llama_7b --topology v5p-128 --mesh 4,16,1 \\
        --modes xla_bf16,fp8 --hlo /tmp/hlo --set comm.reduce_in=backward \\
        --set comm.exchange=permute
    python scripts/compare_pod_steps.py /tmp/hlo/xla_bf16_4x16x1_flat_ordinary_-.hlo.txt \\
        /tmp/hlo/fp8_4x16x1_flat_in_backward_ppermute_ordinary_-.hlo.txt --chip v5p
    python scripts/compare_pod_steps.py A.hlo.txt B.hlo.txt --gpu h100 --link ib400
"""

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # reads text only: no accelerator to probe

from gift_jax.apps import pod_estimate  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the first step's compiled HLO text (A)")
    parser.add_argument("b", help="the second step's compiled HLO text (B)")
    parser.add_argument("--chip", default="v5p",
                        help=f"the chips' generation, one of: {', '.join(pod_estimate.CHIPS)}")
    parser.add_argument("--gpu", default=None,
                        help="GPU steps (compile_pod.py --gpu): the GPU, h100 or gh200")
    parser.add_argument("--gpus_per_host", type=int, default=None,
                        help="--gpu: GPUs per node (default: the node's)")
    parser.add_argument("--link", default=None, help="--gpu: the network between nodes")
    parser.add_argument("--top", type=int, default=20, help="op labels to list")
    args = parser.parse_args(argv)
    try:
        if args.gpu:
            from gift_jax.utils.gpu import parse_gpu_topology

            chip = pod_estimate.GpuCluster.of(parse_gpu_topology(
                args.gpu, 1, args.gpus_per_host, args.link))
        else:
            chip = pod_estimate.chip(args.chip)
    except ValueError as e:  # UnknownChipError, GpuTopologyError
        print(f"error: {e}", file=sys.stderr)
        return 2
    a, b = (pod_estimate.replay(pathlib.Path(p).read_text(), 0.0, chip, mesh=None)
            for p in (args.a, args.b))
    print(pod_estimate.compare(a, b, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
