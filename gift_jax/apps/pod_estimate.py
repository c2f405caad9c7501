"""A train step's time on a TPU pod or an NVIDIA GPU cluster, estimated from the compiled
program and the hardware's published figures.

No pod is run. The step is compiled for a pod's devices (:mod:`gift_jax.apps.pod`), and its
scheduled HLO is replayed in order (:func:`replay`) against :data:`CHIPS`:

1. **Compute.** Every op's roofline time from the shapes in the HLO, ``max(flops / peak,
   bytes / HBM bandwidth)`` (FLOPs of its matmuls and convolutions, including those fused
   into it; bytes of its operands and result, where a dynamic slice or an in-place dynamic
   update of a buffer counts the slice, :meth:`_Costs.bytes_moved`), and a loop's body
   times its trip count (a scanned layer stack inside an accumulation loop is most of a
   step). The compiler's own
   ``compiled.cost_analysis()["optimal_seconds"]`` is reported beside it and not used: it
   counts a loop's body once whatever the trip count (checked: a ``lax.scan`` of 4 or of 16
   matmuls gets the same figure), so for a scanned model it is not the step's compute. It
   counts a collective's HBM reads and writes like any op's but not its time on the links
   (checked: a lone 256 MiB ``psum`` and an elementwise op of its size get the same figure).
2. **Communication.** Each collective's bytes per device (the bus model of
   :mod:`gift_jax.comm.wire`) over the link it crosses. TPU (:class:`Chip`): ICI inside a
   slice, at half the chip's bidirectional ICI bandwidth (every port sending at once: a lower
   bound on the time of a collective that uses only some ports), and the data-centre network
   (DCN) across slices for the MegaScale ``send`` payloads of a multi-slice job
   (:func:`gift_jax.apps.pod.dcn_bytes`). GPU (:class:`GpuCluster`): NCCL's bus model,
   the bus bytes over NVLink's per-direction bandwidth for a group inside one node; across
   nodes a ring's bus bandwidth is the NICs' aggregate of the group's GPUs on a node (capped
   by NVLink), an all-to-all sends what leaves the node through each GPU's own NIC
   (:meth:`GpuCluster.collective`); plus a launch latency per collective (XLA's analytical
   SoL defaults for H100: 45 µs, and 31 µs more across nodes).
3. **Overlap, from the schedule.** A compute op advances the clock by its time; an
   asynchronous collective's ``*-start`` puts it on its link's queue (one collective at a
   time per link, in issue order) and its ``*-done`` waits for it; a synchronous collective
   waits at once; a loop costs its body's replayed time per iteration. The clock at the end
   is the estimated step time; what it exceeds the compute by is the **exposed**
   communication, the part that compute does not cover.

On GPU a matmul runs at the tensor cores' dense peak for its operands' dtype (bf16/f16;
fp8; f32 as TF32 at half the bf16 rate, XLA:GPU's default precision), and the compiled
program's ``cost_analysis()`` is ``None`` (no ``optimal_seconds`` column).

The estimate is a model, and states its assumptions: compute at the roofline (a lower
bound: real MFU is lower, so the estimate is optimistic and the exposed share of the step
is if anything overstated), Pallas kernels (``custom-call``) costed by their bytes only,
links at their published peak, no latency per collective on TPU, collectives on one link
serialised in issue order, NCCL's kernels taking no SMs from the compute they overlap, and a
loop's collectives overlapping only inside their own iteration.
``tests/test_pod_estimate.py`` checks the replay on hand-written schedules;
docs/api/pod.md compares it with published maxtext (TPU) and JAX-Toolbox (GPU) figures.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gift_jax.comm.wire import (
    COLLECTIVE_KINDS,
    INSTRUCTION,
    array_bytes,
    loop_trips,
    parse_hlo,
)
from gift_jax.comm.wire import computations as wire_computations


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published figures of one TPU chip (per chip, not per TensorCore)."""

    peak_flops: float  # bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float  # bytes/s, bidirectional, all ports together
    dcn_bandwidth: float | None  # bytes/s one way per chip; None: not published
    source: str

    def matmul_rate(self, dtype: str) -> float:
        """Dense matmul FLOP/s for operands of HLO dtype ``dtype``: the bf16 peak for every
        dtype (the MXU's f32 matmuls are passes of bf16 ones, left out as before).

        Args:
          dtype: the operands' HLO element type (``bf16``, ``f32``...).

        Returns:
          FLOP/s.
        """
        del dtype
        return self.peak_flops

    def collective(self, kind: str, wire_bytes: float, group: Sequence[int],
                   mesh) -> tuple[str, float]:
        """``(link, seconds)`` of one collective inside a slice: its bus bytes over ICI at half
        the bidirectional bandwidth, no latency.

        Args:
          kind: the collective's kind (unused: every kind moves its bus bytes).
          wire_bytes: its bytes per device (bus model).
          group: the device positions of one of its groups (unused: one link in a slice).
          mesh: the mesh (unused).

        Returns:
          ``("ICI", seconds)``.
        """
        del kind, group, mesh
        return "ICI", wire_bytes / (self.ici_bandwidth / 2)


