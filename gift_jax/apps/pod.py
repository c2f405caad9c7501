"""Pod-scale evidence without a pod: compile (never run) the train step of a large config for
a pod's devices and read per-device memory, cross-replica bytes and the collective schedule.

The step is the trainer's own (:class:`~gift_jax.training.program.Program`), with every
array abstract, so a 7B model needs no memory beyond the compiler's. Two compilers:

* **the TPU compiler** (``devices`` from :func:`gift_jax.utils.tpu.topology_devices`, libtpu's
  compile-only devices of a real slice or multi-slice job): the program a pod would run —
  HBM buffer assignment, Mosaic kernels, the latency-hiding scheduler;
* **XLA:CPU** on simulated CPU devices (``--xla_force_host_platform_device_count``), the
  fallback without libtpu: the partitioning is the same, temporaries and schedule are not.

From the compiled executable:

* memory per device (``compiled.memory_analysis()``): arguments (parameters, optimizer
  state, batch), temporaries (activations, gradients, buffers of the collectives), outputs not
  aliased to donated arguments;
* bytes per device and step across the ``data`` axis, from the HLO's collectives whose groups
  span ``data`` (:meth:`gift_jax.WireReport.over`), against an fp32 all-reduce of the same
  local shard and against an fp32 all-reduce of the whole model (replicated data parallelism);
  and the bytes of GSPMD's collectives inside a replica (``fsdp``/``tensor``: gathered
  weights, reduced activations and gradients, and what GIFT/PLUMAGE add there);
* on a multi-slice job, the bytes sent across slices over the data-centre network (DCN,
  :func:`dcn_bytes`) and those of the collectives inside a slice (ICI);
* from the scheduled HLO (:func:`schedule_overlap`), whether the collectives across ``data``
  are asynchronous (``*-start``/``*-done`` pairs), how many compute ops the scheduler put
  between each start and its done, and how many of the step's matmul-bearing ops come after
  the reduction starts.

What a CPU compile does and does not tell: the partitioning (which arrays are split, which
collectives GSPMD inserts, the quantized reduction's bytes) is decided before the backend and
is the same for GPU/TPU; the sizes of arguments are exact. Temporaries depend on the backend's
scheduler and fusion (XLA:GPU and TPU schedule, fuse and rematerialise differently), so they
are an estimate; time is not measured.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax
from gift_jax.apps import pod_estimate
from gift_jax.comm.codecs import get_codec
from gift_jax.comm.wire import COLLECTIVE_KINDS, array_bytes, computations, executions
from gift_jax.models import count_params
from gift_jax.training.config import (
    ConfigError,
    complete_config,
    resolve_comm_mode,
    set_fields,
    validate_config,
)
from gift_jax.training.mesh import (
    batch_axes,
    data_axes,
    data_parallel_size,
    mesh_from_config,
    model_axes,
)
from gift_jax.training.method import build_optimizer
from gift_jax.training.program import Program
from gift_jax.training.sharding import shardings, state_specs
from gift_jax.training.step import _local_loss_and_grads, loss_for, model_def_of

#: The communication modes compiled by default: ``label → (comm.codec, comm.method)``, from
#: :data:`gift_jax.training.config.COMM_MODES` with fp8_e4m3 as the low-precision codec.
MODES: dict[str, tuple[str, str]] = {
    label: resolve_comm_mode(mode, "fp8_e4m3")
    for label, mode in (("fp32", "fp32"), ("fp8", "fp8"), ("gift_fp8", "gift_fp8"),
                        ("plumage_fp8", "plumage"))
}
#: The baselines users have: XLA's own gradient reduction (a plain ``jax.jit`` with the
#: parameters' shardings, no ``shard_map``), with the model computing in ``label → dtype``
#: (``model.dtype``; in bf16 XLA reduces the bf16 cotangents, in fp32 the fp32 ones).
XLA_MODES: dict[str, str] = {"xla_bf16": "bfloat16", "xla_fp32": "float32"}

#: The TPU flags maxtext sets for data-parallel overlap (its ``benchmarks`` flag sets), per
#: chip generation: the async collective fusion family is refused outside v5e by libtpu
#: ("not supported/recommended on platforms other than TPU v5e").
OVERLAP_FLAGS: dict[str, dict[str, bool]] = {
    "common": {"xla_tpu_enable_data_parallel_all_reduce_opt": True,
               "xla_tpu_data_parallel_opt_different_sized_ops": True,
               "xla_tpu_overlap_compute_collective_tc": True,
               "xla_enable_async_all_gather": True},
    "v5e": {"xla_tpu_enable_async_collective_fusion": True,
            "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
            "xla_tpu_enable_async_collective_fusion_multiple_steps": True},
}


#: The XLA:GPU flags NVIDIA's JAX-Toolbox recommends for MaxText on H100 (its
#: ``docs/frameworks/maxtext/README.md``; ``docs/GPU_performance.md`` explains each): the
#: latency-hiding scheduler, combine thresholds that make one collective of a layer's
#: gradients, pipelined (loop-carried) all-gathers, reduce-scatters and all-reduces, double
#: buffering of scanned loops, and no rematerialization pass. XLA in jax 0.12 has no
#: ``xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}`` options any more
#: ("No such compile option"): optimization level O1 enables the pipelining, as
#: ``GPU_performance.md`` now says, so it stands for them here. (The README's
#: ``xla_gpu_enable_command_buffer=`` is a runtime setting, left out of a compile.)
GPU_OVERLAP_FLAGS: dict[str, bool | int | str] = {
    "optimization_level": "O1",
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30,
    "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 27,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_all_gather_combine_by_dim": False,
    "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    "xla_disable_hlo_passes": "rematerialization",
}


def overlap_flags(generation: str) -> dict[str, bool | int | str]:
    """The overlap flags maxtext users set: maxtext's data-parallel flags for a TPU generation
    (:data:`OVERLAP_FLAGS`), JAX-Toolbox's MaxText flags on GPU (:data:`GPU_OVERLAP_FLAGS`).

    Args:
      generation: ``v4``, ``v5e``, ``v5p``, ``v6e`` or ``gpu``.

    Returns:
      The compiler options.
    """
    if generation == "gpu":
        return dict(GPU_OVERLAP_FLAGS)
    return {**OVERLAP_FLAGS["common"], **OVERLAP_FLAGS.get(generation, {})}


@dataclasses.dataclass(frozen=True)
class Overlap:
    """How the scheduler placed the collectives across ``data`` (see :func:`schedule_overlap`)."""

    collectives: int  # collectives across data in the scheduled HLO
    asynchronous: int  # of them, split into a *-start/*-done pair
    compute_between: tuple[int, ...]  # compute ops between each async start and its done
    matmuls: int  # matmul-bearing ops (dots, their fusions, loops over them) in that schedule
    matmuls_after: int  # of them, scheduled after the first collective across data starts


_OP = re.compile(r"^\s*(?:ROOT\s+)?(?P<name>%?[\w.\-]+)\s*=\s*.+?\s+(?P<op>[\w\-]+)\(")
_COMPUTE = ("fusion", "convolution", "dot", "custom-call")


def _is_matmul(line: str, computations: dict[str, list[str]], depth: int = 3) -> bool:
    """A convolution/dot, or a fusion, call or loop (a scan over layers) whose computation
    holds one."""
    m = _OP.match(line)
    if m is None:
        return False
    if m.group("op") in ("convolution", "dot"):
        return True
    if depth == 0 or m.group("op") not in ("fusion", "call", "while", "conditional"):
        return False
    called = re.findall(r"(?:calls|body|to_apply|branch_computations)=\{?(%?[\w.\-]+)", line)
    return any(_is_matmul(x, computations, depth - 1)
               for name in called for x in computations.get(name.lstrip("%"), ()))


def schedule_overlap(hlo_text: str, mesh, axes: Sequence[str]) -> Overlap:
    """Reads the scheduled HLO (``compiled.as_text()``) of the computation holding the most
    collectives across ``axes``: how many of them are asynchronous, the compute ops
    (fusions, matmuls, kernels) between each ``*-start`` and its ``*-done``, and how many of
    its matmul-bearing ops (the backward pass's, and any after the reduction) are scheduled
    after the first of those collectives starts: a reduction overlapped with the backward
    pass would leave most of them after it.

    Args:
      hlo_text: the compiled module's text (``compiled.as_text()``, scheduled order).
      mesh: the mesh it was compiled for (maps replica groups to mesh axes).
      axes: the mesh axes whose collectives count (the data axes).

    Returns:
      The :class:`Overlap` of that computation; all zeros when no collective spans ``axes``.
    """
    comps, _ = computations(hlo_text)
    best = None
    for body in comps.values():
        ops = []
        for i, line in enumerate(body):
            m = _OP.match(line)
            if m is None or m.group("op").removesuffix("-start") not in COLLECTIVE_KINDS:
                continue
            report = gift_jax.parse_hlo(line, mesh=mesh)
            if report.ops and set(report.ops[0].axes) & set(axes):
                ops.append((i, m))
        if ops and (best is None or len(ops) > len(best[1])):
            best = (body, ops)
    if best is None:
        return Overlap(0, 0, (), 0, 0)
    body, ops = best
    matmuls = [i for i, line in enumerate(body) if _is_matmul(line, comps)]
    between = []
    for i, m in ops:
        if not m.group("op").endswith("-start"):
            continue
        name = m.group("name")
        done = next((j for j in range(i + 1, len(body)) if "-done(" in body[j]
                     and re.search(rf"-done\([^)]*{re.escape(name)}\b", body[j])), len(body))
        between.append(sum(1 for x in body[i + 1:done] if _OP.match(x)
                           and _OP.match(x).group("op") in _COMPUTE))
    first = ops[0][0]
    return Overlap(len(ops), len(between), tuple(between), len(matmuls),
                   sum(1 for i in matmuls if i > first))


@dataclasses.dataclass(frozen=True)
class PodCompile:
    """One compiled step variant on one mesh."""

    mode: str
    mesh: tuple[int, int, int]  # (data, fsdp, tensor)
    refresh: bool
    params: int
    argument_bytes: int  # per device
    temp_bytes: int  # per device
    output_bytes: int  # per device, not aliased to donated arguments
    data_bytes: float  # per device and step, collectives spanning 'data' (inside slices)
    model_bytes: float  # per device and step, collectives inside a replica (fsdp/tensor)
    fp32_local_bytes: float  # an fp32 ring all-reduce of this device's shard over 'data'
    fp32_replicated_bytes: float  # an fp32 ring all-reduce of the whole model over all devices
    compile_s: float
    compiler: str = "XLA:CPU"  # "TPU" (libtpu), "XLA:GPU" or "XLA:CPU" (simulated devices)
    topology: str = ""  # e.g. "v5p-128", "2 x v5e-256", "8 x 8 H100 (ib400)"; "" simulated
    hbm_bytes: int = 0  # one chip's HBM (0: unknown, simulated devices)
    dcn_bytes: float = 0.0  # per device and step, sent across slices (MegaScale send/recv)
    ici_bytes: float = 0.0  # per device and step, collectives inside a slice (multi-slice)
    overlap: Overlap | None = None
    expected_argument_bytes: int = 0  # (parameters + optimizer state) per device, ideal
    intra: int = 1  # replicas reducing together first (mesh.intra_size); 1: flat
    estimate: pod_estimate.Replay | None = None  # the step time (TPU compiler only)
    flags: str = "-"  # "maxtext": compiled with overlap_flags(); "-": the defaults
    schedule: str = ""  # ", in backward" (comm.reduce_in) and ", ppermute" (comm.exchange)
    quantized: str = ""  # what crosses the wire in low precision: "data", "fsdp grads", ...
    network_bytes: float = 0.0  # per device and step, collectives whose groups span GPU nodes
    kernels: int = -1  # Pallas kernels compiled into the program (-1: not counted, XLA:CPU)

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes

    def row(self) -> dict[str, Any]:
        gib = lambda b: round(b / 2**30, 3)
        row = {"compiler": self.compiler, "topology": self.topology or "-", "mode": self.mode,
               "mesh": "x".join(map(str, self.mesh)),
               "reduction": ("flat" if self.intra == 1 else f"{self.intra} first")
               + self.schedule,
               **({"quantized": self.quantized} if self.quantized else {}),
               "variant": "refresh" if self.refresh else "ordinary",
               "args_GiB": gib(self.argument_bytes), "temp_GiB": gib(self.temp_bytes),
               "total_GiB": gib(self.total_bytes)}
        if self.hbm_bytes:
            row["HBM_used"] = round(self.total_bytes / self.hbm_bytes, 3)
        if self.expected_argument_bytes:
            row["args_vs_ideal"] = round(self.argument_bytes / self.expected_argument_bytes, 3)
        across = self.data_bytes + self.dcn_bytes  # in-slice parts + what leaves the slice
        ratio = lambda ref: round(across / ref, 4) if ref else "-"  # data = 1: no reduction
        row.update({"data_MiB": round(across / 2**20, 1),
                    "replica_MiB": round(self.model_bytes / 2**20, 1),
                    "vs_fp32_shard": ratio(self.fp32_local_bytes),
                    "vs_replicated_dp": ratio(self.fp32_replicated_bytes)})
        if self.dcn_bytes or self.ici_bytes:
            row["dcn_MiB"] = round(self.dcn_bytes / 2**20, 1)
            row["ici_MiB"] = round(self.ici_bytes / 2**20, 1)
        if self.compiler == "XLA:GPU":
            row["net_MiB"] = round(self.network_bytes / 2**20, 1)
        if self.kernels >= 0:
            row["kernels"] = self.kernels
        if self.overlap is not None:
            o = self.overlap
            row["async"] = f"{o.asynchronous}/{o.collectives}"
            row["overlap_ops"] = (f"{min(o.compute_between)}-{max(o.compute_between)}"
                                  if o.compute_between else "-")
            row["matmuls_after_reduction"] = f"{o.matmuls_after}/{o.matmuls}"
        if self.estimate is not None:
            row.update(estimate_columns(self.estimate, self.compiler, self.flags))
        row["compile_s"] = round(self.compile_s, 1)
        return row


def estimate_columns(e: pod_estimate.Replay, compiler: str, flags: str) -> dict[str, Any]:
    """A row's step-time columns from its replayed schedule: the flags it was compiled with,
    the compiler's own ``optimal_ms`` (TPU), compute, each link's time (TPU: ICI and DCN;
    GPU: NVLink and the network between nodes), exposed communication, the step, and the share
    of the data-axis reduction that compute covers.

    Args:
      e: the replay.
      compiler: the row's compiler (``"TPU"`` or ``"XLA:GPU"``).
      flags: the row's flags label.

    Returns:
      The columns, in table order.
    """
    ms = lambda t: float(f"{t * 1e3:.4g}")
    axes = ("data", "intra")
    data_comm = e.comm_s(axes=axes) + e.comm_s("DCN")
    data_stall = e.stall_s(axes=axes) + e.stall_s("DCN")
    links = (("ici_ms", "ICI"), ("dcn_ms", "DCN")) if compiler == "TPU" else (
        ("nvlink_ms", "NVLink"), ("net_ms", None))
    out: dict[str, Any] = {"flags": flags}
    if compiler == "TPU":
        out["optimal_ms"] = ms(e.optimal_seconds)
    out["compute_ms"] = ms(e.compute_s)
    for key, link in links:  # the network: every link but NVLink
        out[key] = ms(e.comm_s(link) if link else e.comm_s() - e.comm_s("NVLink"))
    out.update({"exposed_ms": ms(e.exposed_s), "step_ms": ms(e.step_s),
                "data_covered": round(max(0.0, 1 - data_stall / data_comm), 3)
                if data_comm else "-"})
    return out


def reestimate_gpu_rows(rows: Sequence[dict[str, Any]], hlo_dir: pathlib.Path, topology,
                        config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
    """The GPU rows of a table re-estimated on another network, from their saved HLO (no
    compile): the rows compiled for ``topology``'s GPUs and nodes (any link) whose HLO file
    (:func:`hlo_file_name`) is in ``hlo_dir``, their step-time columns replayed on
    ``topology``'s link and their topology label changed to it.

    Args:
      rows: a table's rows (``compile_pod.py --out``'s JSON).
      hlo_dir: where ``compile_pod.py --hlo`` wrote the rows' HLO texts.
      topology: the :class:`gift_jax.utils.gpu.GpuTopology` to estimate on.
      config: a trainer config (only its ``mesh`` group is set from each row).

    Returns:
      The re-estimated rows (the others are left out).
    """
    from gift_jax.utils import gpu

    devices = gpu.topology_devices(topology)
    cluster = pod_estimate.GpuCluster.of(topology)
    same = re.sub(r"\(\w+\)$", "", topology.label).strip()
    out = []
    for row in rows:
        path = hlo_dir / hlo_file_name(row)
        if (row.get("compiler") != "XLA:GPU" or not path.exists()
                or re.sub(r"\(\w+\)$", "", row["topology"]).strip() != same):
            continue
        shape = tuple(int(v) for v in row["mesh"].split("x"))
        intra = 1 if row["reduction"].startswith("flat") else int(row["reduction"].split()[0])
        sizes = dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), shape, strict=True))
        mesh = mesh_from_config(set_fields(complete_config(config), {
            **sizes, "mesh.intra_size": intra}).mesh, devices)
        e = pod_estimate.replay(path.read_text(), 0.0, cluster, mesh)
        out.append({**row, "topology": topology.label,
                    **estimate_columns(e, "XLA:GPU", row["flags"])})
    return out


def _state_bytes(step, mesh) -> int:
    """(parameters + optimizer state) / (fsdp · tensor): the ideal per-device share of the
    step's state when the model axes split all of it."""
    params, opt_state, _ = step.abstract_args()
    total = sum(math.prod(x.shape) * x.dtype.itemsize
                for x in jax.tree.leaves((params, opt_state)))
    return int(total / math.prod(mesh.shape[a] for a in model_axes(mesh)))


