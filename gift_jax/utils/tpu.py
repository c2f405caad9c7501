"""TPU pod topologies without a TPU: libtpu's compile-only devices.

``pip install "gift-jax[tpu]"`` brings libtpu, the real TPU compiler. On any host (a CPU-only
laptop or CI machine) ``jax.experimental.topologies.get_topology_desc`` then gives the devices
of a TPU slice, or of several slices (``num_slices``; each device carries ``slice_index``),
that programs can be compiled for (never run): the SPMD partitioner, fusion, the
latency-hiding scheduler, HBM buffer assignment and Mosaic for Pallas kernels all run as they
would on the pod. This is how maxtext (``train_compile.py``) and axlearn
(``run_aot_compilation``) check a configuration before renting the pod.

Names. :func:`parse_topology` takes Cloud TPU's accelerator types (``v5p-128``: 128
TensorCores, i.e. 64 chips of 2 cores on a ``4x4x4`` torus; ``v5e-256``/``v6e-256``: 256
single-core chips on a ``16x16`` grid; ``v4-128``: 64 chips) or libtpu's own
``v5p:4x4x4`` form.

Sharing libtpu. libtpu takes a process-wide lock file (``/tmp/libtpu_lockfile``) when it
initialises; a second process that loads it would wait or fail. :func:`topology_devices` sets
``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (unless set) so that tests, scripts and a training process can
each load it at once; nothing here opens a real TPU. libtpu also prints warnings about
``TPU_ACCELERATOR_TYPE``/``TPU_WORKER_HOSTNAMES`` on a host without TPUs, harmless for
compile-only devices: they are kept off the terminal (:func:`_quiet_stderr`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys

#: HBM per chip in GiB (Cloud TPU's published figures).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
#: TensorCores per chip, the unit of Cloud TPU's accelerator-type number (``v5p-128``).
CORES_PER_CHIP = {"v4": 2, "v5e": 1, "v5p": 2, "v6e": 1}
#: Chip grids of the slice sizes Cloud TPU offers, by chip count (3-D tori for v4/v5p,
#: 2-D grids for v5e/v6e).
_GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
             256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}
GRIDS = {"v4": _GRIDS_3D, "v5p": _GRIDS_3D, "v5e": _GRIDS_2D, "v6e": _GRIDS_2D}
#: Device kinds (``device.device_kind``) of each generation.
DEVICE_KINDS = {"v4": "TPU v4", "v5p": "TPU v5", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
INSTALL_HINT = 'the TPU compiler (libtpu) is not installed: pip install "gift-jax[tpu]"'


class TopologyError(ValueError):
    """A topology name, slice count or missing compiler; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU job: ``slices`` slices of ``grid`` chips of generation ``generation``."""

    generation: str  # v4, v5e, v5p, v6e
    grid: str  # chips per slice, e.g. "4x4x4"
    slices: int = 1

    @property
    def chips_per_slice(self) -> int:
        return math.prod(int(v) for v in self.grid.split("x"))

    @property
    def chips(self) -> int:
        return self.chips_per_slice * self.slices

    @property
    def hbm_bytes(self) -> int:
        """HBM of one chip."""
        return HBM_GIB[self.generation] * 2**30

    @property
    def libtpu_name(self) -> str:
        return f"{self.generation}:{self.grid}"

    @property
    def label(self) -> str:
        """``'v5p-128'`` or ``'2 x v5e-256'``."""
        name = f"{self.generation}-{self.chips_per_slice * CORES_PER_CHIP[self.generation]}"
        return f"{self.slices} x {name}" if self.slices > 1 else name


def known_topologies() -> list[str]:
    """Every accelerator type :func:`parse_topology` knows."""
    return [f"{g}-{n * CORES_PER_CHIP[g]}" for g, grids in GRIDS.items() for n in grids]


def parse_topology(name: str, slices: int = 1) -> Topology:
    """``v5p-128`` (Cloud TPU accelerator type) or ``v5p:4x4x4`` (libtpu) → :class:`Topology`.
    Raises :class:`TopologyError` listing the known names.

    Args:
      name: an accelerator type ``GEN-CORES`` (GEN one of v4, v5e, v5p, v6e; CORES the
        TensorCores of one slice, see :func:`known_topologies`) or libtpu's ``GEN:AxBxC``
        (``GEN:AxB`` for v5e/v6e); case and surrounding spaces are ignored.
      slices: the number of slices (multi-slice over DCN), a positive int.

    Returns:
      The :class:`Topology`: generation, chip grid of one slice, and ``slices``.

    Raises:
      TopologyError: ``slices`` is not a positive int, the name is unknown (the message lists
        the known names), or a libtpu grid has the wrong number of dimensions or a
        non-positive one.
    """
    if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
        raise TopologyError(f"--slices={slices!r} must be a positive int")
    known = ", ".join(known_topologies())
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)[-:](\S+)", name.strip().lower())
    if m is None:
        raise TopologyError(f"unknown topology {name!r}; known: {known} (or GEN:AxBxC)")
    generation, size = m.groups()
    if ":" in name:
        dims = size.split("x")
        if len(dims) != (3 if generation in ("v4", "v5p") else 2) or not all(
                d.isdigit() and int(d) > 0 for d in dims):
            raise TopologyError(f"topology {name!r}: {generation} grids are "
                                f"{'AxBxC' if generation in ('v4', 'v5p') else 'AxB'}")
        return Topology(generation, size, slices)
    cores = int(size) if size.isdigit() else -1
    chips, rest = divmod(cores, CORES_PER_CHIP[generation])
    if rest or chips not in GRIDS[generation]:
        raise TopologyError(f"unknown topology {name!r}; known: {known} (or GEN:AxBxC)")
    return Topology(generation, GRIDS[generation][chips], slices)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to /dev/null (libtpu's C++ start-up warnings)."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def libtpu_available() -> bool:
    """Whether libtpu (the TPU compiler) can be loaded in this process."""
    try:
        compile_only_devices("v5p:1x1x1")
    except TopologyError:
        return False
    return True


@functools.cache
def compile_only_devices(libtpu_name: str, slices: int = 1) -> tuple:
    """The compile-only devices of a libtpu topology (``"v5p:4x4x4"``), cached. Raises
    :class:`TopologyError` with the install line when libtpu is missing.

    Args:
      libtpu_name: libtpu's topology name of one slice, ``GEN:AxBxC`` or ``GEN:AxB``.
      slices: the number of slices (each device carries ``slice_index``).

    Returns:
      The devices of all slices, as a tuple (they compile programs, never run them).

    Raises:
      TopologyError: libtpu is not installed (the message is the install line), or libtpu
        cannot build this topology (its first error line).
    """
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise TopologyError(INSTALL_HINT) from None
    from jax.experimental import topologies

    kwargs = {"num_slices": slices} if slices > 1 else {}
    try:
        with _quiet_stderr():
            desc = topologies.get_topology_desc(topology_name=libtpu_name, platform="tpu",
                                                **kwargs)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TopologyError(f"libtpu cannot build topology {libtpu_name!r}: {first}") from None
    return tuple(desc.devices)


def topology_devices(topology: Topology) -> list:
    """The compile-only devices of ``topology`` (all slices).

    Args:
      topology: the TPU job, e.g. from :func:`parse_topology`.

    Returns:
      Its ``topology.chips`` compile-only devices, as a list (e.g. for a mesh).

    Raises:
      TopologyError: libtpu is missing or cannot build the topology.
    """
    return list(compile_only_devices(topology.libtpu_name, topology.slices))


def one_chip_device(device_kind: str):
    """A compile-only device of ``device_kind`` (``"TPU v5"``), or ``None`` when libtpu is
    absent or the kind is not one of :data:`DEVICE_KINDS` (the Mosaic compile check of
    :mod:`gift_jax.comm.kernels.backend`).

    Args:
      device_kind: a ``device.device_kind`` such as ``"TPU v5"`` or ``"TPU v5 lite"``, or
        ``"TPU <generation>"`` (e.g. ``"TPU v5p"``).

    Returns:
      The first device of the generation's smallest slice, or ``None``.
    """
    for generation, kind in DEVICE_KINDS.items():
        if kind == device_kind or f"TPU {generation}" == device_kind:
            grid = GRIDS[generation][min(GRIDS[generation])]
            try:
                return compile_only_devices(f"{generation}:{grid}")[0]
            except TopologyError:
                return None
    return None
