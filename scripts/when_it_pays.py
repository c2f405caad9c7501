"""When the quantized reduction pays on a GPU cluster: the estimated step of the fp8 reduction
(inside the backward) over XLA's own bf16 step and over the fp32 reduction's (the GIFT paper's
baseline, bf16 compute), against tokens per device, for
networks of 100, 200, 400 and 800 Gb/s per GPU, with the TPU rows of docs/pod beside
(:mod:`gift_jax.apps.crossover`). Needs the gpu-aot extra to compile; the plot alone reads
the saved HLO::

    python scripts/when_it_pays.py --hlo /tmp/crossover --out docs     # compiles what is missing
    python scripts/when_it_pays.py --hlo /tmp/crossover --out docs --no_compile

Each (model, global batch, mode) compiles once, in a child process (``compile_pod.py --gpu``);
the HLO folder is reused by later runs.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: The models and global batches drawn: sequences per step of seq_len tokens on 64 GPUs;
#: Llama-7B is sharded over the node's 8 GPUs (fsdp), data-parallel across the 8 nodes.
MODELS = {"gift_llama_600m": ("64,1,1", (64, 128, 512)),
          "llama_7b": ("8,8,1", (64, 256))}
#: TPU tables of docs/pod and their tokens per step (the configs' global batch x sequence
#: length: llama_7b 512 x 2048, llama_1b 512 x 256).
TPU_TOKENS = {"llama_7b_v5p-128": 512 * 2048, "llama_1b_v5p-128": 512 * 256,
              "llama_1b_2xv5e-256": 512 * 256}


def compile_point(model: str, mesh: str, batch: int, hlo: pathlib.Path, gpu: str,
                  hosts: int) -> None:
    """Compiles XLA's own bf16 step and the fp32 and fp8 steps reduced inside the backward
    (hierarchically: a node's replicas first, ``--intra slice``) of ``model`` at global batch
    ``batch`` (one microbatch) into ``hlo``, each unless there."""
    have = {h.name.split("_")[0] for h in hlo.glob("*_ordinary_*.hlo.txt")}
    base = [sys.executable, str(ROOT / "scripts" / "compile_pod.py"), "--config", model,
            "--gpu", gpu, "--hosts", str(hosts), "--mesh", mesh,
            "--hlo", str(hlo), "--set", f"train.global_batch_size={batch}",
            "--set", "train.grad_accum_steps=1"]
    for modes, extra in (("xla_bf16", []), ("fp32,fp8", ["--set", "comm.reduce_in=backward"])):
        if "xla" in modes and "xla" in have or "fp8" in modes and {"fp32", "fp8"} <= have:
            continue
        print(f"compiling {model} batch {batch}: {modes}", flush=True)
        subprocess.run([*base, "--modes", modes, *extra], check=False,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hlo", required=True, help="folder of the compiled steps' HLO texts")
    ap.add_argument("--out", default="docs", help="where the PNG and the table go")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--no_compile", action="store_true", help="plot what --hlo holds")
    args = ap.parse_args(argv)

    from gift_jax.apps import crossover, pod_estimate
    from gift_jax.training.config import load_config
    from gift_jax.utils.gpu import GpuTopologyError, parse_gpu_topology

    try:
        topology = parse_gpu_topology(args.gpu, args.hosts)
    except GpuTopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hlo_root = pathlib.Path(args.hlo)
    if not args.no_compile:
        for model, (mesh, batches) in MODELS.items():
            for batch in batches:
                compile_point(model, mesh, batch, hlo_root / crossover.hlo_name(model, batch),
                              args.gpu, args.hosts)
    seq = {m: load_config(m, ROOT / "configs").train.seq_len for m in MODELS}
    points = crossover.find_points(hlo_root, seq, topology.gpus)
    curves, table = {}, []
    for link in crossover.LINK_SPEEDS:
        cluster = pod_estimate.GpuCluster.of(parse_gpu_topology(args.gpu, args.hosts, None,
                                                                link))
        steps = crossover.step_seconds(points, cluster)
        curves[link] = {b: crossover.ratios(steps, b) for b in ("xla_bf16", "fp32")}
        table += [{"link": link, "model": m, "tokens_per_device": t, "mode": mode,
                   "step_ms": round(s * 1e3, 2)} for (m, t, mode), s in sorted(steps.items())]
    tpu = crossover.tpu_points(ROOT / "docs" / "pod", TPU_TOKENS)
    out = pathlib.Path(args.out)
    crossover.plot(curves, tpu, out / "when_it_pays.png",
                   f"{topology.gpus} x {args.gpu.upper()} ({topology.gpus_per_host} per node): "
                   "fp8 reduced in the backward vs XLA's own step (estimated)")
    (out / "when_it_pays.json").write_text(json.dumps(
        {"command": "python scripts/when_it_pays.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
         "curves": curves, "tpu": [vars(p) for p in tpu], "steps": table}, indent=1))
    for link, by_base in curves.items():
        for baseline, by_model in by_base.items():
            for model, pts in by_model.items():
                print(f"{link} fp8/{baseline} {model}: "
                      + ", ".join(f"{t}: {r:.3f}" for t, r in pts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
