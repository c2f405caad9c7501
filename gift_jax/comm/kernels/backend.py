"""Which implementation of the hot path runs: the Pallas kernel or its XLA reference.

Settings (``backend=`` of :func:`gift_jax.allreduce` and the collectives):

* ``"xla"`` — the jnp reference (XLA fuses it well on every platform);
* ``"pallas"`` — the kernel, compiled for the target device (interpreted on CPU); a kernel
  that cannot be built there raises;
* ``"auto"`` (default) — the kernel on GPU/TPU, the reference on CPU. Before a kernel is used
  for a ``(kernel, codec, shapes, chip)`` combination it is built once on its own: compiled
  for the target chip where a compiler for it is at hand (this process's own devices; any TPU
  generation through libtpu's compile-only devices), else lowered for it. Where that fails, or
  where a mesh axis in context is not manual (GSPMD cannot partition a kernel), the XLA path
  is used instead, with one warning naming the kernel, the codec and the reason. So
  ``"auto"`` never crashes on a platform or codec a kernel does not support.

The target is the platform of the program being built, not of this host
(:func:`target_device`): the devices of the mesh in context, which ``jax.shard_map`` (and
``jax.set_mesh``) put there. A process on a CPU host compiling ahead of time for a TPU
topology (``scripts/compile_pod.py``) therefore gets the Mosaic kernels; only code traced with
no mesh in context falls back to the default backend.

:func:`lowering_error` is the same check for any platform, from any host: it lowers through
``jax.export`` for ``cuda`` or ``tpu`` (the same Pallas lowering ``jax.jit`` runs on that device;
the Triton/Mosaic compile that follows on a device is not covered). The tests use it to prove
every kernel of every codec lowers for both.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax

from gift_jax.comm.codecs import Codec
from gift_jax.comm.kernels.quantize import KERNELS
from gift_jax.utils.platform import host_platform, non_manual_axes, target_device
from gift_jax.utils.tpu import one_chip_device

BACKENDS = ("auto", "xla", "pallas")
#: jax.export platform names of the kernel platforms.
EXPORT_PLATFORMS = {"gpu": "cuda", "tpu": "tpu"}
#: Devices assumed when lowering for a platform this host lacks (Triton on jax ≥ 0.12 and some
#: Mosaic TPU lowerings ask which chip they target).
DEFAULT_DEVICE_KIND = {"gpu": "NVIDIA H100", "tpu": "TPU v5"}


def resolve_backend(backend: str) -> str:
    """Validate a ``backend`` setting; returns it unchanged.

    Args:
      backend: the setting, one of :data:`BACKENDS` (``"auto"``, ``"xla"``, ``"pallas"``).

    Returns:
      ``backend``.

    Raises:
      ValueError: any other value.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed values: {BACKENDS}")
    return backend


def device_platform() -> str:
    """The kernel platform of the lowering target (:func:`target_device`): ``"gpu"``,
    ``"tpu"`` or ``"interpret"``."""
    return target_device()[0]


def _abstract_device_context(platform: str, device_kind: str):
    """Tell jax which chip to lower for when this host has none (unless the mesh in context
    already does)."""
    if not hasattr(jax.sharding, "AbstractDevice") or target_device()[1] is not None:
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1,
                                         platform=platform)
    mesh = jax.sharding.AbstractMesh((1,), ("_kernel",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def export_kernel(kind: str, codec: Codec, avals, platform: str, *,
                  device_kind: str | None = None, **static):
    """``jax.export`` of one kernel for ``platform`` ("gpu" → cuda, "tpu") on abstract args,
    lowered for the chip ``device_kind`` (default :data:`DEFAULT_DEVICE_KIND`).

    Only the custom-call serialization checks are disabled (a kernel's custom call has no
    cross-version compatibility guarantee, which does not matter for a lowering check).

    Args:
      kind: a kernel of :data:`~gift_jax.comm.kernels.quantize.KERNELS`: ``"quantize"`` or
        ``"dequantize_accumulate"``.
      codec: the wire format.
      avals: the kernel's positional arguments as ``jax.ShapeDtypeStruct`` s (``None`` for
        an absent scale or random bits): ``(x, leaf_scale, rand_bits)`` or
        ``(payload, row_scale, leaf_scale)``.
      platform: ``"gpu"`` or ``"tpu"``.
      device_kind: the chip (a ``device_kind`` such as ``"NVIDIA H100"``), or ``None``; it is
        ignored where the mesh in context already names its devices' chip.
      **static: further static keyword arguments of the kernel (``block_rows``, ``debug``).

    Returns:
      The ``jax.export.Exported`` kernel; a kernel that does not lower raises.
    """
    fn = functools.partial(KERNELS[kind][0], codec=codec, platform=platform, **static)
    checks = [jax.export.DisabledSafetyCheck.custom_call(t)
              for t in ("triton_kernel_call", "tpu_custom_call", "__gpu$xla.gpu.triton")]
    device_kind = device_kind or DEFAULT_DEVICE_KIND[platform]
    with _abstract_device_context(platform, device_kind), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jax ≥ 0.12: Triton deprecated
        return jax.export.export(jax.jit(fn), platforms=[EXPORT_PLATFORMS[platform]],
                                 disabled_checks=checks)(*avals)


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _compile_device(platform: str, device_kind: str | None):
    """The device a kernel for ``(platform, device_kind)`` is compiled for, or ``None`` when
    no compiler for it is at hand (then it can only be lowered)."""
    here = jax.devices()[0]
    if platform == host_platform() and device_kind in (None, here.device_kind):
        return here
    if platform == "tpu":
        return one_chip_device(device_kind or DEFAULT_DEVICE_KIND["tpu"])
    return None


@functools.cache
def _build_error(kind: str, codec: Codec, avals: tuple, platform: str,
                 device_kind: str | None = None) -> str | None:
    try:
        device = _compile_device(platform, device_kind)
        if device is None:
            export_kernel(kind, codec, avals, platform, device_kind=device_kind)
        else:  # the real compile (Triton or Mosaic), for the target chip
            fn = functools.partial(KERNELS[kind][0], codec=codec, platform=platform)
            on = jax.sharding.SingleDeviceSharding(device)
            jax.jit(fn).lower(*(None if a is None else jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=on) for a in avals)).compile()
    except Exception as e:  # any failure to build means: use the XLA path
        return _reason(e)
    return None


def _aval(a):
    return None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)


