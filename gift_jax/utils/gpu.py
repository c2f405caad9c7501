"""NVIDIA GPU clusters without a GPU: XLA:GPU's compile-only devices.

``pip install "gift-jax[gpu-aot]"`` brings jax's CUDA plugin (``jax-cuda12-plugin``,
``jax-cuda12-pjrt``) and ``ptxas`` (``nvidia-cuda-nvcc-cu12``). On any host, with
``JAX_PLATFORMS=cpu`` (so that the plugin does not look for a driver),
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=TEXT,
topology="PxHxG")`` then gives ``H x G`` compile-only devices (``H`` hosts of ``G`` GPUs;
``process_index`` is the host) described by a ``GpuTargetConfig`` text proto: XLA:GPU's SPMD
partitioner, fusion, the latency-hiding scheduler with NCCL collectives on their own streams,
buffer assignment and Pallas-Triton kernels compiled through ``ptxas`` run as they would on
the cluster. What does not: ``cost_analysis()`` (``None``: step times come from
:mod:`gift_jax.apps.pod_estimate`'s replay) and GEMM autotuning (XLA takes its default tiles).

:data:`GPUS` holds one row per GPU: the target config's device figures (XLA's own
``xla/tools/hlo_opt/gpu_specs`` files and NVIDIA's data sheets) and the published figures the
step-time replay needs (dense bf16/fp8 FLOP/s, HBM bandwidth, NVLink per direction), each with
its source. :data:`LINKS` holds the networks between nodes, per GPU and direction.
"""

from __future__ import annotations

import dataclasses
import functools

INSTALL_HINT = ('the XLA:GPU compiler (jax\'s CUDA plugin and ptxas) is not installed: '
                'pip install -e ".[gpu-aot]"')


class GpuTopologyError(ValueError):
    """An unknown GPU or link, a bad host count, or the missing compiler; one line."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One NVIDIA GPU: what XLA:GPU compiles for, and its published speeds."""

    description: str  # device_description_str (what nvidia-smi and device_kind say)
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    memory_bytes: int  # device memory, as the driver reports it
    hbm_bandwidth: float  # bytes/s
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    peak_fp8_flops: float  # dense fp8 tensor-core FLOP/s
    nvlink_bandwidth: float  # bytes/s per GPU and direction, all links together
    gpus_per_node: int  # the node's NVLink domain
    link: str  # the node's network between nodes (a key of LINKS)
    source: str

    def target_config(self) -> str:
        """The ``GpuTargetConfig`` text proto XLA:GPU compiles for (the fields of XLA's
        ``gpu_specs`` files; Hopper's per-SM limits)."""
        major, minor = self.compute_capability
        return (
            "gpu_device_info {\n"
            "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n"
            "  shared_memory_per_block: 49152\n  shared_memory_per_core: 233472\n"
            "  threads_per_core_limit: 2048\n"
            f"  core_count: {self.sm_count}\n  fpus_per_core: 128\n"
            "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n"
            "  block_dim_limit_z: 65535\n"
            f"  memory_bandwidth: {int(self.hbm_bandwidth)}\n  l2_cache_size: 52428800\n"
            f"  clock_rate_ghz: {self.clock_ghz}\n  device_memory_size: {self.memory_bytes}\n"
            "  shared_memory_per_block_optin: 232448\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
            "  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n"
            "}\n"
            'platform_name: "CUDA"\n'
            f'device_description_str: "{self.description}"\n')


#: The GPUs clusters are compiled for, with the sources of their figures. H100's device
#: fields are XLA's ``xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb``.
GPUS: dict[str, Gpu] = {
    "h100": Gpu(
        "NVIDIA H100 80GB HBM3", (9, 0), 132, 1.98, 84_978_434_048, 3.35e12, 989e12, 1979e12,
        450e9, 8, "ib400",
        "NVIDIA H100 Tensor Core GPU data sheet (SXM5): 989 TFLOP/s dense bf16, 1,979 fp8, "
        "HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s (450 per direction); DGX H100: 8 GPUs on "
        "NVSwitch, one 400 Gb/s ConnectX-7 NIC per GPU; XLA's gpu_specs/h100_sxm.txtpb"),
    "gh200": Gpu(
        "NVIDIA GH200 480GB", (9, 0), 132, 1.98, 102_005_473_280, 4.0e12, 989e12, 1979e12,
        450e9, 4, "slingshot200",
        "NVIDIA GH200 Grace Hopper Superchip data sheet: the H100 GPU (989 TFLOP/s dense bf16, "
        "1,979 fp8) with 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s (450 per direction); the "
        "node of CSCS Alps (4 GH200 per node, one 200 Gb/s Slingshot-11 NIC per GPU), the "
        "kind of cluster the GIFT paper trained on (64 GH200)"),
}

