"""Processes, devices and the mesh.

Three layouts:

* pure data parallelism (the default): one axis ``'data'`` over every device; parameters
  replicated, batches split over it;
* hierarchical (``mesh.intra_size > 1``): ``('data', 'intra')``, ``'intra'`` grouping
  ``intra_size`` neighbouring replicas (a node, a TPU slice) that reduce in
  ``comm.intra_codec`` first; only the quantized reduction of their sum crosses ``'data'``;
* sharded (``mesh.fsdp`` or ``mesh.tensor`` > 1): ``('data', 'fsdp', 'tensor')``, or
  ``('data', 'intra', 'fsdp', 'tensor')`` when hierarchical as well. ``'data'`` (outermost,
  so it runs across processes/nodes/slices) are the replicas that reduce through the quantized
  collective; ``'fsdp'`` splits parameters, gradients, optimizer state and the batch within a
  replica; ``'tensor'`` splits heads and the MLP hidden dimension. The model axes are ``Auto``
  (GSPMD partitions the model's compute); see :mod:`.sharding`.

Every layout is placed on the physical chips by :func:`device_grid` (torus axes on one TPU
slice, ``data`` across slices or GPU nodes); simulated CPU devices keep their order.
"""

from __future__ import annotations

import itertools
import math
import os

import jax
import numpy as np
from jax.experimental import mesh_utils
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
    "layers": "",  # the stacked layer axis of scanned blocks (model.scan_layers)
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

    Args:
      coordinator_address: ``HOST:PORT`` of process 0, ``"auto"``, or ``None`` (environment).
      num_processes: the number of processes, or ``None`` (environment).
      process_id: this process's index, or ``None`` (environment).

    Returns:
      Whether JAX was initialized for several processes.
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
    -1 (the rest).

    Args:
      num_devices: the number of devices of the mesh.
      data, fsdp, tensor: ``mesh.data``, ``mesh.fsdp``, ``mesh.tensor``: positive sizes, at
        most one of them -1.
      intra_size: ``mesh.intra_size``, replicas per group of a hierarchical reduction; must
        divide the data size.

    Returns:
      The three sizes by axis name with the -1 resolved (the data size counts every replica;
      ``intra`` splits it and is not an entry).

    Raises:
      ValueError: naming the ``mesh.*`` setting when the sizes do not multiply to the number
        of devices (with a -1: do not divide it), when a size is neither a positive int nor
        -1, when more than one is -1, or when ``intra_size`` does not divide the data size.
    """
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
    return sizes


class MeshLayoutError(ValueError):
    """A ``(data, fsdp, tensor)`` shape that cannot be laid out on the devices' physical
    topology; the message is one line naming the topology and the shapes that can."""


def _granules(devices) -> list:
    """The groups of devices joined by the slow network: TPU slices (``slice_index``) or, on
    GPU, processes (nodes); one group on CPU and on a single slice."""
    platform = devices[0].platform
    if platform == "tpu":
        key = lambda d: getattr(d, "slice_index", 0)
    elif platform == "gpu":
        key = lambda d: d.process_index
    else:
        return [devices]
    groups: dict = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    return [groups[k] for k in sorted(groups)]


def describe_topology(devices) -> str:
    """``'TPU v5 4x4x4 (64 chips)'``, ``'2 slices of TPU v5 lite 4x4x1 (32 chips)'``, or the
    device count and kind where devices have no physical coordinates.

    Args:
      devices: the devices (e.g. ``jax.devices()``); the grid is that of the first slice (GPU:
        process).

    Returns:
      The one-line description.
    """
    devices = list(devices)
    granules = _granules(devices)
    first = granules[0]
    coords = [getattr(d, "coords", None) for d in first]
    kind = devices[0].device_kind
    if None in coords:
        grid = f"{len(first)} devices"
    else:
        grid = "x".join(str(max(c[i] for c in coords) + 1) for i in range(len(coords[0])))
    unit = "slices" if devices[0].platform == "tpu" else "processes"
    text = f"{kind} {grid}"
    return f"{len(granules)} {unit} of {text}" if len(granules) > 1 else text


def _grid(shape: tuple[int, ...], devices, granules: list) -> np.ndarray:
    """Devices arranged as ``shape`` on the physical topology (raises what jax raises)."""
    if len(granules) > 1:
        g = len(granules)
        if shape[0] % g:
            raise ValueError(f"mesh.data={shape[0]} is not a multiple of the {g} slices")
        ici = (shape[0] // g, *shape[1:])
        dcn = (g,) + (1,) * (len(shape) - 1)
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=devices[0].platform != "tpu",
            allow_split_physical_axes=True)
    try:  # keep physical axes whole when the shape allows it (the faster rings)
        return mesh_utils.create_device_mesh(shape, devices)
    except (NotImplementedError, AssertionError, ValueError):
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def layouts(devices, ndim: int = 3) -> list[tuple[int, ...]]:
    """Every ``ndim``-axis shape (data outermost) that :func:`device_grid` can lay out on
    ``devices``.

    Args:
      devices: the devices.
      ndim: the number of mesh axes (3: data, fsdp, tensor; 4 with intra).

    Returns:
      The shapes whose sizes multiply to the number of devices and that lay out, in
      lexicographic order.
    """
    devices = list(devices)
    granules = _granules(devices)
    n = len(devices)
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    shapes = [s for s in itertools.product(divisors, repeat=ndim) if math.prod(s) == n]
    out = []
    for shape in shapes:
        try:
            _grid(shape, devices, granules)
        except (NotImplementedError, AssertionError, ValueError):
            continue
        out.append(shape)
    return out


def device_grid(shape: tuple[int, ...], devices) -> np.ndarray:
    """The devices as an array of ``shape`` (first axis ``data``) that maps onto the chips.

    * CPU devices (simulated or one per process): in the order given, as ``jax.make_mesh``.
    * One TPU slice: ``mesh_utils.create_device_mesh``, which assigns each mesh axis to whole
      physical axes of the torus; when the shape needs it (8×8×1 on a 4×4×4 v5p slice),
      physical axes are split (``allow_split_physical_axes``).
    * Several TPU slices (devices carry ``slice_index``), or GPUs in several processes when
      ``data`` is a multiple of the process count: a hybrid mesh as maxtext's
      (``create_hybrid_device_mesh``): ``data`` runs across the slices (nodes), over the
      data-centre network, where the quantized reduction pays; ``data / slices`` replicas
      and ``fsdp``/``tensor`` stay inside each slice (node), on the fast interconnect.
      A GPU ``data`` axis smaller than the process count lets ``fsdp`` span nodes (device
      order).

    Args:
      shape: the mesh shape, ``data`` first (1 to 4 axes, named as in :func:`make_mesh`).
      devices: the devices, ``prod(shape)`` of them.

    Returns:
      A numpy object array of ``shape`` holding the devices.

    Raises:
      MeshLayoutError: the shape cannot be laid out (one line: the topology and the shapes
        that fit).
    """
    devices = list(devices)
    shape = tuple(int(s) for s in shape)
    if devices[0].platform not in ("tpu", "gpu"):
        return np.asarray(devices, dtype=object).reshape(shape)
    granules = _granules(devices)
    if devices[0].platform == "gpu" and len(granules) > 1 and shape[0] % len(granules):
        granules = [devices]
    try:
        return _grid(shape, devices, granules)
    except (NotImplementedError, AssertionError, ValueError) as e:
        fits = ", ".join("x".join(map(str, s)) for s in layouts(devices, len(shape)))
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        names = {1: "data", 2: "data x intra", 3: "data x fsdp x tensor",
                 4: "data x intra x fsdp x tensor"}[len(shape)]
        raise MeshLayoutError(
            f"mesh {'x'.join(map(str, shape))} ({names}) cannot be laid out on "
            f"{describe_topology(devices)} ({reason}); shapes that fit: {fits}") from None


def make_mesh(intra_size: int = 1, devices=None, *, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """The mesh over ``devices`` (default: all devices of all processes), data axis outermost:
    ``('data',)``, ``('data', 'intra')`` or, with ``fsdp``/``tensor`` > 1,
    ``('data', 'fsdp', 'tensor')`` or ``('data', 'intra', 'fsdp', 'tensor')`` (see the module
    docstring), laid out on the physical topology by :func:`device_grid` (on several slices
    ``'data'`` runs across them: with ``intra_size`` = the replicas of one slice, only the
    quantized reduction leaves a slice).

    Args:
      intra_size: replicas per node of a hierarchical reduction (1: one data axis).
      devices: the devices (default: all of every process).
      fsdp: parameter/optimizer-state split within a replica group.
      tensor: attention heads / MLP hidden split.

    Returns:
      The mesh.
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(len(devices), -1, fsdp, tensor, intra_size)
    n = sizes[DATA_AXIS]
    data = ((n,), (DATA_AXIS,)) if intra_size == 1 else (
        (n // intra_size, intra_size), (DATA_AXIS, INTRA_AXIS))
    if fsdp > 1 or tensor > 1:  # GSPMD partitions the model: Auto axes
        shape, names, kind = data[0] + (fsdp, tensor), data[1] + MODEL_AXES, AxisType.Auto
    else:  # jax.make_mesh's default axis type
        (shape, names), kind = data, AxisType.Explicit
    return Mesh(device_grid(shape, devices), names, axis_types=(kind,) * len(shape))


def mesh_from_config(mesh_config, devices=None) -> Mesh:
    """:func:`make_mesh` of a config's ``mesh`` section (``data``, ``fsdp``, ``tensor``,
    ``intra_size``).

    Args:
      mesh_config: the config's ``mesh`` group (one of ``data``/``fsdp``/``tensor`` may be -1).
      devices: the devices (default: all of every process).

    Returns:
      The mesh.

    Raises:
      ValueError: sizes that do not fit the number of devices (:func:`mesh_shape`).
      MeshLayoutError: a shape that cannot be laid out on the chips (:func:`device_grid`).
    """
    devices = jax.devices() if devices is None else list(devices)
    sizes = mesh_shape(len(devices), mesh_config.data, mesh_config.fsdp, mesh_config.tensor,
                       mesh_config.intra_size)
    return make_mesh(mesh_config.intra_size, devices, fsdp=sizes[FSDP_AXIS],
                     tensor=sizes[TENSOR_AXIS])


def model_axes(mesh: Mesh) -> tuple[str, ...]:
    """The model axes of ``mesh`` with more than one device (GSPMD splits the model there).

    Args:
      mesh: the run's mesh.

    Returns:
      Those of ``('fsdp', 'tensor')``, in that order; ``()`` on a data-parallel mesh.
    """
    return tuple(a for a in MODEL_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """All data-parallel axes of ``mesh``, outermost first (batches are split over these).

    Args:
      mesh: the run's mesh.

    Returns:
      The data axis names, outermost first.
    """
    return tuple(name for name in (DATA_AXIS, INTRA_AXIS) if name in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
    """The number of data-parallel replicas of ``mesh``: the product of its :func:`data_axes`
    (the gradient reduction crosses them; ``fsdp`` and ``tensor`` devices belong to one
    replica).

    Args:
      mesh: the run's mesh.

    Returns:
      The replica count, 1 when nothing crosses replicas (e.g. ``data=1, fsdp=8``).
    """
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a batch's rows are split over: every data axis, then ``fsdp`` when it splits
    the model (tensor-parallel devices share their rows).

    Args:
      mesh: the run's mesh.

    Returns:
      The axis names, outermost first.
    """
    return data_axes(mesh) + tuple(a for a in model_axes(mesh) if a == FSDP_AXIS)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[global_batch, seq]`` array: rows split over :func:`batch_axes`.

    Args:
      mesh: the run's mesh.

    Returns:
      ``NamedSharding(mesh, P(batch_axes(mesh)))``.
    """
    return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on ``mesh``.

    Args:
      mesh: the mesh.

    Returns:
      ``NamedSharding(mesh, P())``.
    """
    return NamedSharding(mesh, P())