#: The chips whose bandwidths are known, with their sources (Cloud TPU's system-architecture
#: pages). v5e's DCN figure is derived: 2 x 100 Gbps NICs per host of 8 chips. v4 is left
#: out: its per-chip ICI bandwidth is not published there.
CHIPS: dict[str, Chip] = {
    "v5p": Chip(459e12, 2765e9, 1200e9, 50e9 / 8,
                "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, HBM 2765 GB/s, ICI 1200 GB/s "
                "bidirectional per chip, DCN 50 Gbps per chip"),
    "v5e": Chip(197e12, 819e9, 400e9, 2 * 100e9 / 8 / 8,
                "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, HBM 819 GB/s, ICI 400 GB/s "
                "bidirectional per chip, 2 x 100 Gbps NICs per 8-chip host"),
    "v6e": Chip(918e12, 1638e9, 800e9, None,
                "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, HBM 1638 GB/s, ICI 800 GB/s "
                "bidirectional per chip (DCN per chip not published)"),
}


class UnknownChipError(ValueError):
    """A chip whose bandwidths are not in :data:`CHIPS`; the message is one line."""


def chip(generation: str, *, multislice: bool = False) -> Chip:
    """The published figures of a TPU generation.

    Args:
      generation: ``v5p``, ``v5e``, ``v6e`` (a key of :data:`CHIPS`).
      multislice: the job spans slices, so the chip's DCN bandwidth is needed too.

    Returns:
      The :class:`Chip`.

    Raises:
      UnknownChipError: the generation is not in the table (the message lists the known
        chips), or its DCN bandwidth is unknown and ``multislice`` is set.
    """
    if generation not in CHIPS:
        raise UnknownChipError(f"no published bandwidths for TPU {generation!r}; step times "
                               f"are estimated for: {', '.join(CHIPS)}")
    found = CHIPS[generation]
    if multislice and found.dcn_bandwidth is None:
        known = ", ".join(g for g, c in CHIPS.items() if c.dcn_bandwidth is not None)
        raise UnknownChipError(f"no published DCN bandwidth for TPU {generation!r}; "
                               f"multi-slice step times are estimated for: {known}")
    return found


