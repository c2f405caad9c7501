"""Simulated data-parallel devices on a CPU host, the way the scripts start JAX.

A data-parallel run on one device reduces nothing: the codec and the method never touch a
wire. On a CPU host the scripts therefore ask JAX for several CPU devices (8 by default, as
the demo and the tests use), through the ``jax_num_cpu_devices`` option. Only JAX's CPU backend
is affected: on a GPU or TPU host the accelerators are the devices, as before. An
``XLA_FLAGS`` that already sets ``--xla_force_host_platform_device_count`` wins.
"""

from __future__ import annotations

import os

__all__ = ["FORCE_COUNT_FLAG", "simulate_cpu_devices"]

#: The XLA flag that sets the number of CPU devices; when ``XLA_FLAGS`` holds it, it decides.
FORCE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(count: int) -> bool:
    """Gives JAX's CPU backend ``count`` devices, unless ``XLA_FLAGS`` already sets a count.

    Call it before the first JAX operation (importing JAX or :mod:`gift_jax` is fine): JAX
    refuses the setting once its backends are initialised. Returns whether the count was set.

    Raises:
      ValueError: ``count`` is not a positive int.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"the number of simulated CPU devices must be an int >= 1, got {count!r}")
    if FORCE_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
        return False
    import jax

    jax.config.update("jax_num_cpu_devices", count)
    return True