#: Networks between nodes: bytes/s per GPU and direction (each GPU with its own NIC).
LINKS: dict[str, tuple[float, str]] = {
    "ib100": (100e9 / 8, "InfiniBand EDR/HDR100, 100 Gb/s per GPU"),
    "ib200": (200e9 / 8, "InfiniBand HDR, 200 Gb/s per GPU"),
    "ib400": (400e9 / 8, "InfiniBand NDR, 400 Gb/s per GPU (DGX H100)"),
    "ib800": (800e9 / 8, "InfiniBand XDR, 800 Gb/s per GPU"),
    "slingshot200": (200e9 / 8, "HPE Slingshot-11, 200 Gb/s per GPU (CSCS Alps)"),
}


@dataclasses.dataclass(frozen=True)
class GpuTopology:
    """``hosts`` nodes of ``gpus_per_host`` GPUs of kind ``gpu``, joined by ``link``."""

    gpu: str  # a key of GPUS
    hosts: int
    gpus_per_host: int
    link: str  # a key of LINKS

    @property
    def spec(self) -> Gpu:
        return GPUS[self.gpu]

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def hbm_bytes(self) -> int:
        """Device memory of one GPU."""
        return self.spec.memory_bytes

    @property
    def link_bandwidth(self) -> float:
        """Bytes/s per GPU and direction between nodes."""
        return LINKS[self.link][0]

    @property
    def topology_string(self) -> str:
        """``topologies.get_topology_desc``'s ``partitions x hosts x GPUs per host``."""
        return f"1x{self.hosts}x{self.gpus_per_host}"

    @property
    def label(self) -> str:
        """``'8 x 8 H100 (ib400)'``."""
        return f"{self.hosts} x {self.gpus_per_host} {self.gpu.upper()} ({self.link})"


def parse_gpu_topology(gpu: str, hosts: int = 1, gpus_per_host: int | None = None,
                       link: str | None = None) -> GpuTopology:
    """A :class:`GpuTopology` from command-line settings, checked.

    Args:
      gpu: a key of :data:`GPUS` (case and spaces ignored).
      hosts: the number of nodes, a positive int.
      gpus_per_host: GPUs per node (at most the GPU's NVLink domain); ``None``: the node's.
      link: a key of :data:`LINKS`; ``None``: the GPU's usual network.

    Returns:
      The topology.

    Raises:
      GpuTopologyError: an unknown GPU or link (the message lists the known ones), or a host
        or GPU count that is not a positive int (GPUs per host at most the node's).
    """
    name = str(gpu).strip().lower()
    if name not in GPUS:
        raise GpuTopologyError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    spec = GPUS[name]
    link = spec.link if link is None else str(link).strip().lower()
    if link not in LINKS:
        raise GpuTopologyError(f"unknown link {link!r}; known: {', '.join(LINKS)}")
    per = spec.gpus_per_node if gpus_per_host is None else gpus_per_host
    for setting, value in (("--hosts", hosts), ("--gpus_per_host", per)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GpuTopologyError(f"{setting}={value!r} must be a positive int")
    if per > spec.gpus_per_node:
        raise GpuTopologyError(f"--gpus_per_host={per}: a {name} node holds at most "
                               f"{spec.gpus_per_node} GPUs on NVLink")
    return GpuTopology(name, hosts, per, link)


def gpu_compiler_available() -> bool:
    """Whether jax's CUDA plugin can build compile-only devices in this process."""
    try:
        topology_devices(GpuTopology("h100", 1, 1, "ib400"))
    except GpuTopologyError:
        return False
    return True


@functools.cache
def _devices(target_config: str, topology: str) -> tuple:
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        raise GpuTopologyError(INSTALL_HINT) from None
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology=topology)
    except Exception as e:  # noqa: BLE001 -- the plugin raises several kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GpuTopologyError(f"XLA:GPU cannot build topology {topology!r}: {first}; "
                               f"{INSTALL_HINT}") from None
    return tuple(desc.devices)


def topology_devices(topology: GpuTopology) -> list:
    """The compile-only devices of ``topology`` (``process_index``: the host).

    Args:
      topology: the cluster.

    Returns:
      Its ``topology.gpus`` devices, host by host.

    Raises:
      GpuTopologyError: the CUDA plugin is missing (the message is the install line) or cannot
        build the topology.
    """
    return list(_devices(topology.spec.target_config(), topology.topology_string))
