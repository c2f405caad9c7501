"""Test setup: 8 simulated CPU devices, set before JAX initialises."""

import os
import tempfile

from codegen import SUITE_CODEGEN, xla_flags  # imports no JAX

# The suite's code generation (tests/codegen.py): level 0, unless the user's XLA_FLAGS set it.
_SUITE_FLAGS = "" if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "") else (
    xla_flags(SUITE_CODEGEN))
# XLA:CPU aborts the process when a collective's participants do not all arrive within 40 s
# (its default); 8 simulated devices on 2 busy cores, with a collective per layer inside the
# backward loop, can take longer: 15 minutes, unless the user's XLA_FLAGS set it.
_TIMEOUT_FLAGS = "" if "collective_call_terminate" in os.environ.get("XLA_FLAGS", "") else (
    "--xla_cpu_collective_call_terminate_timeout_seconds=900")
os.environ["XLA_FLAGS"] = (
    f'{os.environ.get("XLA_FLAGS", "")} {_SUITE_FLAGS} {_TIMEOUT_FLAGS} '
    '--xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Source locations of one frame, not ten (the op names stay): every op's location travels
# through lowering and every XLA pass as metadata; this takes about a tenth off a trainer
# step's trace-lower-compile and changes no computation.  A user's own setting wins.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "false")
# One compilation cache for the whole run, shared by pytest-xdist's workers and the scripts
# the tests start (they inherit the environment): the trainer tests compile the same small
# programs many times.  Keyed by the HLO, the flags and the backend, so a hit is the same
# executable.  Set in the controller before the workers start; a user's own setting wins.
_OWN_CACHE = None
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="gift_jax_test_jit_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

from gift_jax.utils.cpu_devices import avoid_cpu_dot_crash  # noqa: E402

avoid_cpu_dot_crash()  # before JAX initialises (jaxlib 0.10/0.11 XLA:CPU dot crash)


import logging  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402

import pytest  # noqa: E402

#: The repository's config files.
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def pytest_collection_modifyitems(config, items):
    """The ``slow`` tests (end-to-end runs, each compiling whole train steps) first, each group
    in its own order: pytest-xdist hands the workers contiguous halves and the idle one
    steals from the other's end, so a run ends on short tests, not on a worker finishing a
    long one alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_unconfigure(config):
    """Removes the run's compilation cache (the controller's, once every worker is done)."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
