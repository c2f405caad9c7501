"""Compile (never run) the train step of a large config for a pod: per-device memory against
the chip's HBM, bytes per step across the data axis (and across slices), the collective
schedule and compile time, in every communication mode.

With the TPU compiler (``pip install -e ".[tpu]"``: libtpu's compile-only devices, no TPU
needed), for a real topology, one slice or several::

    python scripts/compile_pod.py --config llama_7b --topology v5p-128 --mesh 8,8,1
    python scripts/compile_pod.py --config llama_1b --topology v5e-256 --slices 2 --mesh 32,8,1

Without libtpu, or with ``--devices N``, XLA:CPU compiles on ``N`` simulated CPU devices (the
partitioning is the same, temporaries and schedule are XLA:CPU's)::

    python scripts/compile_pod.py --config llama_1b --devices 64 --mesh 8,8,1 --mesh 8,4,2
    python scripts/compile_pod.py --config tiny --devices 16 --mesh 2,4,2 --set model.num_layers=2

With XLA:GPU (``pip install -e ".[gpu-aot]"``: jax's CUDA plugin and ptxas, no GPU needed),
for ``--hosts`` nodes of a ``--gpu`` (``h100``: 8 per node on NVLink, ``gh200``: 4) joined by
``--link`` (the network per GPU: ``ib100`` ... ``ib800``, ``slingshot200``); ``data`` runs
across the nodes, ``fsdp``/``tensor`` and ``--intra`` replicas inside one::

    python scripts/compile_pod.py --config gift_llama_600m --gpu h100 --hosts 8 --mesh 64,1,1
    python scripts/compile_pod.py --config gift_llama_600m --gpu gh200 --hosts 16 --intra 4

The output says which compiler ran. With ``--topology`` or ``--gpu`` each (mesh, mode)
compiles in a child process (the compiler's host memory is returned after each; a compiler
abort fails one row, not the table; exit status 3 when any did not compile). See
:mod:`gift_jax.apps.pod`.
"""

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama_1b", help="a name in configs/ or a path")
    parser.add_argument("--topology", default=None,
                        help="a TPU slice to compile for with libtpu: v5p-128, v5e-256, "
                             "v6e-64, v4-128 ... or v5p:4x4x4")
    parser.add_argument("--gpu", default=None,
                        help="an NVIDIA GPU to compile for with XLA:GPU: h100, gh200")
    parser.add_argument("--hosts", type=int, default=1, help="--gpu: nodes (data spans them)")
    parser.add_argument("--gpus_per_host", type=int, default=None,
                        help="--gpu: GPUs per node (default: the node's, 8 for h100, 4 gh200)")
    parser.add_argument("--link", default=None,
                        help="--gpu: the network between nodes, per GPU: ib100, ib200, ib400, "
                             "ib800, slingshot200 (default: the GPU's usual one)")
    parser.add_argument("--slices", type=int, default=1,
                        help="slices of --topology (multi-slice: data runs across them)")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulated CPU devices (XLA:CPU; 64 without --topology)")
    parser.add_argument("--mesh", action="append", default=None,
                        help="data,fsdp,tensor, one may be -1 (repeatable; default -1,8,1 with "
                             "--topology (fsdp half the chips on slices under 16), else 8,8,1 "
                             "and 8,4,2)")
    parser.add_argument("--intra", default="slice",
                        help="data replicas that reduce together (in comm.intra_codec) before "
                             "the quantized reduction across the rest (mesh.intra_size): "
                             "'slice' (default: the replicas of one slice when --slices > 1, "
                             "so only the quantized bytes cross the data-centre network; with "
                             "--gpu the replicas of one node when --hosts > 1; flat on one "
                             "slice or node), 1 (flat) or a number")
    parser.add_argument("--modes", default="xla_bf16,xla_fp32,fp32,fp8,gift_fp8,plumage_fp8",
                        help="comma-separated, of: xla_bf16, xla_fp32 (XLA's own reduction: a "
                             "plain jit with shardings, the model in bf16 or fp32), fp32, fp8, "
                             "gift_fp8, plumage_fp8")
    parser.add_argument("--flags", default="default", choices=("default", "maxtext", "both"),
                        help="with --topology or --gpu: compile with the compiler's defaults, "
                             "with the overlap flags maxtext users set (pod.overlap_flags: "
                             "maxtext's TPU flags; on GPU JAX-Toolbox's MaxText flags), or "
                             "both (one row each)")
    parser.add_argument("--refresh", action="store_true",
                        help="also compile the GIFT/PLUMAGE refresh variants")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="config override, e.g. mesh.rules.mlp= or model.num_layers=2")
    parser.add_argument("--out", default=None,
                        help="directory for NAME.json and NAME.md (rows of the same topology, "
                        "mode, mesh, reduction and variant are replaced, others kept)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="with --topology: a TPU compiler option for every row, e.g. "
                             "xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000 "
                             "(repeatable; shown in the flags column)")
    parser.add_argument("--hlo", default=None, metavar="DIR",
                        help="with --topology: also write each row's compiled HLO text to "
                             "DIR (for scripts/compare_pod_steps.py)")
    parser.add_argument("--from_hlo", default=None, metavar="DIR",
                        help="with --gpu and --out: compile nothing; re-estimate the table's rows "
                             "of these GPUs and nodes from their HLO in DIR (--hlo's) on --link")
    parser.add_argument("--in_process", action="store_true",
                        help="with --topology: compile every (mesh, mode) in this process "
                             "instead of one child process each")
    return parser.parse_args(argv)