@dataclasses.dataclass(frozen=True)
class GpuCluster:
    """Published figures of a GPU cluster (:mod:`gift_jax.utils.gpu`): the GPU's tensor-core
    peaks and HBM, NVLink inside a node, the network between nodes."""

    peak_flops: float  # dense bf16 FLOP/s
    peak_fp8_flops: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU and direction
    network_bandwidth: float  # bytes/s per GPU and direction between nodes
    network: str  # the link's name (gift_jax.utils.gpu.LINKS)
    source: str
    gpus_per_host: int = 8  # a node's GPUs: device position // this is the node, without a mesh
    launch_latency: float = 45e-6  # per NCCL collective (XLA's SoL default for H100)
    network_latency: float = 31e-6  # added across nodes (XLA's SoL round trip for H100)

    @classmethod
    def of(cls, topology) -> GpuCluster:
        """The figures of a :class:`gift_jax.utils.gpu.GpuTopology`.

        Args:
          topology: the cluster.

        Returns:
          Its :class:`GpuCluster`.
        """
        from gift_jax.utils.gpu import LINKS

        g = topology.spec
        return cls(g.peak_flops, g.peak_fp8_flops, g.hbm_bandwidth, g.nvlink_bandwidth,
                   topology.link_bandwidth, topology.link,
                   f"{g.source}; {topology.link}: {LINKS[topology.link][1]}",
                   topology.gpus_per_host)

    def matmul_rate(self, dtype: str) -> float:
        """Dense tensor-core FLOP/s for operands of HLO dtype ``dtype``: fp8 at the fp8 peak,
        f32 as TF32 (half the bf16 peak: XLA:GPU's default matmul precision), else bf16.

        Args:
          dtype: the operands' HLO element type.

        Returns:
          FLOP/s.
        """
        if dtype.startswith("f8"):
            return self.peak_fp8_flops
        return self.peak_flops / 2 if dtype == "f32" else self.peak_flops

    def nodes(self, group: Sequence[int], mesh) -> list[int]:
        """The node (process) of each device of ``group`` (positions in ``mesh``'s device
        order). Without a mesh, position ``i`` is on node ``i // gpus_per_host`` (the meshes
        of :func:`gift_jax.training.mesh.device_grid` put nodes outermost).

        Args:
          group: device positions.
          mesh: the mesh the step was compiled for, or ``None``.

        Returns:
          One node index per device.
        """
        if mesh is not None:
            devices = mesh.devices.reshape(-1)
            return [devices[i].process_index for i in group]
        return [i // self.gpus_per_host for i in group]

    def collective(self, kind: str, wire_bytes: float, group: Sequence[int],
                   mesh) -> tuple[str, float]:
        """``(link, seconds)`` of one NCCL collective by its bus bytes per GPU.

        Inside one node: over NVLink, plus the launch latency. Across nodes, with ``g`` of
        the group's GPUs on each node (each GPU with its own NIC): a ring (all-reduce,
        reduce-scatter, all-gather) runs one channel per NIC and reaches a bus bandwidth of
        ``min(NVLink, g · NIC)`` (nccl-tests' multi-node busbw of a DGX is its NICs'
        aggregate); an all-to-all sends the ``(P − g)/(P − 1)`` of its bus bytes bound for
        other nodes through the GPU's NIC while the rest crosses NVLink; a
        collective-permute is one send through the NIC. Latency: the launch, plus the
        network's round trip.

        Args:
          kind: ``all-reduce``, ``reduce-scatter``, ``all-gather``, ``all-to-all`` or
            ``collective-permute``.
          wire_bytes: its bytes per GPU (bus model of :mod:`gift_jax.comm.wire`).
          group: the device positions of one of its groups.
          mesh: the mesh the step was compiled for, or ``None``.

        Returns:
          ``(link name, seconds)``: ``"NVLink"``, or the network's name across nodes.
        """
        if not wire_bytes or len(group) < 2:
            return "NVLink", 0.0
        nodes = self.nodes(group, mesh)
        count = len(set(nodes))
        if count == 1:
            return "NVLink", wire_bytes / self.nvlink_bandwidth + self.launch_latency
        p, g = len(group), max(1, len(group) // count)
        latency = self.launch_latency + self.network_latency
        nic, nvl = self.network_bandwidth, self.nvlink_bandwidth
        if kind == "all-to-all":
            seconds = max(wire_bytes * (p - g) / (p - 1) / nic,
                          wire_bytes * (g - 1) / (p - 1) / nvl)
        elif kind == "collective-permute":
            seconds = wire_bytes / nic
        else:
            seconds = wire_bytes / min(nvl, g * nic)
        return self.network, seconds + latency


# ---- the scheduled HLO ---------------------------------------------------------------------

_CALLS = re.compile(r"(?:calls|body|to_apply|branch_computations|called_computations)="
                    r"\{?(?P<names>%[\w.\-]+(?:,\s*%[\w.\-]+)*)\}?")
_BODY = re.compile(r"\bbody=(%[\w.\-]+)")
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "partition-id", "replica-id", "opt-barrier", "copy-start", "copy-done"}


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of a computation, as printed."""

    name: str
    type: str
    op: str
    operands: tuple[str, ...]
    attrs: str
    line: str

    def called(self) -> list[str]:
        """The computations this instruction calls (fusion, loop body, async wrapper...)."""
        return [n.strip() for m in _CALLS.finditer(self.attrs)
                for n in m.group("names").split(",")]


def computations(hlo_text: str) -> tuple[dict[str, list[Instr]], str]:
    """The module's computations in scheduled order, and the entry's name.

    Args:
      hlo_text: ``compiled.as_text()``.

    Returns:
      ``({name: [Instr, ...]}, entry name)``.
    """
    bodies, entry = wire_computations(hlo_text)
    out = {f"%{name}": [Instr(m["name"], m["type"], m["op"],
                              tuple(re.findall(r"%[\w.\-]+", m["args"])), m["attrs"], m.string)
                        for m in map(INSTRUCTION.match, lines) if m]
           for name, lines in bodies.items()}
    return out, "" if entry is None else f"%{entry}"


def _dtype(type_str: str) -> str:
    """The element type of an HLO array type (``bf16[2,3]{1,0}`` → ``bf16``)."""
    m = re.match(r"\s*\(?\s*(\w+)\[", type_str)
    return m.group(1) if m else ""


def _dims(type_str: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", type_str)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _flops(ins: Instr, types: Mapping[str, str]) -> float:
    """Multiply-add FLOPs of a convolution or dot (2 per multiply-add), from its shapes."""
    out = math.prod(_dims(ins.type))
    if ins.op == "dot":
        lhs = _dims(types.get(ins.operands[0], ""))
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        k = math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 1
        return 2.0 * out * k
    lhs = _dims(types.get(ins.operands[0], ""))
    rhs = _dims(types.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    m = re.search(r"dim_labels=(\w+)_(\w+)->", ins.attrs)
    if not rhs or not m or "o" not in m.group(2) or len(m.group(2)) != len(rhs):
        return 0.0
    groups = re.search(r"feature_group_count=(\d+)", ins.attrs)
    per_output = math.prod(rhs) / rhs[m.group(2).index("o")]
    # a window over a padded input (the TPU compiler's windowed einsums: size 2, pad 1_1 over
    # a spatial dimension of 1) multiplies only the taps that meet the input
    sizes = re.search(r"window=\{size=([\dx]+)", ins.attrs)
    spatial = [lhs[i] for i, c in enumerate(m.group(1)) if c.isdigit()] if lhs else []
    if sizes and len(spatial) == len(sizes.group(1).split("x")):
        window = [int(k) for k in sizes.group(1).split("x")]
        taps = math.prod(min(k, n) for k, n in zip(window, spatial, strict=True))
        per_output *= taps / math.prod(window)
    return 2.0 * out * per_output / (int(groups.group(1)) if groups else 1)


#: A fusion, or XLA:GPU's asynchronous one (``fusion-start``: the same fused computation run
#: on another stream, e.g. a rematerialised layer's activations written into their stack).
_FUSIONS = ("fusion", "fusion-start")
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha\w*"')


def _attention_flops(ins: Instr, types: Mapping[str, str]) -> float:
    """Matmul FLOPs of a cuDNN flash-attention call (``__cudnn$fmha*``): the forward's two
    matmuls (``QKᵀ``, ``PV``: ``4·B·H·T·S·D``), the backward's five (``10·B·H·T·S·D``: the
    scores recomputed, ``dV``, ``dP``, ``dQ``, ``dK``; FlashAttention-2's count), halved
    under a causal mask (cuDNN skips the masked tiles). ``B, H, T, S`` come from the call's
    ``intermediate_tensor_shape``, ``D`` from the query's last dimension."""
    m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]',
                  ins.attrs)
    query = _dims(types.get(ins.operands[0], "")) if ins.operands else []
    if not m or not query:
        return 0.0
    b, h, t, s = (int(x.strip().strip('"')) for x in m.group(1).split(","))
    per = 10.0 if "Backward" in (_FMHA.search(ins.attrs).group(0)) else 4.0
    causal = 0.5 if '"mask_type": "CAUSAL"' in ins.attrs else 1.0
    return per * b * h * t * s * query[-1] * causal