_DCN_SEND = re.compile(r"=\s*\((?P<type>.*)\)\s+send\(.*xla_megascale_runtime")


def dcn_bytes(hlo_text: str) -> float:
    """Bytes one device sends across slices per step: on a multi-slice TPU job the compiler
    splits each collective whose groups span slices into an ICI collective inside the slice
    and host-transfer ``send``/``recv`` pairs through the MegaScale runtime (the DCN); this
    sums the ``send`` payloads, each times the executions of its computation per step (a
    send inside the scanned layers' backward loop runs once per layer).

    Args:
      hlo_text: the compiled module's text (``compiled.as_text()``).

    Returns:
      The summed payload bytes of the MegaScale ``send`` ops (0.0 on a single slice).
    """
    comps, _ = computations(hlo_text)
    runs = executions(hlo_text)
    total = 0.0
    for comp, lines in comps.items():
        for line in lines:
            m = _DCN_SEND.search(line)
            if m:
                arrays = array_bytes(m.group("type"))  # the payload, then a u32 and a token
                total += (arrays[0][1] if arrays else 0) * runs.get(comp, 1)
    return total


#: The compilers of compile-only devices, by platform.
COMPILERS = {"tpu": "TPU", "gpu": "XLA:GPU"}
_KERNEL = re.compile(r'custom_call_target="(?:tpu_custom_call|__gpu\$xla\.gpu\.triton|'
                     r'mosaic_gpu[\w]*)"')