def _child_rows(argv, mesh: str, mode: str, flags: str) -> tuple[list[dict], str | None]:
    """Compiles one (mesh, mode) in a child process: its rows, or why it failed (one line).
    A child keeps the compiler's memory per configuration (a 7B compile peaks near 15 GB of
    host memory) and survives libtpu aborting on a CHECK."""
    args = [a for a in argv if a not in ("--in_process",)]
    drop = {"--mesh", "--modes", "--out", "--flags"}
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        if a.split("=", 1)[0] in drop:
            continue
        kept.append(a)
    cmd = [sys.executable, __file__, *kept, f"--mesh={mesh}", f"--modes={mode}",
           f"--flags={flags}", "--in_process"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0:
        return rows, None
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")
             or "Check failed" in x or "Error" in x or "Killed" in x]
    reason = lines[-1].strip() if lines else f"exit status {proc.returncode}"
    if proc.returncode < 0:
        reason = f"killed by signal {-proc.returncode} ({reason})"
    return rows, reason[:300]


def compiler_options(pairs: list[str]) -> dict[str, bool | int | float | str]:
    """``--option NAME=VALUE`` pairs as compiler options (``true``/``false``, ints and floats
    parsed; anything else a string)."""
    from gift_jax.training.config import ConfigError

    out: dict[str, bool | int | float | str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(f"--option {pair!r} must be NAME=VALUE")
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                out[name] = kind(value)
                break
            except ValueError:
                pass
        else:
            out[name] = value
    return out


def intra_size(intra: str, data: int, slices: int) -> int:
    """``mesh.intra_size`` from ``--intra`` for ``data`` replicas on ``slices`` slices (or
    GPU nodes)."""
    if intra == "slice":
        return data // slices if slices > 1 else 1
    try:
        return int(intra)
    except ValueError:
        from gift_jax.training.config import ConfigError

        raise ConfigError(f"--intra={intra!r} must be 'slice' or an int") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    if sum(bool(x) for x in (args.topology, args.devices, args.gpu)) > 1:
        print("error: --topology (TPU compiler), --gpu (XLA:GPU) and --devices (simulated CPU "
              "devices) exclude each other", file=sys.stderr)
        return 2
    devices = args.devices or (None if args.topology or args.gpu else 64)
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from gift_jax.utils.cpu_devices import simulate_cpu_devices

    if devices:
        simulate_cpu_devices(devices)  # an XLA_FLAGS count set before this script wins

    from gift_jax.apps.pod import (
        MODES,
        XLA_MODES,
        compile_mode,
        markdown_table,
        mode_config,
        overlap_flags,
    )
    from gift_jax.apps.pod_estimate import chip
    from gift_jax.training.config import ConfigError, apply_overrides, load_config
    from gift_jax.training.mesh import device_grid, mesh_shape
    from gift_jax.utils import gpu, tpu

    configs = pathlib.Path(__file__).resolve().parent.parent / "configs"
    try:
        topology = None
        if args.gpu:
            topology = gpu.parse_gpu_topology(args.gpu, args.hosts, args.gpus_per_host,
                                              args.link)
            pod = gpu.topology_devices(topology)
            spec = topology.spec
            print(f"compiler: XLA:GPU (jax's CUDA plugin, ptxas), {topology.label}: {len(pod)} "
                  f"GPUs of {pod[0].device_kind}, {spec.memory_bytes / 2**30:.1f} GiB each",
                  flush=True)
        elif args.topology:
            topology = tpu.parse_topology(args.topology, args.slices)
            chip(topology.generation, multislice=topology.slices > 1)  # its bandwidths known
            pod = tpu.topology_devices(topology)
            print(f"compiler: TPU (libtpu), {topology.label}: {len(pod)} chips of "
                  f"{pod[0].device_kind}, {tpu.HBM_GIB[topology.generation]} GiB HBM each",
                  flush=True)
        else:
            if len(jax.devices()) != devices:
                raise ConfigError(f"--devices={devices} but JAX sees {len(jax.devices())} "
                                  "devices (XLA_FLAGS was set before this script)")
            pod = jax.devices()
            print(f"compiler: XLA:CPU on {devices} simulated devices (no TPU compiler: "
                  "temporaries and schedule are XLA:CPU's)", flush=True)
        config = load_config(args.config, configs)
        config = apply_overrides(config, [tuple(s.split("=", 1)) for s in args.set])
        if args.from_hlo:
            if not (args.gpu and args.out):
                raise ConfigError("--from_hlo re-estimates a --gpu table: give --gpu and --out")
            return _reestimate(args, topology, config)
        extra = compiler_options(args.option)
        modes = args.modes.split(",")
        unknown = [m for m in modes if m not in {**MODES, **XLA_MODES}]
        if unknown:
            raise ConfigError(f"--modes {unknown} unknown; allowed: "
                              f"{', '.join([*XLA_MODES, *MODES])}")
        flag_sets = {"default": ["default"], "maxtext": ["maxtext"],
                     "both": ["default", "maxtext"]}[args.flags if topology else "default"]
        generation = "gpu" if args.gpu else getattr(topology, "generation", "")
        n = len(pod)  # default with --topology: fsdp 8 (fewer on small slices), data the rest
        default = [f"-1,{8 if n >= 16 else max(1, n // 2)},1"] if topology is not None \
            else ["8,8,1", "8,4,2"]
        meshes = []
        for text in args.mesh or default:
            try:
                data, fsdp, tensor = (int(v) for v in text.split(","))
            except ValueError:
                raise ConfigError(f"--mesh {text!r} must be data,fsdp,tensor (ints; one may "
                                  "be -1)") from None
            try:
                sizes = mesh_shape(len(pod), data, fsdp, tensor)
            except ValueError as e:
                raise ConfigError(f"--mesh {text!r} does not divide the {len(pod)} devices of "
                                  f"{topology.label if topology else 'this host'}: {e}"
                                  ) from None
            meshes.append((sizes["data"], sizes["fsdp"], sizes["tensor"]))
            device_grid(meshes[-1], pod)  # one line if it does not fit the chips (or slices)
            granules = args.hosts if args.gpu else args.slices
            for mode in modes:  # settings errors here, as one line, not as failed children
                mode_config(config, mode, meshes[-1], len(pod),
                            1 if mode in XLA_MODES else
                            intra_size(args.intra, meshes[-1][0], granules))
        rows, failed = [], []
        for mesh in meshes:
            for mode, flags in ((m, f) for m in modes for f in flag_sets):
                if topology is not None and not args.in_process:
                    got, reason = _child_rows(sys.argv[1:] if argv is None else list(argv),
                                              ",".join(map(str, mesh)), mode, flags)
                    if reason:
                        failed.append(f"{mode} ({flags} flags) on "
                                      f"{'x'.join(map(str, mesh))}: {reason}")
                        print(f"error: {failed[-1]}", file=sys.stderr, flush=True)
                else:
                    options = overlap_flags(generation) if flags == "maxtext" else {}
                    options.update(extra)
                    name = "jax-toolbox" if args.gpu else "maxtext"
                    label = "+".join(([name] if flags == "maxtext" else [])
                                     + [f"{k}={v}" for k, v in extra.items()]) or "-"
                    granules = args.hosts if args.gpu else args.slices
                    got = [r.row() for r in compile_mode(
                        config, mode, mesh, pod, refresh=args.refresh, topology=topology,
                        intra=1 if mode in XLA_MODES  # XLA's own reduction: one axis
                        else intra_size(args.intra, mesh[0], granules),
                        compiler_options=options or None, flags_label=label,
                        hlo_dir=args.hlo)]
                for row in got:
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    except (ConfigError, ValueError) as e:  # TopologyError, GpuTopologyError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(rows)
    if failed:
        table += "\n\nDid not compile:\n" + "\n".join(f"- {f}" for f in failed)
    print(table)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = _table_name(args.config, topology)
        rows = merge_rows(out / f"{name}.json", rows)
        (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
        (out / f"{name}.md").write_text(markdown_table(rows) + "\n")
    return 3 if failed else 0


def _table_name(config: str, topology) -> str:
    """``--out``'s file stem of a config's table on a topology."""
    name = pathlib.Path(config).stem
    if topology is not None:
        name += "_" + re.sub(r"[^\w.-]+", "", topology.label.replace(" x ", "x"))
    return name


def _reestimate(args, topology, config) -> int:
    """``--from_hlo``: the rows of every table of these GPUs and nodes in ``--out`` whose HLO
    is in the folder, replayed on ``--link``, written to this link's table."""
    from gift_jax.apps.pod import markdown_table, reestimate_gpu_rows

    out = pathlib.Path(args.out)
    rows = []
    stem = _table_name(args.config, topology)
    prefix = stem[:stem.rindex(topology.link) - 1] if topology.link in stem else stem
    for path in sorted(out.glob(f"{prefix}*.json")):
        rows += reestimate_gpu_rows(json.loads(path.read_text()), pathlib.Path(args.from_hlo),
                                    topology, config)
    if not rows:
        print(f"error: no rows of {topology.label} with HLO in {args.from_hlo} in {out}",
              file=sys.stderr)
        return 2
    merged = merge_rows(out / f"{stem}.json", rows)
    (out / f"{stem}.json").write_text(json.dumps(merged, indent=1))
    (out / f"{stem}.md").write_text(markdown_table(merged) + "\n")
    print(markdown_table(rows))
    return 0


#: What identifies a row of a table in --out: a later compile of the same key replaces it.
ROW_KEY = ("compiler", "topology", "mode", "mesh", "reduction", "variant", "flags")


def merge_rows(path: pathlib.Path, rows: list[dict]) -> list[dict]:
    """The rows already in ``path`` (if any) with those of ``rows`` replacing the ones of the
    same :data:`ROW_KEY` in place, and new ones appended: a table is rewritten row by row."""
    old = json.loads(path.read_text()) if path.exists() else []
    fresh = {tuple(r.get(k) for k in ROW_KEY): r for r in rows}
    merged = [fresh.pop(tuple(r.get(k) for k in ROW_KEY), r) for r in old]
    return merged + list(fresh.values())


if __name__ == "__main__":
    sys.exit(main())