@dataclasses.dataclass
class _Costs:
    """Roofline seconds of compute ops of a module's computations on a chip."""

    comps: dict[str, list[Instr]]
    chip: Chip | GpuCluster

    def matmuls_of(self, comp: str, depth: int = 0) -> tuple[float, float]:
        """``(FLOPs, seconds)`` of the matmuls in ``comp`` (fusions' included), each at the
        chip's rate for its operands' dtype (:meth:`Chip.matmul_rate`)."""
        types = {i.name: i.type for i in self.comps.get(comp, ())}
        flops = seconds = 0.0
        for ins in self.comps.get(comp, ()):
            if ins.op in ("convolution", "dot"):
                f = _flops(ins, types)
                dtype = _dtype(types.get(ins.operands[0], "")) if ins.operands else ""
                flops, seconds = flops + f, seconds + f / self.chip.matmul_rate(dtype)
            elif ins.op in _FUSIONS and depth < 4:
                for c in ins.called():
                    f, t = self.matmuls_of(c, depth + 1)
                    flops, seconds = flops + f, seconds + t
        return flops, seconds

    def seconds(self, ins: Instr, types: Mapping[str, str]) -> float:
        """Roofline time of one compute instruction (a fusion, matmul, kernel, copy...)."""
        return self.roofline(ins, types)[0]

    def roofline(self, ins: Instr, types: Mapping[str, str]) -> tuple[float, float]:
        """``(roofline seconds, FLOPs)`` of one compute instruction."""
        moved = self.bytes_moved(ins, types)
        flops = matmul_s = 0.0
        if ins.op in ("convolution", "dot"):
            flops = _flops(ins, types)
            dtype = _dtype(types.get(ins.operands[0], "")) if ins.operands else ""
            matmul_s = flops / self.chip.matmul_rate(dtype)
        elif ins.op in _FUSIONS:
            for c in ins.called():
                f, t = self.matmuls_of(c)
                flops, matmul_s = flops + f, matmul_s + t
        elif ins.op == "custom-call" and _FMHA.search(ins.attrs):
            flops = _attention_flops(ins, types)
            dtype = _dtype(types.get(ins.operands[0], "")) if ins.operands else ""
            matmul_s = flops / self.chip.matmul_rate(dtype)
        return max(matmul_s, moved / self.chip.hbm_bandwidth), flops

    def bytes_moved(self, ins: Instr, types: Mapping[str, str]) -> float:
        """HBM bytes one instruction reads and writes: its operands (an operand read twice,
        once) and its result, except where it touches only a slice of a buffer. A
        ``dynamic-slice`` or ``slice`` reads its slice, not the buffer (XLA:GPU slices each
        gradient out of a combined all-reduce's buffer this way); a ``dynamic-update-slice``
        updates its buffer in place (XLA aliases the two), so it reads and writes the
        update only. Inside a fusion the same holds for a parameter that only feeds
        dynamic slices or is the buffer of the root's dynamic update slice (a scanned
        layer stack's gradient written one layer per trip, a layer's weights read from
        the stack): counting whole stacks there charged XLA's 7B step about 590 ms of
        traffic that does not happen."""
        whole = lambda t: float(sum(b for _, b in array_bytes(t)))
        if ins.op in ("dynamic-slice", "slice"):
            return 2 * whole(ins.type)
        if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
            return 2 * whole(types.get(ins.operands[1], ""))
        called = ins.called() if ins.op in _FUSIONS else []
        body = self.comps.get(called[0], []) if len(called) == 1 else []
        reads = {o: whole(types.get(o, "")) for o in ins.operands}
        if not body:
            return whole(ins.type) + sum(reads.values())
        inner = {i.name: i for i in body}
        users: dict[str, list[tuple[Instr, int]]] = {}
        for i in body:
            for k, o in enumerate(i.operands):
                users.setdefault(o, []).append((i, k))

        def uses(name: str) -> list[tuple[Instr, int]]:  # through bitcasts
            out = []
            for user, k in users.get(name, ()):
                out += uses(user.name) if user.op == "bitcast" else [(user, k)]
            return out

        def unbitcast(name: str) -> Instr | None:
            found = inner.get(name)
            while found is not None and found.op == "bitcast" and found.operands:
                found = inner.get(found.operands[0])
            return found

        root = next((i for i in body if i.line.lstrip().startswith("ROOT")), body[-1])
        outputs = root.operands if root.op == "tuple" else [root.name]
        written, updated = 0.0, set()  # updated: the root's in-place dynamic update slices
        for name in outputs:
            out = unbitcast(name)
            if out is not None and out.op == "dynamic-update-slice" and len(out.operands) > 1:
                updated.add(out.name)
                written += whole(inner[out.operands[1]].type if out.operands[1] in inner
                                 else "")
            else:
                written += whole(inner[name].type) if name in inner else 0.0
        for i in body:
            m = _PARAMETER.search(i.line) if i.op == "parameter" else None
            if not m or int(m.group(1)) >= len(ins.operands):
                continue
            operand = ins.operands[int(m.group(1))]
            found = uses(i.name)
            if found and all(u.op in ("dynamic-slice", "slice") and k == 0 for u, k in found):
                reads[operand] = min(reads[operand], sum(whole(u.type) for u, _ in found))
            elif found and all(u.name in updated and k == 0 for u, k in found):
                reads[operand] = 0.0
        return written + sum(reads.values())


