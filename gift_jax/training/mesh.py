"""Processes, devices and the mesh.

Three layouts:

* pure data parallelism (the default): one axis ``'data'`` over every device; parameters
  replicated, batches split over it;
* hierarchical (``mesh.intra_size > 1``): ``('data', 'intra')``, ``'intra'`` grouping
  ``intra_size`` neighbouring devices (a node) that reduce in ``comm.intra_codec`` first;
* sharded (``mesh.fsdp`` or ``mesh.tensor`` > 1): ``('data', 'fsdp', 'tensor')``. ``'data'``
  (outermost, so it runs across processes/nodes) are the replicas that reduce through the
  quantized collective; ``'fsdp'`` splits parameters, gradients, optimizer state and the batch
  within a replica; ``'tensor'`` splits heads and the MLP hidden dimension. The model axes are
  ``Auto`` (GSPMD partitions the model's compute); see :mod:`.sharding`.
"""

from __future__ import annotations

import math
import os

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
INTRA_AXIS = "intra"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
#: The axes that split the model inside a data-parallel replica (GSPMD).
MODEL_AXES = (FSDP_AXIS, TENSOR_AXIS)
#: The default logical-axis → mesh-axis rules (``mesh.rules`` in the config; '' = replicated;
#: see :mod:`.sharding`).
DEFAULT_RULES: dict[str, str] = {
    "vocab": TENSOR_AXIS,
    "embed": FSDP_AXIS,
    "heads": TENSOR_AXIS,
    "kv_heads": TENSOR_AXIS,
    "mlp": TENSOR_AXIS,
    "norm": "",
}


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """``jax.distributed.initialize`` when coordinator settings are given.

    Settings come from the arguments or, when absent, from the environment variables
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. Without a
    coordinator address nothing happens (a single-process run). The address ``"auto"`` lets
    JAX detect the cluster (``jax.distributed.initialize()`` without arguments: SLURM, Open MPI,
    Cloud TPU pods, Kubernetes JobSets — whatever this JAX version's cluster plugins know).
    Returns whether JAX was initialized for several processes.
    """
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address == "auto":
        if num_processes is not None or process_id is not None:
            raise ValueError("coordinator_address='auto' detects num_processes and process_id "
                             "from the cluster: do not pass them")
        jax.distributed.initialize()
        return jax.process_count() > 1
    if not address:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError(
                "num_processes/process_id were given without a coordinator address: pass "
                "--coordinator_address=HOST:PORT (or set JAX_COORDINATOR_ADDRESS)"
            )
        return False
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if num_processes is None or process_id is None:
        raise ValueError(
            f"coordinator_address={address!r} needs num_processes and process_id (flags "
            "--num_processes/--process_id or JAX_NUM_PROCESSES/JAX_PROCESS_ID)"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    jax.distributed.initialize(
        coordinator_address=address, num_processes=num_processes, process_id=process_id
    )
    return True


def mesh_shape(num_devices: int, data: int = -1, fsdp: int = 1, tensor: int = 1,
               intra_size: int = 1) -> dict[str, int]:
    """``{'data': …, 'fsdp': …, 'tensor': …}`` for ``num_devices`` devices; one size may be
    -1 (the rest). Raises ``ValueError`` naming the ``mesh.*`` setting when the sizes do not
    multiply to the number of devices."""
    sizes = {DATA_AXIS: data, FSDP_AXIS: fsdp, TENSOR_AXIS: tensor}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"mesh.{name}={value!r} must be a positive int or -1 (the rest)")
    free = [name for name, value in sizes.items() if value == -1]
    if len(free) > 1:
        raise ValueError(f"only one of mesh.data/fsdp/tensor may be -1, got {free}")
    known = math.prod(v for v in sizes.values() if v != -1)
    setting = ", ".join(f"mesh.{k}={v}" for k, v in sizes.items())
    if free:
        if num_devices % known:
            raise ValueError(f"{setting}: the fixed sizes ({known}) must divide the number of "
                             f"devices ({num_devices})")
        sizes[free[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(f"{setting} multiply to {known}, not to the number of devices "
                         f"({num_devices}); set one of them to -1 (the rest)")
    if intra_size < 1 or sizes[DATA_AXIS] % intra_size:
        raise ValueError(f"mesh.intra_size={intra_size} must divide the number of data-parallel "
                         f"replicas ({sizes[DATA_AXIS]})")
    if intra_size > 1 and (sizes[FSDP_AXIS] > 1 or sizes[TENSOR_AXIS] > 1):
        raise ValueError(f"mesh.intra_size={intra_size} (hierarchical all-reduce) cannot be "
                         "combined with mesh.fsdp/mesh.tensor > 1; keep mesh.intra_size=1")
    return sizes


def make_mesh(intra_size: int = 1, devices=None, *, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """The mesh over ``devices`` (default: all devices of all processes), data axis outermost:
    ``('data',)``, ``('data', 'intra')`` or, with ``fsdp``/``tensor`` > 1,
    ``('data', 'fsdp', 'tensor')`` (see the module docstring)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(len(devices), -1, fsdp, tensor, intra_size)
    n = sizes[DATA_AXIS]
    if fsdp > 1 or tensor > 1:
        return jax.make_mesh((n, fsdp, tensor), (DATA_AXIS, *MODEL_AXES), devices=devices,
                             axis_types=(AxisType.Auto,) * 3)
    if intra_size == 1:
        return jax.make_mesh((n,), (DATA_AXIS,), devices=devices)
    return jax.make_mesh((n // intra_size, intra_size), (DATA_AXIS, INTRA_AXIS), devices=devices)


def mesh_from_config(mesh_config, devices=None) -> Mesh:
    """:func:`make_mesh` of a config's ``mesh`` section (``data``, ``fsdp``, ``tensor``,
    ``intra_size``)."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(len(devices), mesh_config.data, mesh_config.fsdp, mesh_config.tensor,
                       mesh_config.intra_size)
    return make_mesh(mesh_config.intra_size, devices, fsdp=sizes[FSDP_AXIS],
                     tensor=sizes[TENSOR_AXIS])


def model_axes(mesh: Mesh) -> tuple[str, ...]:
    """The model axes of ``mesh`` with more than one device (GSPMD splits the model there)."""
    return tuple(a for a in MODEL_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """All data-parallel axes of ``mesh``, outermost first (batches are split over these)."""
    return tuple(name for name in (DATA_AXIS, INTRA_AXIS) if name in mesh.axis_names)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a batch's rows are split over: every data axis, then ``fsdp`` when it splits
    the model (tensor-parallel devices share their rows)."""
    return data_axes(mesh) + tuple(a for a in model_axes(mesh) if a == FSDP_AXIS)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[global_batch, seq]`` array: rows split over :func:`batch_axes`."""
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, P())
