"""gift_jax limits OpenBLAS to one thread on import unless the user chose a count."""

import os
import subprocess
import sys

SNIPPET = "import os, gift_jax; print(os.environ['OPENBLAS_NUM_THREADS'])"


def _run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if env_value is not None:
        env["OPENBLAS_NUM_THREADS"] = env_value
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                         text=True, check=True, timeout=300)
    return out.stdout.strip()


def test_import_sets_one_thread_and_respects_the_user():
    assert _run(None) == "1"
    assert _run("3") == "3"


def test_limit_reports_whether_it_applied(monkeypatch):
    from gift_jax.utils.cpu_threads import limit_openblas_threads

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert limit_openblas_threads() is False
    monkeypatch.delenv("OPENBLAS_NUM_THREADS")
    assert limit_openblas_threads() is True and os.environ["OPENBLAS_NUM_THREADS"] == "1"