def pallas_kernels(hlo_text: str) -> int:
    """Pallas kernels compiled into a program: its Mosaic (``tpu_custom_call``), Triton
    (``__gpu$xla.gpu.triton``, compiled through ptxas) and Mosaic GPU custom calls.

    Args:
      hlo_text: the compiled module's text.

    Returns:
      The number of those custom calls in the module (each call site once).
    """
    return len(_KERNEL.findall(hlo_text))


def across_hosts(report: gift_jax.WireReport, mesh) -> float:
    """Bytes per device of the collectives whose groups span GPU nodes (processes): what
    crosses the network between nodes.

    Args:
      report: the step's wire report (parsed with ``mesh``: its groups are positions in the
        mesh's device order).
      mesh: the mesh the step was compiled for.

    Returns:
      The summed wire bytes of those collectives.
    """
    devices = mesh.devices.reshape(-1)
    return float(sum(op.wire_bytes for op in report.ops
                     if len({devices[i].process_index for i in op.group}) > 1))


def mode_config(config: ml_collections.ConfigDict, mode: str, mesh_shape: Sequence[int],
                num_devices: int, intra: int = 1) -> ml_collections.ConfigDict:
    """``config`` with the codec and method of ``mode`` (a key of :data:`MODES`) on a
    ``(data, fsdp, tensor)`` mesh whose ``data`` replicas reduce in groups of ``intra`` first
    (``mesh.intra_size``; 1: flat), validated for ``num_devices`` (raises ``ConfigError``).

    Args:
      config: a trainer config (completed here; not changed).
      mode: a key of :data:`MODES` (``fp32``, ``fp8``, ``gift_fp8``, ``plumage_fp8``).
      mesh_shape: ``(data, fsdp, tensor)`` sizes.
      num_devices: the devices the mesh must cover.
      intra: data replicas that reduce together first (``mesh.intra_size``).

    Returns:
      The completed config with ``comm.codec``, ``comm.method`` and the ``mesh`` sizes set.

    Raises:
      ConfigError: ``mode`` is not a key of :data:`MODES`, or a setting is invalid for
        ``num_devices`` (e.g. the mesh does not cover them).
    """
    if not isinstance(mode, str) or mode not in {**MODES, **XLA_MODES}:
        raise ConfigError(f"mode={mode!r} is not supported; allowed modes: "
                          f"{', '.join([*MODES, *XLA_MODES])}")
    codec, method = MODES.get(mode, ("fp32", "none"))
    data, fsdp, tensor = mesh_shape
    fields = {"comm.codec": codec, "comm.method": method, "mesh.data": data, "mesh.fsdp": fsdp,
              "mesh.tensor": tensor, "mesh.intra_size": intra}
    if mode in XLA_MODES:
        fields["model.dtype"] = XLA_MODES[mode]
    config = set_fields(complete_config(config), fields)
    validate_config(config, num_devices)
    return config


