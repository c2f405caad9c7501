"""Simulated data-parallel devices on a CPU host, the way the scripts start JAX.

A data-parallel run on one device reduces nothing: the codec and the method never touch a
wire. On a CPU host the scripts therefore ask JAX for several CPU devices (8 by default, as
the demo and the tests use), through the ``jax_num_cpu_devices`` option. Only JAX's CPU backend
is affected: on a GPU or TPU host the accelerators are the devices, as before. An
``XLA_FLAGS`` that already sets ``--xla_force_host_platform_device_count`` wins.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

__all__ = ["FORCE_COUNT_FLAG", "MAX_ISA_FLAG", "YNN_FUSION_FLAG", "avoid_cpu_dot_crash",
           "pin_cpu_isa", "simulate_cpu_devices"]

#: The XLA flag that sets the number of CPU devices; when ``XLA_FLAGS`` holds it, it decides.
FORCE_COUNT_FLAG = "--xla_force_host_platform_device_count"


#: XLA:CPU's YNNPACK fusions (an experimental dot backend) crash with SIGSEGV in jaxlib 0.10.x
#: and 0.11.x (in ``ynn::dot_fp32_5x64x1_1x16x1_avx512``) on some fp32 dots, e.g. in the refresh
#: step of GIFT with routing on the tiny Llama; jaxlib 0.12 runs the same program. Setting the
#: fusion type to empty turns the YNN fusions off (XLA's own dot emitters run instead).
YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def avoid_cpu_dot_crash() -> bool:
    """Adds ``--xla_cpu_experimental_ynn_fusion_type=`` to ``XLA_FLAGS`` when the installed
    jaxlib is affected (0.10 ≤ version < 0.12) and ``XLA_FLAGS`` does not set the flag already.
    Call it before JAX initialises its backends (the scripts and the tests do); returns
    whether the flag was added."""
    try:
        major_minor = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if not (0, 10) <= major_minor < (0, 12) or YNN_FUSION_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {YNN_FUSION_FLAG}=".strip()
    return True


#: The XLA flag capping the instruction set XLA:CPU compiles for.
MAX_ISA_FLAG = "--xla_cpu_max_isa"


def pin_cpu_isa(isa: str = "AVX2") -> bool:
    """Adds ``--xla_cpu_max_isa=isa`` to ``XLA_FLAGS`` on an x86-64 host (unless the flag is
    set already), so XLA:CPU compiles the same vector code on every such CPU that has
    ``isa``; returns whether it was added. Call it before JAX initialises its backends.

    Why: XLA:CPU vectorizes with the host's widest instruction set, and the fused training
    step rounds differently at another vector width. Measured with ``scripts/demo.py`` on
    one AMD EPYC (AVX-512) host: the fp32 rows are bit-identical under AVX2 and AVX-512, the
    low-precision rows are not (fp8 eval loss 2.5944 under AVX2, 2.5931 under AVX-512; the
    thread count changed nothing). The demo pins AVX2 (every x86-64 CPU since 2013 has it)
    so that its table reproduces across machines; training does not (it keeps the speed).

    Args:
      isa: the value of ``--xla_cpu_max_isa``, an instruction set XLA:CPU knows (e.g.
        ``"AVX2"``, ``"AVX512"``); not validated here.

    Returns:
      Whether the flag was added (``False`` on a non-x86-64 host or when ``XLA_FLAGS``
      already names ``--xla_cpu_max_isa``).
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if MAX_ISA_FLAG in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {MAX_ISA_FLAG}={isa}".strip()
    return True


def simulate_cpu_devices(count: int) -> bool:
    """Gives JAX's CPU backend ``count`` devices, unless ``XLA_FLAGS`` already sets a count.

    Call it before the first JAX operation (importing JAX or :mod:`gift_jax` is fine): JAX
    refuses the setting once its backends are initialised. Also applies
    :func:`avoid_cpu_dot_crash`. Returns whether the count was set.

    Args:
      count: the number of CPU devices, an int >= 1 (sets ``jax_num_cpu_devices``).

    Returns:
      Whether the count was set (``False``: ``XLA_FLAGS`` sets
      ``--xla_force_host_platform_device_count``, which decides).

    Raises:
      ValueError: ``count`` is not a positive int.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"the number of simulated CPU devices must be an int >= 1, got {count!r}")
    avoid_cpu_dot_crash()
    if FORCE_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
        return False
    import jax

    jax.config.update("jax_num_cpu_devices", count)
    return True
