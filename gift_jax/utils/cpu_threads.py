"""One OpenBLAS thread per LAPACK call, so refreshes on CPU do not oversubscribe the cores.

On CPU, jaxlib runs ``eigh``/``svd``/``cholesky``/``qr`` (GIFT's factor builds, PLUMAGE's
SVDs) through scipy's OpenBLAS, *inside* XLA's own intra-op thread pool, which already runs
one task per core (and, with simulated devices, one program per device).  By default OpenBLAS
starts its own thread per core for every call and its threads busy-wait, so the two pools
fight over the cores.  Measured here (2 cores, load average ~7): one 344×344 ``eigh`` took
3.44 s with OpenBLAS's default threading and 0.011–0.020 s with one thread; a rank-32 GIFT
factor build 2.1 s vs 0.06 s.  (``python /tmp/...`` snippet in docs/gift_results.md, §3.)

:func:`limit_openblas_threads` runs when :mod:`gift_jax` is imported: unless the user set
``OPENBLAS_NUM_THREADS`` themselves, it sets it to 1 for OpenBLAS libraries loaded later
(jaxlib loads scipy's lazily, at the first decomposition) and, for ones already loaded, calls
their ``openblas_set_num_threads(1)``.  Accelerator backends are unaffected.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["limit_openblas_threads"]

_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads",
            "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_")


def _loaded_openblas() -> list[str]:
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower()}
    except OSError:  # not Linux: only the environment variable applies
        return []
    return sorted(p for p in paths if p.endswith(".so") or ".so." in p)


def limit_openblas_threads(threads: int = 1) -> bool:
    """Limit OpenBLAS to ``threads`` unless ``OPENBLAS_NUM_THREADS`` is already set.

    Returns whether a limit was applied (``False``: the user's setting is kept).

    Args:
      threads: threads per OpenBLAS call; written to ``OPENBLAS_NUM_THREADS`` (for libraries
        loaded later) and passed to ``openblas_set_num_threads`` of those already loaded.

    Returns:
      Whether a limit was applied (``False``: ``OPENBLAS_NUM_THREADS`` was set and is kept).
    """
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return False
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                break
    return True