def _mesh_context(mesh):
    """The context that gives bare ``PartitionSpec`` constraints their mesh (``jax.set_mesh``;
    ``jax.sharding.use_mesh`` on older JAX)."""
    return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


def _on_auto_mesh(tree, mesh):
    """``tree``'s abstract arrays with their shardings moved to ``mesh`` with every axis
    ``Auto`` (a plain GSPMD ``jit``: the trainer's data-parallel mesh has ``Explicit`` axes,
    whose sharding-in-types the model's gathers do not resolve outside ``shard_map``)."""
    auto = Mesh(mesh.devices, mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    moved = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(auto, x.sharding.spec)), tree)
    return moved, auto


def xla_step(program: Program) -> jax.stages.Lowered:
    """The run's train step with XLA's own gradient reduction: a plain ``jax.jit`` with the
    parameters', optimizer state's and batch's shardings and no ``shard_map``, so GSPMD
    inserts the reduction (in the cotangents' dtype) where the partitioner puts it. Same
    model, loss, accumulation and optimizer chain as the trainer's step (its all-reduce
    stage is the identity here: built without an axis).

    Args:
      program: a :class:`Program` whose ``comm.codec`` is ``fp32`` and ``comm.method`` none
        (see :func:`mode_config` with a key of :data:`XLA_MODES`).

    Returns:
      The lowered step ``(params, opt_state, batch) → (params, opt_state, loss)``.
    """
    mesh, recipe, layout = program.mesh, program.recipe, program.layout
    # rows are split over every batch axis here (data too), not over fsdp alone; a
    # data-parallel mesh has no activation rules in the trainer (its step is manual over every
    # axis), but a plain jit needs the batch rule: it places the Pallas attention kernel's
    # shard_map (without it the kernel runs replicated and GSPMD gathers every activation)
    rules = dict(program.model_config.activation_axes)
    rules["batch"] = ",".join(batch_axes(mesh))
    rules = tuple(rules.items())
    model_config = dataclasses.replace(program.model_config, activation_axes=rules)
    model_def = model_def_of(model_config)
    optimizer = build_optimizer(recipe, (None,))
    params, _, batch = program.step.abstract_args()
    opt_state = jax.eval_shape(optimizer.tx.init, params)
    opt_shardings = shardings(state_specs(opt_state, layout, mesh), mesh)
    accum, sharded = recipe.grad_accum_steps, bool(model_axes(mesh))
    loss_fn = loss_for(model_def, mesh)

    def step(params, opt_state, tokens):
        loss, grads, _ = _local_loss_and_grads(model_def, tokens, params, accum, (), False,
                                               sharded, loss_fn)
        updates, opt_state = optimizer.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_state,
        opt_shardings)
    args, auto = _on_auto_mesh((params, abstract_state, batch), mesh)
    in_shardings = jax.tree.map(lambda x: x.sharding, args)
    jitted = jax.jit(step, in_shardings=in_shardings,
                     out_shardings=(*in_shardings[:2], NamedSharding(auto, P())),
                     donate_argnums=(0, 1))
    with _mesh_context(auto):
        return jitted.lower(*args)