def lowering_error(kind: str, codec: Codec, args, platform: str,
                   device_kind: str | None = None) -> str | None:
    """``None`` if kernel ``kind`` builds for ``platform`` (the chip ``device_kind``, default
    this host's or :data:`DEFAULT_DEVICE_KIND`) on arguments shaped like ``args``, else the
    reason (cached per combination). Builds means compiles where a compiler for the chip is
    at hand (this host's own platform; any TPU when libtpu is installed: Mosaic), else lowers
    through ``jax.export``.

    Args:
      kind: ``"quantize"`` or ``"dequantize_accumulate"``.
      codec: the wire format.
      args: the kernel's positional arguments (arrays or ``jax.ShapeDtypeStruct`` s, ``None``
        for absent ones); only their shapes and dtypes matter.
      platform: ``"gpu"``, ``"tpu"`` or ``"interpret"``.
      device_kind: the chip, or ``None`` (see above).

    Returns:
      ``None`` when the kernel builds, else ``"<exception type>: <first line>"`` (at most 300
      characters).
    """
    return _build_error(kind, codec, tuple(_aval(a) for a in args), platform, device_kind)


_warned: set = set()


def choose(backend: str, kind: str, codec: Codec, args, platform: str | None = None) -> str:
    """``"pallas"`` or ``"xla"`` for one call of kernel ``kind`` (see the module docstring).

    Args:
      backend: ``"auto"``, ``"xla"`` or ``"pallas"``.
      kind: ``"quantize"`` or ``"dequantize_accumulate"``.
      codec: the wire format.
      args: the call's positional arguments (``None`` for absent ones), whose shapes and
        dtypes the build check of ``"auto"`` uses.
      platform: the kernel platform to decide for, or ``None``: the target of the program
        being traced (:func:`target_device`); another platform than the target is checked for
        this host's chip or :data:`DEFAULT_DEVICE_KIND`.

    Returns:
      ``backend`` itself for ``"xla"`` and ``"pallas"``; for ``"auto"``, ``"pallas"`` where
      the kernel builds on a GPU/TPU target with every mesh axis in context manual, else
      ``"xla"`` (with one ``RuntimeWarning`` per kernel, codec and platform).

    Raises:
      ValueError: an unknown ``backend``.
    """
    resolve_backend(backend)
    target, device_kind = target_device()
    if platform is None:
        platform = target
    elif platform != target:
        device_kind = None
    if backend == "xla" or (backend == "auto" and platform == "interpret"):
        return "xla"
    if backend == "pallas":
        return "pallas"
    auto_axes = non_manual_axes(min_size=1)
    reason = (f"the mesh axes {auto_axes} are not manual here (a kernel cannot be partitioned "
              "by GSPMD: call it inside a shard_map over every axis)" if auto_axes
              else lowering_error(kind, codec, args, platform, device_kind))
    if reason is None:
        return "pallas"
    key = (kind, codec, platform)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"gift_jax: the Pallas kernel {kind!r} does not build for codec {codec.name!r}"
            f" (block_size={codec.block_size}) on {platform}; using the XLA path instead."
            f" Reason: {reason}",
            RuntimeWarning,
            stacklevel=3,
        )
    return "xla"


def quantize(x, codec: Codec, leaf_scale=None, rand_bits=None, *, backend: str = "auto"):
    """Quantize ``x: f32[rows, B]`` (see
    :func:`gift_jax.comm.kernels.quantize.quantize_reference`).

    Args:
      x, leaf_scale, rand_bits: as :func:`~gift_jax.comm.kernels.quantize.quantize_reference`.
      codec: the wire format.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"`` (:func:`choose`).

    Returns:
      ``(payload u8[rows, row_bytes], row_scale [rows, 1] | None)``, the same bits on either
      path.

    Raises:
      ValueError: an unknown ``backend``.
    """
    kernel, reference = KERNELS["quantize"]
    args = (x, leaf_scale, rand_bits)
    if choose(backend, "quantize", codec, args) == "xla":
        return reference(x, codec, leaf_scale, rand_bits)
    return kernel(*args, codec=codec, platform=device_platform())


def dequantize_accumulate(payload, codec: Codec, row_scale=None, leaf_scale=None, *,
                          backend: str = "auto"):
    """Fixed-order fp32 sum of ``N`` received chunks (see the reference's docstring).

    Args:
      payload, row_scale, leaf_scale: as
        :func:`~gift_jax.comm.kernels.quantize.dequantize_accumulate_reference`.
      codec: the wire format.
      backend: ``"auto"``, ``"xla"`` or ``"pallas"`` (:func:`choose`).

    Returns:
      ``f32[rows, B]``, the same bits on either path.

    Raises:
      ValueError: an unknown ``backend``.
    """
    kernel, reference = KERNELS["dequantize_accumulate"]
    args = (payload, row_scale, leaf_scale)
    if choose(backend, "dequantize_accumulate", codec, args) == "xla":
        return reference(payload, codec, row_scale, leaf_scale)
    return kernel(*args, codec=codec, platform=device_platform())
