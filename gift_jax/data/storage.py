"""Data artifacts (trained tokenizers, tokenized streams) on local disks or object storage.

Paths go through ``etils.epath`` (``gs://`` and other object stores as well as local files), and
processes coordinate through JAX's runtime, never through file locks (which do not span hosts
with separate disks and do not exist on object storage): process 0 builds a missing artifact
and writes it atomically (a temporary name, then a rename) while the other processes wait on
a barrier; a process that then still does not see it (a host whose cache is on its own local
disk) builds its own copy. The builders are deterministic, so every copy, and whichever rename
of concurrent separate jobs lands last, holds the same bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from etils import epath

from gift_jax.data.errors import DataError


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an object-store URL (``gs://bucket/…``) rather than a local path.

    Args:
      path: a path or URL.

    Returns:
      Whether it contains ``://``.
    """
    return "://" in str(path)


def local_or_url(path: str | os.PathLike) -> str:
    """A local path made absolute (``~`` expanded); an object-store URL as it is.

    Args:
      path: a path or URL.

    Returns:
      The absolute local path, or the URL, as a string.
    """
    return str(path) if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def barrier(name: str) -> None:
    """Waits for every process of the job (a no-op with one).

    Args:
      name: the barrier's name, the same in every process.
    """
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def first_then_rest(build: Callable[[], None], name: str) -> None:
    """Runs ``build`` on process 0, waits for every process (barrier ``name``), then on the
    other processes (``build`` must be a no-op where its result exists already).

    Args:
      build: the idempotent builder, called once per process.
      name: the barrier's name.
    """
    import jax

    if jax.process_index() == 0:
        build()
    barrier(name)
    if jax.process_index() != 0:
        build()


def cached(path: str | os.PathLike, build: Callable[[epath.Path], None], what: str
           ) -> epath.Path:
    """``path``, built with ``build(tmp)`` (which writes the artifact to ``tmp``) where it is
    missing: first by process 0, then by any process that still does not see it.

    Args:
      path: the artifact (local or object storage).
      build: writes the artifact to the temporary path it is given, which is then renamed
        to ``path``.
      what: the artifact's description, for messages.

    Returns:
      ``path`` as an ``epath.Path``.

    Raises:
      DataError: one line naming ``what`` and ``path`` when the storage cannot be reached
        (e.g. object storage without credentials).
    """
    path = epath.Path(path)

    def make() -> None:
        try:
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.parent / f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
                build(tmp)
                tmp.rename(path)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - storage back ends raise many kinds of errors
            raise DataError(f"{what} {str(path)!r} cannot be written: {type(e).__name__}: "
                            f"{first_line(e)}{credentials_hint(path)}") from None

    first_then_rest(make, f"gift_jax data artifact {path.name}")
    return path


def first_line(error: BaseException) -> str:
    """The first line of an error's message (libraries append tracebacks and context).

    Args:
      error: the error.

    Returns:
      The first line of ``str(error)`` stripped, or ``""``.
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def credentials_hint(path) -> str:
    """What to check when object storage (a ``scheme://`` path) cannot be reached.

    Args:
      path: the path that could not be reached.

    Returns:
      A ``"; on object storage check ..."`` suffix for a message, or ``""`` for a local path.
    """
    if is_remote(path):
        return ("; on object storage check the credentials (e.g. `gcloud auth "
                "application-default login`) and that the bucket exists")
    return ""
