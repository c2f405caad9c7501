"""Pod-scale evidence without a pod: compile (never run) the train step of a large config on a
simulated device mesh and read per-device memory and cross-replica bytes.

The step is the trainer's own (:class:`~gift_jax.training.program.Program`): lowered for the
config's mesh over simulated CPU devices (``--xla_force_host_platform_device_count``) and
compiled by XLA:CPU, with every array abstract, so a 7B model needs no memory beyond the
compiler's. From the compiled executable:

* memory per device (``compiled.memory_analysis()``): arguments (parameters, optimizer
  state, batch), temporaries (activations, gradients, buffers of the collectives), outputs not
  aliased to donated arguments;
* bytes per device and step across the ``data`` axis, from the HLO's collectives whose groups
  span ``data`` (:meth:`gift_jax.WireReport.over`), against an fp32 all-reduce of the same
  local shard and against an fp32 all-reduce of the whole model (replicated data parallelism);
  and the bytes of GSPMD's collectives inside a replica (``fsdp``/``tensor``: gathered
  weights, reduced activations and gradients, and what GIFT/PLUMAGE add there).

What a CPU compile does and does not tell: the partitioning (which arrays are split, which
collectives GSPMD inserts, the quantized reduction's bytes) is decided before the backend and
is the same for GPU/TPU; the sizes of arguments are exact. Temporaries depend on the backend's
scheduler and fusion (XLA:GPU and TPU schedule, fuse and rematerialise differently), so they
are an estimate; time is not measured.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections

from gift_jax.models import count_params
from gift_jax.training.config import complete_config, set_fields, validate_config
from gift_jax.training.mesh import data_axes, mesh_from_config, model_axes
from gift_jax.training.program import Program

#: The communication modes compiled by default: ``label → (comm.codec, comm.method)``.
MODES: dict[str, tuple[str, str]] = {
    "fp32": ("fp32", "none"),
    "fp8": ("fp8_e4m3", "none"),
    "gift_fp8": ("fp8_e4m3", "gift"),
    "plumage_fp8": ("fp8_e4m3", "plumage"),
}


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
    data_bytes: float  # per device and step, collectives spanning 'data'
    model_bytes: float  # per device and step, collectives inside a replica (fsdp/tensor)
    fp32_local_bytes: float  # an fp32 ring all-reduce of this device's shard over 'data'
    fp32_replicated_bytes: float  # an fp32 ring all-reduce of the whole model over all devices
    compile_s: float

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes

    def row(self) -> dict[str, Any]:
        gib = lambda b: round(b / 2**30, 3)
        return {"mode": self.mode, "mesh": "x".join(map(str, self.mesh)),
                "variant": "refresh" if self.refresh else "ordinary",
                "args_GiB": gib(self.argument_bytes), "temp_GiB": gib(self.temp_bytes),
                "total_GiB": gib(self.total_bytes), "data_MiB": round(self.data_bytes / 2**20, 1),
                "replica_MiB": round(self.model_bytes / 2**20, 1),
                "vs_fp32_shard": round(self.data_bytes / self.fp32_local_bytes, 4),
                "vs_replicated_dp": round(self.data_bytes / self.fp32_replicated_bytes, 4),
                "compile_s": round(self.compile_s, 1)}


def compile_mode(config: ml_collections.ConfigDict, mode: str, mesh_shape: Sequence[int],
                 devices: Sequence[jax.Device] | None = None, *,
                 refresh: bool = False) -> list[PodCompile]:
    """Compiles the step variants of ``config`` in ``mode`` (a key of :data:`MODES`) on a
    ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all), without running them.
    ``refresh``: the refresh variant as well (GIFT/PLUMAGE)."""
    devices = jax.devices() if devices is None else list(devices)
    codec, method = MODES[mode]
    data, fsdp, tensor = mesh_shape
    config = set_fields(complete_config(config), {
        "comm.codec": codec, "comm.method": method, "mesh.data": data, "mesh.fsdp": fsdp,
        "mesh.tensor": tensor})
    validate_config(config, len(devices))
    mesh = mesh_from_config(config.mesh, devices)
    program = Program(config, mesh)
    n_params = count_params(program.model_config)
    replicas = math.prod(mesh.shape[a] for a in data_axes(mesh))
    params = jax.eval_shape(program.init_params)
    local = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(
        jax.tree.leaves(params), jax.tree.leaves(program.step.param_shardings), strict=True))
    n = len(devices)
    out = []
    for variant in program.step.variants():
        if variant and not refresh:
            continue
        start = time.perf_counter()
        compiled = program.step.compiled(variant)
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        report = program.step.wire_report(variant)
        inside = report.within(model_axes(mesh)).total
        out.append(PodCompile(
            mode=mode, mesh=(data, fsdp, tensor), refresh=variant, params=n_params,
            argument_bytes=int(memory.argument_size_in_bytes),
            temp_bytes=int(memory.temp_size_in_bytes),
            output_bytes=int(memory.output_size_in_bytes - memory.alias_size_in_bytes),
            data_bytes=report.over(data_axes(mesh)).total, model_bytes=inside,
            fp32_local_bytes=2 * (replicas - 1) / replicas * local,
            fp32_replicated_bytes=2 * (n - 1) / n * 4 * n_params,
            compile_s=seconds))
    return out


def markdown_table(rows: Sequence[PodCompile]) -> str:
    """The compiled steps as a markdown table."""
    if not rows:
        return ""
    keys = list(rows[0].row())
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.row()[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
