"""Test setup: 8 simulated CPU devices, set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from gift_jax.utils.cpu_devices import avoid_cpu_dot_crash  # noqa: E402

avoid_cpu_dot_crash()  # before JAX initialises (jaxlib 0.10/0.11 XLA:CPU dot crash)