# ---- the replay ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the schedule, as the replay costed it."""

    kind: str
    link: str  # "ICI" or "DCN" (TPU); "NVLink" or the network's name (GPU)
    bytes: float  # per device (bus model), per execution
    seconds: float  # per execution, at the link's bandwidth
    stall: float  # per execution: time the schedule waited for it (not covered by compute)
    executions: int  # how often it runs per step (loop trip counts)
    axes: tuple[str, ...]  # the mesh axes its groups span


@dataclasses.dataclass(frozen=True)
class Replay:
    """The replayed schedule of one compiled step."""

    compute_s: float  # the ops' roofline seconds, every loop body times its trip count
    step_s: float  # the clock at the end of the replay
    collectives: tuple[Collective, ...]
    optimal_seconds: float = 0.0  # the compiler's own figure (a loop body counted once)
    #: compute seconds per step by :func:`op_label` (every loop body times its trip count)
    compute_by_op: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def exposed_s(self) -> float:
        """Communication not covered by compute: ``step_s − compute_s``."""
        return max(0.0, self.step_s - self.compute_s)

    def comm_s(self, link: str | None = None, axes: Sequence[str] | None = None) -> float:
        """Seconds on the links per step, of the collectives on ``link`` and spanning any of
        ``axes`` (``None``: all).

        Args:
          link: ``"ICI"``, ``"DCN"`` or ``None``.
          axes: mesh axes, or ``None``.

        Returns:
          The summed link time of those collectives, times their executions.
        """
        return sum(c.seconds * c.executions for c in self._select(link, axes))

    def stall_s(self, link: str | None = None, axes: Sequence[str] | None = None) -> float:
        """Seconds the schedule waited for those collectives (their exposed part).

        Args:
          link: ``"ICI"``, ``"DCN"`` or ``None``.
          axes: mesh axes, or ``None``.

        Returns:
          The summed stalls, times their executions.
        """
        return sum(c.stall * c.executions for c in self._select(link, axes))

    def _select(self, link, axes):
        return [c for c in self.collectives if (link is None or c.link == link)
                and (axes is None or set(c.axes) & set(axes))]