def compile_mode(config: ml_collections.ConfigDict, mode: str, mesh_shape: Sequence[int],
                 devices: Sequence[jax.Device] | None = None, *,
                 refresh: bool = False, topology=None, intra: int = 1,
                 compiler_options: dict[str, Any] | None = None,
                 flags_label: str | None = None,
                 hlo_dir: str | None = None) -> list[PodCompile]:
    """Compiles the step variants of ``config`` in ``mode`` (a key of :data:`MODES`) on a
    ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all), without running them.

    Args:
      config: a trainer config (see :func:`mode_config`).
      mode: a key of :data:`MODES` or :data:`XLA_MODES`.
      mesh_shape: ``(data, fsdp, tensor)`` sizes; their product is ``len(devices)``.
      devices: the devices, e.g. :func:`gift_jax.utils.tpu.topology_devices` or simulated CPU
        devices; ``None``: ``jax.devices()``.
      refresh: the refresh variant as well (GIFT/PLUMAGE); a mode without one compiles only
        the ordinary step.
      topology: the :class:`gift_jax.utils.tpu.Topology` (TPU compile) or
        :class:`gift_jax.utils.gpu.GpuTopology` (XLA:GPU compile) the devices come from: fills
        ``topology``, ``hbm_bytes``, the DCN/ICI split or the bytes across GPU nodes, and the
        step-time estimate; ``None``: simulated CPU devices.
      intra: replicas that reduce together first (``mesh.intra_size``; the replicas of one
        slice make only the quantized reduction cross the data-centre network).
      compiler_options: XLA/TPU compiler options of the step (e.g. :func:`overlap_flags`),
        or ``None``.
      flags_label: the rows' ``flags`` column (default: ``maxtext`` with options, else ``-``).
      hlo_dir: a directory to write each row's compiled HLO text to (:func:`hlo_file_name`;
        for ``scripts/compare_pod_steps.py``), or ``None``.

    Returns:
      One :class:`PodCompile` per compiled variant, ordinary first (the schedule overlap
      only when the devices are TPUs).

    Raises:
      ConfigError: ``mode`` is not a key of :data:`MODES`, or the config is invalid on this
        mesh (from :func:`mode_config`).
    """
    devices = jax.devices() if devices is None else list(devices)
    data, fsdp, tensor = mesh_shape
    config = mode_config(config, mode, mesh_shape, len(devices), intra)
    mesh = mesh_from_config(config.mesh, devices)
    program = Program(config, mesh, compiler_options)
    n_params = count_params(program.model_config)
    replicas = data_parallel_size(mesh)
    params = jax.eval_shape(program.init_params)
    local = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(
        jax.tree.leaves(params), jax.tree.leaves(program.step.param_shardings), strict=True))
    n = len(devices)
    platform = devices[0].platform
    tpu = platform == "tpu"
    out = []
    xla = mode in XLA_MODES
    for variant in (False,) if xla else program.step.variants():
        if variant and not refresh:
            continue
        start = time.perf_counter()
        compiled = (xla_step(program).compile(compiler_options or None) if xla
                    else program.step.compiled(variant))
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        text = compiled.as_text()  # read once: tens of MB for a 7B step
        report = (gift_jax.parse_hlo(text, mesh=mesh) if xla
                  else program.step.wire_report(variant))
        estimate = None
        if tpu and topology is not None:
            estimate = pod_estimate.estimate(compiled, mesh, topology.generation,
                                             multislice=topology.slices > 1, hlo_text=text)
        elif platform == "gpu" and topology is not None:
            estimate = pod_estimate.replay(text, 0.0, pod_estimate.GpuCluster.of(topology),
                                           mesh)
        inside = report.within(model_axes(mesh)).total
        dcn = dcn_bytes(text) if tpu and topology is not None else 0.0
        out.append(PodCompile(
            mode=mode, mesh=(data, fsdp, tensor), intra=intra, refresh=variant, params=n_params,
            argument_bytes=int(memory.argument_size_in_bytes),
            temp_bytes=int(memory.temp_size_in_bytes),
            output_bytes=int(memory.output_size_in_bytes - memory.alias_size_in_bytes),
            data_bytes=report.over(data_axes(mesh)).total, model_bytes=inside,
            fp32_local_bytes=2 * (replicas - 1) / replicas * local,
            fp32_replicated_bytes=2 * (n - 1) / n * 4 * n_params,
            compile_s=seconds, compiler=COMPILERS.get(platform, "XLA:CPU"),
            topology=topology.label if topology is not None else "",
            hbm_bytes=topology.hbm_bytes if topology is not None else 0,
            dcn_bytes=dcn, ici_bytes=report.total if dcn else 0.0,
            overlap=(schedule_overlap(text, mesh, data_axes(mesh)) if platform in COMPILERS
                     else None),
            expected_argument_bytes=_state_bytes(program.step, mesh), estimate=estimate,
            flags=flags_label or ("maxtext" if compiler_options else "-"),
            schedule="" if xla else _schedule(config.comm),
            quantized="none" if xla else _quantized(config.comm),
            network_bytes=across_hosts(report, mesh) if platform == "gpu" else 0.0,
            kernels=pallas_kernels(text) if platform in COMPILERS else -1))
        if hlo_dir is not None:
            path = pathlib.Path(hlo_dir)
            path.mkdir(parents=True, exist_ok=True)
            (path / hlo_file_name(out[-1].row())).write_text(text)
    return out


