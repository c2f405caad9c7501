"""Which platform a program is being built for: the lowering target, not this host.

A process on a CPU host can compile for a TPU pod (libtpu's compile-only devices, see
:mod:`gift_jax.utils.tpu`), and a kernel or an attention implementation must then be chosen
for the TPU. The target is read from the abstract device of the mesh in context, which
``jax.shard_map`` (and ``jax.set_mesh``) derive from the mesh's devices; only code traced with
no mesh in context falls back to this process's default backend.
"""

from __future__ import annotations

import jax

__all__ = ["host_platform", "kernel_platform", "non_manual_axes", "target_device"]


def kernel_platform(platform: str) -> str:
    """The kernel platform of a jax platform name: ``"gpu"`` (cuda, rocm), ``"tpu"``, or
    ``"interpret"`` (anything else).

    Args:
      platform: a jax platform name, e.g. ``jax.default_backend()`` or a device's ``platform``.

    Returns:
      ``"gpu"``, ``"tpu"`` or ``"interpret"``.
    """
    return {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(platform, "interpret")


def host_platform() -> str:
    """The kernel platform of this process's default backend."""
    return kernel_platform(jax.default_backend())


def target_device() -> tuple[str, str | None]:
    """``(kernel platform, device kind)`` of the program being traced: from the abstract
    device of the mesh in context (e.g. compile-only TPU devices on a CPU host), else this
    process's default backend (device kind ``None``)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if device is not None and getattr(device, "platform", None):
        return kernel_platform(device.platform), device.device_kind
    return host_platform(), None


def non_manual_axes(min_size: int = 2) -> tuple[str, ...]:
    """The axes of the mesh in context, of at least ``min_size`` devices, that are not
    ``Manual``: there GSPMD may split arrays, and it cannot partition a Pallas kernel.

    Args:
      min_size: the smallest axis size counted (the default 2 skips size-1 axes, which split
        nothing).

    Returns:
      Those axis names in mesh order; ``()`` with no mesh in context.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = jax.sharding.AxisType.Manual
    return tuple(name for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                  mesh.axis_types, strict=True)
                 if size >= min_size and kind != manual)