def op_label(ins: Instr, flops: float) -> str:
    """What :attr:`Replay.compute_by_op` groups an op by: its kind and result type without
    layouts, ``matmul`` first where it does FLOPs (``matmul fusion bf16[2048,4096]``,
    ``copy f32[2048,4096]``), so two compiled steps of one model line up op by op.

    Args:
      ins: a compute instruction.
      flops: its FLOPs (:meth:`_Costs.roofline`).

    Returns:
      The label.
    """
    return ("matmul " if flops else "") + f"{ins.op} {_LAYOUT.sub('', ins.type)}"


_LAYOUT = re.compile(r"\{[^}]*\}")
_COND = re.compile(r"\bcondition=(%[\w.\-]+)")


def _trip_count(ins: Instr, comps: Mapping[str, list[Instr]], caller: str) -> int:
    """A loop's trip count (:func:`gift_jax.comm.wire.loop_trips`); ``caller``: the
    computation holding it."""
    lines = lambda m: [i.line for i in comps.get(m.group(1), ())] if m else []
    return loop_trips(ins.line, lines(_COND.search(ins.attrs)), lines(_BODY.search(ins.attrs)),
                      [i.line for i in comps.get(caller, ())])


def _collective_line(ins: Instr, comps: Mapping[str, list[Instr]]) -> Instr | None:
    """The collective an instruction issues: itself, or the one inside an async wrapper."""
    if ins.op.removesuffix("-start") in COLLECTIVE_KINDS:
        return ins
    if ins.op == "async-start":
        for c in ins.called():
            for inner in comps.get(c, ()):
                if inner.op in COLLECTIVE_KINDS:
                    return inner
    return None