def hlo_file_name(row: dict[str, Any]) -> str:
    """The file a row's compiled HLO text is written to (``compile_pod.py --hlo``): its mode,
    mesh, reduction, variant and flags, e.g.
    ``fp8_4x16x1_flat_in_backward_ppermute_ordinary_-.hlo.txt``.

    Args:
      row: a :meth:`PodCompile.row`.

    Returns:
      The file name.
    """
    key = "_".join(str(row[k]) for k in ("mode", "mesh", "reduction", "variant", "flags"))
    return re.sub(r"[^\w.=-]+", "_", key) + ".hlo.txt"


def _schedule(comm: Any) -> str:
    """The ``reduction`` column's note of when and how the quantized reduction runs, and of
    the blocks' fsdp collectives when a codec carries them."""
    fsdp, weights = comm.get("fsdp_codec", ""), comm.get("fsdp_weight_codec", "")
    return ((", in backward" if comm.reduce_in == "backward" else "")
            + (", ppermute" if comm.exchange == "permute" else "")
            + (f", fsdp grads {fsdp}" if fsdp else "")
            + (f", fsdp weights {weights}" if weights else ""))


def _quantized(comm: Any) -> str:
    """The ``quantized`` column: which collectives carry low-precision values — ``data``
    (``comm.codec``), ``fsdp grads`` (``comm.fsdp_codec``), ``fsdp weights``
    (``comm.fsdp_weight_codec``) — each with its codec, or ``none``."""
    low = lambda name: bool(name) and get_codec(name).is_scaled
    parts = [f"{what} {name}" for what, name in (
        ("data", comm.codec), ("fsdp grads", comm.get("fsdp_codec", "")),
        ("fsdp weights", comm.get("fsdp_weight_codec", ""))) if low(name)]
    return ", ".join(parts) or "none"


def markdown_table(rows: Sequence[PodCompile | dict[str, Any]]) -> str:
    """The compiled steps (or their :meth:`PodCompile.row` dicts) as a markdown table.

    Args:
      rows: :class:`PodCompile` records or row dicts, mixed freely.

    Returns:
      The table (columns: every key in first-seen order; ``-`` where a row lacks one), or
      ``""`` for no rows.
    """
    rows = [r.row() if isinstance(r, PodCompile) else r for r in rows]
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "-")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
