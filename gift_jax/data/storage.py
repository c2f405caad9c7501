"""Data artifacts (trained tokenizers, tokenized streams) on local disks or object storage.

Paths go through ``etils.epath`` (``gs://`` and other object stores as well as local files), and
processes coordinate through JAX's runtime, never through file locks (which do not span hosts
with separate disks and do not exist on object storage): process 0 builds a missing artifact
and writes it atomically (a temporary name, then a rename); the other processes wait on a
barrier and read it. Separate jobs that share a cache build the same bytes (the builders are
deterministic), so whichever rename lands last leaves the same file.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from etils import epath

from gift_jax.data.errors import DataError


def barrier(name: str) -> None:
    """Waits for every process of the job (a no-op with one)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def cached(path: str | os.PathLike, build: Callable[[epath.Path], None], what: str
           ) -> epath.Path:
    """``path``, built by process 0 with ``build(tmp)`` (which writes the artifact to ``tmp``)
    when it is missing; every process returns once it exists.

    Raises:
      DataError: one line naming ``what`` and ``path`` when the storage cannot be reached
        (e.g. object storage without credentials).
    """
    import jax

    path = epath.Path(path)
    try:
        if jax.process_index() == 0 and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{path.name}.{os.getpid()}.tmp"
            build(tmp)
            tmp.rename(path)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - storage back ends raise many kinds of errors
        raise DataError(f"{what} {str(path)!r} cannot be written: {type(e).__name__}: "
                        f"{first_line(e)}{credentials_hint(path)}") from None
    barrier(f"gift_jax data artifact {path.name}")
    return path


def first_line(error: BaseException) -> str:
    """The first line of an error's message (libraries append tracebacks and context)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def credentials_hint(path) -> str:
    """What to check when object storage (a ``scheme://`` path) cannot be reached."""
    if "://" in str(path):
        return ("; on object storage check the credentials (e.g. `gcloud auth "
                "application-default login`) and that the bucket exists")
    return ""