_DCN = re.compile(r"xla_megascale_runtime")


def replay(hlo_text: str, optimal_seconds: float, chip_: Chip | GpuCluster, mesh) -> Replay:
    """Replays the scheduled HLO of a compiled step (see the module docstring).

    Args:
      hlo_text: ``compiled.as_text()`` (scheduled order).
      optimal_seconds: ``compiled.cost_analysis()["optimal_seconds"]`` (0 on GPU).
      chip_: the TPU chip's figures (:func:`chip`) or the GPU cluster's
        (:meth:`GpuCluster.of`).
      mesh: the mesh the step was compiled for (names each collective's axes).

    Returns:
      The :class:`Replay`.
    """
    comps, entry = computations(hlo_text)
    costs = _Costs(comps, chip_)
    found: list[Collective] = []

    compute = 0.0  # roofline seconds of the replay's compute, loops times their trips
    by_op: dict[str, float] = {}

    def run(comp: str, executions: int) -> float:
        """Replays ``comp`` once (``executions`` times per step); returns its duration,
        compute plus stalls, loops times their trip counts, recording the collectives."""
        nonlocal compute
        clock, free = 0.0, {}  # link -> when its queue is free
        pending: dict[str, tuple[float, int]] = {}  # start name -> (finish, index)
        types = {i.name: i.type for i in comps.get(comp, ())}
        for ins in comps.get(comp, ()):
            coll = _collective_line(ins, comps)
            is_send = ins.op in ("send", "recv") and _DCN.search(ins.line)
            if coll is not None or is_send:
                if is_send:
                    payload = array_bytes(ins.type)
                    nbytes = float(payload[0][1]) if payload and ins.op == "send" else 0.0
                    link, kind, axes = "DCN", ins.op, ()
                else:
                    report = parse_hlo(coll.line, mesh=mesh)
                    op = report.ops[0] if report.ops else None
                    nbytes, kind = (op.wire_bytes, op.kind) if op else (0.0, coll.op)
                    axes = op.axes if op else ()
                    link, seconds = chip_.collective(kind, nbytes, op.group if op else (),
                                                     mesh)
                if is_send:
                    seconds = nbytes / chip_.dcn_bandwidth if chip_.dcn_bandwidth else 0.0
                finish = max(clock, free.get(link, 0.0)) + seconds
                free[link] = finish
                found.append(Collective(kind, link, nbytes, seconds, 0.0, executions, axes))
                asynchronous = ins.op.endswith("-start") or ins.op == "async-start" or is_send
                if asynchronous:
                    pending[ins.name] = (finish, len(found) - 1)
                else:
                    found[-1] = dataclasses.replace(found[-1], stall=finish - clock)
                    clock = finish
            elif ins.op.endswith("-done") and ins.operands and ins.operands[0] in pending:
                finish, index = pending.pop(ins.operands[0])
                if finish > clock:
                    found[index] = dataclasses.replace(found[index], stall=finish - clock)
                    clock = finish
            elif ins.op == "while":
                trips = _trip_count(ins, comps, comp)
                body = _BODY.search(ins.attrs)
                if body:
                    clock += trips * run(body.group(1), executions * trips)
            elif ins.op in ("call", "conditional"):
                called = ins.called()
                times = [run(c, executions) for c in called]
                clock += max(times) if ins.op == "conditional" and times else sum(times)
            elif ins.op not in _FREE and not ins.op.endswith("-done"):
                seconds, flops = costs.roofline(ins, types)
                clock += seconds
                compute += seconds * executions
                label = op_label(ins, flops)
                by_op[label] = by_op.get(label, 0.0) + seconds * executions
        return clock

    step = run(entry, 1)
    return Replay(compute, step, tuple(found), optimal_seconds, by_op)


