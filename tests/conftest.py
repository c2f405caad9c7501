"""Test setup: 8 simulated CPU devices, set before JAX initialises."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from gift_jax.utils.cpu_devices import avoid_cpu_dot_crash  # noqa: E402

avoid_cpu_dot_crash()  # before JAX initialises (jaxlib 0.10/0.11 XLA:CPU dot crash)


import logging  # noqa: E402
import pathlib  # noqa: E402
import socket  # noqa: E402

import pytest  # noqa: E402

#: The repository's config files.
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture
def tiny_config():
    """A fresh copy of the completed ``configs/tiny.py`` (trainer defaults filled in)."""
    from gift_jax.training.config import complete_config, load_config

    return complete_config(load_config("tiny", CONFIGS))


@pytest.fixture
def gcs_bucket(monkeypatch):
    """``gs://gift-jax-test``: a bucket on a local Google Cloud Storage emulator, reached by
    etils.epath (through gcsfs) and by orbax (through TensorStore) like the real service."""
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    gcsfs = pytest.importorskip("gcsfs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = emulator.create_server("127.0.0.1", port, in_memory=True,
                                    default_bucket="gift-jax-test")
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    server.start()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)  # gcsfs
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", url)  # orbax's TensorStore
    # one request at a time: the emulator's conditional writes race (TensorStore's OCDBT
    # manifest then reads "Malformed StorageGeneration")
    monkeypatch.setenv("TENSORSTORE_GCS_REQUEST_CONCURRENCY", "1")
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        yield "gs://gift-jax-test"
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        server.stop()
