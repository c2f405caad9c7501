"""Processes, devices and the data-parallel mesh.

The mesh has one data-parallel axis ``'data'`` over every device, or, for the hierarchical
all-reduce (``mesh.intra_size > 1``), two axes ``('data', 'intra')``: ``'intra'`` groups
``intra_size`` neighbouring devices (a node), ``'data'`` runs across groups. Batches are
sharded over all data-parallel axes together; parameters are replicated.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"
INTRA_AXIS = "intra"


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """``jax.distributed.initialize`` when coordinator settings are given.

    Settings come from the arguments or, when absent, from the environment variables
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. Without a
    coordinator address nothing happens (a single-process run). Returns whether JAX was
    initialized for several processes.
    """
    address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
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


def make_mesh(intra_size: int = 1, devices=None) -> Mesh:
    """The data-parallel mesh over ``devices`` (default: all devices of all processes)."""
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    if intra_size < 1 or n % intra_size:
        raise ValueError(f"mesh.intra_size={intra_size} must divide the number of devices ({n})")
    if intra_size == 1:
        return jax.make_mesh((n,), (DATA_AXIS,), devices=devices)
    return jax.make_mesh((n // intra_size, intra_size), (DATA_AXIS, INTRA_AXIS), devices=devices)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """All data-parallel axes of ``mesh``, outermost first (batches are split over these)."""
    return tuple(name for name in (DATA_AXIS, INTRA_AXIS) if name in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``[global_batch, seq]`` array: rows split over every data axis."""
    return NamedSharding(mesh, P(data_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, P())