def estimate(compiled: Any, mesh, generation: str, *, multislice: bool = False,
             hlo_text: str | None = None) -> Replay:
    """The :class:`Replay` of a compiled TPU step.

    Args:
      compiled: a ``jax.stages.Compiled`` for TPU devices (its ``cost_analysis()`` has
        ``optimal_seconds``).
      mesh: the mesh it was compiled for.
      generation: the chips' generation (a key of :data:`CHIPS`).
      multislice: the job spans slices (the DCN bandwidth is needed).
      hlo_text: ``compiled.as_text()`` where the caller has it already (a 7B step's text is
        tens of MB), or ``None``.

    Returns:
      The replayed schedule.

    Raises:
      UnknownChipError: see :func:`chip`.
      ValueError: the cost analysis has no ``optimal_seconds`` (not a TPU executable).
    """
    found = chip(generation, multislice=multislice)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    if not analysis or "optimal_seconds" not in analysis:
        raise ValueError("the compiled step's cost analysis has no optimal_seconds (only the "
                         "TPU compiler reports it)")
    text = compiled.as_text() if hlo_text is None else hlo_text
    return replay(text, float(analysis["optimal_seconds"]), found, mesh)


def compare(a: Replay, b: Replay, top: int = 20) -> str:
    """Two replayed steps of one model side by side, as markdown: compute and exposed time,
    the ``top`` op labels whose compute differs most (:attr:`Replay.compute_by_op`), and each
    kind of collective's link time and stall per link.

    Args:
      a, b: the replays (e.g. XLA's own step and ours).
      top: how many op labels to list.

    Returns:
      The tables.
    """
    ms = lambda x: f"{x * 1e3:.2f}"
    lines = ["| | A | B | B − A |", "|---|---:|---:|---:|"]
    for name, f in (("compute ms", lambda r: r.compute_s), ("exposed ms", lambda r: r.exposed_s),
                    ("step ms", lambda r: r.step_s)):
        lines.append(f"| {name} | {ms(f(a))} | {ms(f(b))} | {ms(f(b) - f(a))} |")
    ops = sorted(set(a.compute_by_op) | set(b.compute_by_op),
                 key=lambda k: -abs(b.compute_by_op.get(k, 0.0) - a.compute_by_op.get(k, 0.0)))
    lines += ["", "| op (compute ms per step) | A | B | B − A |", "|---|---:|---:|---:|"]
    for k in ops[:top]:
        x, y = a.compute_by_op.get(k, 0.0), b.compute_by_op.get(k, 0.0)
        lines.append(f"| `{k}` | {ms(x)} | {ms(y)} | {ms(y - x)} |")
    lines += ["", "| collective, link | A link ms | A stall ms | B link ms | B stall ms |",
              "|---|---:|---:|---:|---:|"]
    kinds = sorted({(c.kind, c.link) for c in (*a.collectives, *b.collectives)})
    for kind, link in kinds:
        cells = []
        for r in (a, b):
            chosen = [c for c in r.collectives if (c.kind, c.link) == (kind, link)]
            cells += [ms(sum(c.seconds * c.executions for c in chosen)),
                      ms(sum(c.stall * c.executions for c in chosen))]
        lines.append(f"| {kind}, {link} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
