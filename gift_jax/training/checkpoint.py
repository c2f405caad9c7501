"""Checkpoints with orbax's ``CheckpointManager``: the whole training state, bit for bit.

A checkpoint holds two items:

* ``state``: the parameters and the *whole* optimizer state — Adam/Muon moments, PLUMAGE
  projectors and sampling key, GIFT factors, the all-reduce stage's stochastic-rounding key
  and its per-device error-feedback buffers (sharded arrays, saved and restored shard by
  shard with their ``P(data)`` sharding). It is saved as a flat mapping ``path → array`` so
  that any optax state (NamedTuples, ``None``, masked nodes) round-trips; the tree structure
  comes back from a freshly initialised state of the same config.
* ``meta`` (JSON): the step, the data position (index of the next batch), the number of
  skipped steps, the config and the list of state paths.

Every random choice of a run lives in the optimizer state (keys) or is a pure function of
``(seed, step)`` (the data order), so restoring these items continues the run bit-exactly.
A damaged checkpoint (a truncated or missing data file, a flipped bit in any file, missing
metadata or manifest, a missing commit marker, a step directory only partly written) never
stops a run: restoring takes the newest checkpoint that restores, warns in one line which step
was damaged and why, and moves the damaged one aside (``<step>.damaged``, not deleted). A run
therefore loses at most the steps since the last intact checkpoint. Damage is found before
orbax reads anything where possible: after each save, every file of the step is listed with
its size and CRC-32 (:data:`FILE_LISTING`, written by process 0 once orbax has committed the
step and every process has checksummed its share of the files), and a restore first checks
that manifest (sizes, then checksums, each process its share; the manifest checks its own
entries too); a missing, truncated or altered file then costs one line naming the file and
the step, not orbax's pages of asynchronous tracebacks (or, for a flipped bit, silently
wrong numbers).

Checkpoints written before the checksums: their metadata has no ``manifest`` entry, and they
are checked as before: a listing of sizes only (``{path: size}``) where there is one, else the
files without which orbax cannot read the step. A checkpoint whose metadata has the
``manifest`` entry but whose manifest is missing or unreadable (a crash or a ``SIGKILL``
between orbax's commit and the manifest) is damaged.

A checkpoint written with a different config is refused with the list of differing fields,
except the mesh (``mesh.data/fsdp/tensor/rules``): every array is a global array, restored
onto the new run's shardings, so a run resumes on another mesh shape; only the per-device
error-feedback buffers whose meaning follows the mesh restart from zero (with a warning).
A checkpoint of a former state layout restores where each array's former path is known
(:data:`FORMER_PATHS`: GIFT's state before it was one record per leaf).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
import zlib
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from gift_jax.data.storage import local_or_url
from gift_jax.training.config import config_differences, to_json
from gift_jax.whitening.stage import former_state_path

log = logging.getLogger(__name__)

#: The manifest of a checkpoint step: every file with its size in bytes and CRC-32, written
#: after orbax's commit (``{"version": 2, "checksum": "crc32", "files": {path: [size, crc]},
#: "digest": crc of the files' entries}``; checkpoints of before the checksums hold
#: ``{path: size}``).
FILE_LISTING = "gift_jax_files.json"

#: The manifest's format (:data:`FILE_LISTING`); the metadata of a checkpoint that has one
#: records it as ``manifest``.
MANIFEST_VERSION = 2

_CHUNK = 16 << 20  # bytes read at a time when checksumming

#: Where an array of today's state lived in a former layout (flat path → path or ``None``):
#: a checkpoint that lacks a path is read at its former one.
FORMER_PATHS = (former_state_path,)


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not belong to this run's config or state layout."""


class NoIntactCheckpointError(RuntimeError):
    """Every checkpoint of the directory was damaged (each has been moved aside)."""


class DamagedCheckpointError(RuntimeError):
    """A checkpoint whose files are all there but whose metadata lacks a required entry, or
    whose manifest is missing or disagrees with a file (a flipped bit)."""


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (all take the same decision)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


def _file_sizes(root: epath.Path) -> dict[str, int]:
    """``{path relative to root: size}`` of every file below ``root`` (but the listing)."""
    sizes = {}

    def visit(folder: epath.Path, prefix: str) -> None:
        # not Path.walk: on object storage it yields folders without their gs:// scheme
        for path in folder.iterdir():
            if path.is_dir():
                visit(path, f"{prefix}{path.name}/")
            elif path.name != FILE_LISTING:
                sizes[prefix + path.name] = int(path.stat().length)

    visit(root, "")
    return sizes


def file_checksum(path: epath.Path | str) -> int:
    """The CRC-32 (:func:`zlib.crc32`) of a file's bytes, read in 16 MiB chunks.

    CRC-32 finds every flipped bit and every burst of up to 32 bits, and any other change but
    for one chance in 2^32; it is in the standard library (about 3 GB/s on one core here,
    1.6 GB/s with the reads: :func:`checksum_cost`).

    Args:
      path: the file, local or an object-store URL.

    Returns:
      The checksum, an unsigned 32-bit integer.
    """
    crc = 0
    with epath.Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _mine(items: list) -> list:
    """This process's share of ``items`` (every process holds the same list)."""
    return items[jax.process_index()::jax.process_count()]


def _is_marker(path: str) -> bool:
    """Whether ``path`` is orbax's commit marker for object stores, which orbax may still be
    writing when the manifest is (several processes): it is left out of the manifest (and
    not checked in a former listing); the manifest, written after the commit, is the
    commit."""
    return epath.Path(path).name == "commit_success.txt"


def _entries_digest(files: dict[str, list[int]]) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True, separators=(",", ":")).encode())


def write_manifest(root: epath.Path | str) -> dict[str, Any]:
    """Writes the manifest (:data:`FILE_LISTING`) of the checkpoint step folder ``root``: every
    file with its size and CRC-32. Every process checksums its share of the files, the shares
    are gathered, and process 0 writes the manifest; all processes must call it.

    Args:
      root: the step's folder (``<workdir>/checkpoints/<step>``), complete.

    Returns:
      The manifest that was written.
    """
    root = epath.Path(root)
    sizes = _file_sizes(root)
    paths = sorted(p for p in sizes if not _is_marker(p))  # the same list on every process
    crcs = np.zeros(len(paths), np.uint32)  # (not int64: JAX without x64 gathers int32)
    for i in _mine(list(range(len(paths)))):
        crcs[i] = file_checksum(root / paths[i])
    if jax.process_count() > 1:  # each entry comes from one process, the others hold 0
        crcs = np.asarray(multihost_utils.process_allgather(crcs)).max(axis=0)
    files = {p: [int(sizes[p]), int(c)] for p, c in zip(paths, crcs, strict=True)}
    manifest = {"version": MANIFEST_VERSION, "checksum": "crc32", "files": files,
                "digest": _entries_digest(files)}
    if jax.process_index() == 0:
        (root / FILE_LISTING).write_text(json.dumps(manifest, sort_keys=True,
                                                    separators=(",", ":")))
    return manifest


def verify_manifest(root: epath.Path | str) -> None:
    """Checks the checkpoint step folder ``root`` against its manifest: every file there at
    its size, then this process's share of the checksums (processes split the files). A
    listing of sizes only (written before the checksums) checks sizes.

    Args:
      root: the step's folder (``<workdir>/checkpoints/<step>``), holding :data:`FILE_LISTING`.

    Raises:
      FileNotFoundError: a missing or truncated file (named).
      DamagedCheckpointError: the manifest is unreadable or altered, or a file's checksum
        differs (naming the file and the step).
    """
    root = epath.Path(root)
    step = root.name
    try:
        manifest = json.loads((root / FILE_LISTING).read_text())
        if isinstance(manifest, dict) and "version" in manifest:
            files = manifest["files"]
            if (manifest["version"] != MANIFEST_VERSION or manifest["checksum"] != "crc32"
                    or manifest["digest"] != _entries_digest(files)):
                raise ValueError("its entries do not match its digest")
            expected = {p: (int(size), None if crc is None else int(crc))
                        for p, (size, crc) in files.items()}
        else:  # before the checksums: {path: size}
            expected = {p: (int(size), None) for p, size in manifest.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        problem = f"{type(e).__name__}: {e}"
    else:
        problem = None
    if problem is not None:  # raised here, unchained: the warning shows this line
        raise DamagedCheckpointError(f"step {step}: its manifest {FILE_LISTING} is damaged "
                                     f"({problem})")
    found = _file_sizes(root)
    for path, (size, _) in expected.items():
        if _is_marker(path):
            continue
        if path not in found:
            raise FileNotFoundError(f"{path} is missing")
        if found[path] != size:
            raise FileNotFoundError(f"{path} has {found[path]} of its {size} bytes")
    for path in _mine(sorted(expected)):
        want = expected[path][1]
        if want is None or path not in found:
            continue
        got = file_checksum(root / path)
        if got != want:
            raise DamagedCheckpointError(
                f"step {step}: {path} fails its checksum (crc32 {got:08x}, manifest "
                f"{want:08x})")


def _reason(error: BaseException) -> str:
    """One line saying why a checkpoint did not restore: the innermost cause (TensorStore's
    status, e.g. ``OUT_OF_RANGE``, sits below orbax's wrappers)."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.restore` returns."""

    step: int  # optimizer steps taken
    data_position: int  # index of the next batch
    state: Any  # same structure as the template
    data_state: dict | None = None  # the stream pipeline's position (gift_jax.data.stream)


def _flat_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # unique (index first) and readable (the path after it); orbax keys are plain names
    names = [f"{i:05d}_" + jax.tree_util.keystr(p, simple=True, separator=".")
             for i, (p, _) in enumerate(leaves)]
    names = ["_".join(n.replace("/", ".").split()) for n in names]
    return names, [x for _, x in leaves], treedef


def _path_of(name: str) -> str:
    """A flat state name without its index prefix."""
    return name.split("_", 1)[1]


def _is_residual(name: str) -> bool:
    """Whether a flat state name is an error-feedback buffer (``AllReduceState.residuals``)."""
    return ".residuals." in name


def _is_shard_residual(name: str) -> bool:
    """Whether a flat state name is a shard owner's error-feedback buffer (packed rows of a
    bucket plan, which depends on the mesh shape)."""
    return ".residuals.1." in name


def _signature(x: Any) -> list:
    return [list(x.shape), str(x.dtype)]


class Checkpointer:
    """Saves and restores a training state under ``<workdir>/checkpoints``.

    Every process must call :meth:`save` and :meth:`restore` (orbax coordinates them); all
    see the same directory.
    """

    def __init__(self, workdir: str, config: ml_collections.ConfigDict, *, keep: int = 3,
                 mesh_shape: dict[str, int] | None = None, checksums: bool = True):
        """Args:
          workdir: the run's folder, local or an object-store URL; checkpoints go to
            ``<workdir>/checkpoints`` (created).
          config: the run's config, stored with every checkpoint and compared on restore.
          keep: how many of the newest checkpoints are kept (orbax's ``max_to_keep``).
          mesh_shape: ``{mesh axis: size}`` of the run's mesh, stored with every checkpoint (a
            restore onto another shape restarts the mesh-dependent error-feedback buffers
            from zero); ``None``: not recorded, and a restore assumes the same mesh.
          checksums: write each step's manifest with CRC-32s (:func:`write_manifest`);
            ``False`` writes the former listing of sizes only (the cost measurement's
            baseline, :func:`checksum_cost`). Restores check whatever a step holds.
        """
        self.directory = str(epath.Path(local_or_url(workdir)) / "checkpoints")
        self.config = config
        self.checksums = checksums
        self.mesh_shape = None if mesh_shape is None else {k: int(v) for k, v in
                                                           mesh_shape.items()}
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The most recent checkpointed step, or ``None``."""
        return self.manager.latest_step()

    def _set_aside(self, step: int, error: BaseException, then: str) -> None:
        """Moves the damaged checkpoint of ``step`` to ``<step>.damaged`` (process 0; every
        process waits) with a one-line warning naming the cause and what happens ``then``."""
        source = epath.Path(self.directory) / str(step)
        target = source.with_name(f"{step}.damaged")
        k = 1
        while target.exists():
            k += 1
            target = source.with_name(f"{step}.damaged{k}")
        if jax.process_count() > 1:  # every process has named the target before it exists
            multihost_utils.sync_global_devices(f"gift_jax name aside checkpoint {step}")
        if jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"gift_jax set aside checkpoint {step}")
        self.manager.reload()
        log.warning("checkpoint of step %d is damaged (%s): moved aside to %s; %s", step,
                    _reason(error), target, then)

    def _newest_intact(self, attempt):
        """``attempt(step)`` on the checkpoints from the newest down, moving aside every one
        it fails on; the first result, with its step.

        Raises:
          FileNotFoundError: no checkpoint at all.
          NoIntactCheckpointError: none that ``attempt`` succeeds on.
          CheckpointMismatchError: raised by ``attempt`` (not damage: passed on).
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        for i, step in enumerate(steps):
            error = None
            try:
                result = attempt(step)
            except CheckpointMismatchError:
                raise
            except Exception as e:  # noqa: BLE001 -- any failure to read is damage
                error = e
            if _everywhere(error is None):
                return step, result
            then = (f"trying step {steps[i + 1]}" if i + 1 < len(steps)
                    else "no older checkpoint")
            self._set_aside(step, error or RuntimeError("failed on another process"), then)
        raise NoIntactCheckpointError(
            f"no checkpoint in {self.directory} restores: steps {steps} were damaged and are "
            "moved aside (*.damaged); start a new run, or restore one of them by hand")

    def save(self, step: int, state: Any, *, data_position: int, skipped: int = 0,
             force: bool = True, data_state: dict | None = None) -> None:
        """Writes ``state`` at ``step`` (blocking until it is on disk), with the data
        pipeline's position (``data_position``, and ``data_state`` where it has one).

        A step that is already checkpointed is left as it is. Then the step's manifest
        (:data:`FILE_LISTING`: sizes and checksums, :func:`write_manifest`) is written; a step
        whose manifest never got written (a crash, or ``SIGKILL``, right after orbax's commit)
        is damaged on restore.

        Args:
          step: optimizer steps taken (the checkpoint's step).
          state: the pytree to save (the trainer's ``{"params": ..., "opt_state": ...}``),
            stored flat as ``path → array``; zero-size leaves are recorded in the metadata only.
          data_position: index of the next batch of the data pipeline.
          skipped: steps skipped so far (non-finite updates), kept in the metadata.
          force: passed to orbax's ``CheckpointManager.save`` (save regardless of its
            save-interval policy).
          data_state: the stream pipeline's position (:mod:`gift_jax.data.stream`), or ``None``
            (the grid pipeline: ``data_position`` alone).
        """
        if step in self.manager.all_steps():
            return
        names, leaves, _ = _flat_paths(state)
        meta = {"step": int(step), "data_position": int(data_position),
                "skipped": int(skipped), "config": to_json(self.config), "paths": names,
                "shapes": [_signature(x) for x in leaves], "mesh": self.mesh_shape,
                "data_state": data_state}
        if self.checksums:  # a step of this format without its manifest is damaged
            meta["manifest"] = MANIFEST_VERSION
        # orbax refuses zero-size arrays (placeholders in optax states): they come back from
        # the template, their shape and dtype are checked through the metadata
        arrays = {n: x for n, x in zip(names, leaves, strict=True) if x.size}
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(arrays),
                                    meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        self.manager.wait_until_finished()
        if jax.process_count() > 1:  # every process's files are written
            multihost_utils.sync_global_devices(f"gift_jax checkpoint {step} written")
        root = epath.Path(self.directory) / str(step)
        if self.checksums:
            write_manifest(root)
        elif jax.process_index() == 0:
            (root / FILE_LISTING).write_text(json.dumps(_file_sizes(root), sort_keys=True))

    def _require_files(self, step: int) -> None:
        """The step's manifest holds (:func:`verify_manifest`: every file at its size and
        checksum); without a manifest, the step must predate it (its metadata has no
        ``manifest`` entry) and hold the files without which orbax cannot read it (metadata,
        the OCDBT manifests). Checked before orbax runs, whose failure on a missing or
        truncated file leaves pages of asynchronous tracebacks on the terminal.

        Raises:
          FileNotFoundError: naming the first missing or truncated file.
          DamagedCheckpointError: a checksum differs (naming the file), the manifest is
            damaged, or a step written with a manifest has none.
        """
        root = epath.Path(self.directory) / str(step)
        if (root / FILE_LISTING).exists():
            verify_manifest(root)
            return
        try:
            written_with = json.loads((root / "meta" / "metadata").read_text()).get("manifest")
        except (OSError, ValueError, AttributeError):
            written_with = None  # unreadable: the checks below (or orbax) say why
        if written_with is not None:
            raise DamagedCheckpointError(
                f"step {step}: {FILE_LISTING} is missing (the save did not finish)")
        state = root / "state"
        required = [root / "meta" / "metadata", state / "_METADATA"]
        if state.exists() and any(state.glob("ocdbt.process_*")):
            required += [state / "manifest.ocdbt"] + [
                p / "manifest.ocdbt" for p in state.glob("ocdbt.process_*")]
        for path in required:
            if not path.exists():
                raise FileNotFoundError(f"{path.relative_to(root)} is missing")

    def _read_meta(self, step: int) -> dict[str, Any]:
        self._require_files(step)
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
        missing = [k for k in ("step", "data_position", "config", "paths", "shapes")
                   if k not in meta]
        if missing:
            raise DamagedCheckpointError(
                f"checkpoint {self.directory} (step {step}): its metadata has no {missing} "
                "(damaged, or not written by gift_jax's Checkpointer)")
        return meta

    def check_config(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of ``step`` (default: the newest whose metadata reads; damaged ones
        are moved aside), after checking its config.

        Args:
          step: the checkpoint's step, or ``None`` for the newest whose metadata reads.

        Returns:
          The checkpoint's metadata: ``step``, ``data_position``, ``config`` (the
          :func:`~gift_jax.training.config.to_json` text), ``paths`` and ``shapes`` (always
          there), and ``skipped``, ``mesh`` and ``data_state`` (written by :meth:`save`).

        Raises:
          FileNotFoundError: no checkpoint (with ``step``: a missing or truncated file of it).
          DamagedCheckpointError: with ``step``: its metadata lacks a required entry.
          NoIntactCheckpointError: no checkpoint whose metadata reads.
          CheckpointMismatchError: written with a different config.
        """
        if step is None:
            step, meta = self._newest_intact(self._read_meta)
        else:
            meta = self._read_meta(step)
        diffs = config_differences(meta["config"], self.config)
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} (step {step}) was written with a different "
                f"config: {'; '.join(diffs)}. Resume with the original config or use a new "
                "workdir."
            )
        return meta

    def restore(self, template: Any, step: int | None = None) -> Restored:
        """Restores ``step`` into the structure and shardings of ``template``; by default the
        newest checkpoint that restores, moving aside (one warning each) the damaged ones.

        Args:
          template: a state of this run's structure whose arrays carry the target shardings
            (e.g. a freshly initialised ``{"params": ..., "opt_state": ...}``); its zero-size
            leaves, and the error-feedback buffers a mesh change drops, are kept as they are.
          step: the checkpoint's step, or ``None`` for the newest that restores.

        Returns:
          The :class:`Restored` step, data position, state (``template``'s structure) and
          stream-pipeline position (``None`` where the checkpoint has none).

        Raises:
          FileNotFoundError: no checkpoint (with ``step``: a missing or truncated file of it).
          DamagedCheckpointError: with ``step``: its metadata lacks a required entry.
          NoIntactCheckpointError: none restores.
          CheckpointMismatchError: written with a different config or state layout.
        """
        if step is not None:
            return self._restore(template, step)
        return self._newest_intact(lambda s: self._restore(template, s))[1]

    def _restore(self, template: Any, step: int) -> Restored:
        meta = self.check_config(step)
        names, leaves, treedef = _flat_paths(template)
        signatures = [_signature(x) for x in leaves]
        # the shard owners' error-feedback rows follow the mesh shape even where the shapes
        # agree; a checkpoint without the mesh predates sharding (a data-only mesh)
        moved = meta.get("mesh") != self.mesh_shape and self.mesh_shape is not None and (
            meta.get("mesh") is not None or any(v > 1 for k, v in self.mesh_shape.items()
                                                if k not in ("data", "intra")))
        if names == meta["paths"] and signatures == meta["shapes"] and not moved:
            sources = dict(zip(names, names, strict=True))  # the same layout
        else:
            sources = self._matching(step, meta, names, signatures, moved)
        abstract = {sources[n]: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for n, x in zip(names, leaves, strict=True) if x.size and n in sources}
        # arrays of another mesh shape that this layout does not take are left out
        stored = sum(1 for shape in meta["shapes"] if math.prod(shape[0]))
        args = ocp.args.PyTreeRestore(
            item=abstract, partial_restore=len(abstract) < stored,
            restore_args=jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding),
                                      abstract))
        restored = self.manager.restore(step, args=ocp.args.Composite(state=args))["state"]
        state = jax.tree_util.tree_unflatten(
            treedef, [restored[sources[n]] if x.size and n in sources else x
                      for n, x in zip(names, leaves, strict=True)])
        return Restored(int(meta["step"]), int(meta["data_position"]), state,
                        meta.get("data_state"))

    def _matching(self, step: int, meta: dict, names: list[str], signatures: list,
                  moved: bool) -> dict[str, str]:
        """``{template name: checkpoint name}`` when the layouts differ only where a mesh
        change allows: the per-device error-feedback buffers whose shapes and number follow
        the mesh (every shard owner's buffer when the mesh shape ``moved``; a replica's own
        buffer when the number of replicas changed) restart from zero, with a warning; every
        other array must be there, at its path or a former one (:data:`FORMER_PATHS`), with
        the same shape and dtype (it is a global array, restored onto the template's
        shardings)."""
        stored = {_path_of(n): (n, sig) for n, sig in zip(meta["paths"], meta["shapes"],
                                                          strict=True)}
        sources, dropped = {}, 0
        for name, sig in zip(names, signatures, strict=True):
            old = stored.get(_path_of(name))
            formers = (former(_path_of(name)) for former in FORMER_PATHS)
            old = old or next((stored[f] for f in formers if f in stored), None)
            if old is not None and old[1] == sig and not (moved and _is_shard_residual(name)):
                sources[name] = old[0]
            elif _is_residual(name):
                dropped += 1
            else:
                now = f"{_path_of(name)} {sig} (now)"
                was = f"{old[1]} (checkpoint)" if old else "absent from the checkpoint"
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory} (step {step}) holds a different state "
                    f"layout ({now}: {was}); refusing a partial load")
        leftover = {_path_of(n) for n in meta["paths"]} - {_path_of(n) for n in sources.values()}
        if any(not _is_residual(p) for p in leftover):
            extra = sorted(p for p in leftover if not _is_residual(p))[:3]
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} (step {step}) holds arrays this run does not "
                f"({', '.join(extra)}, ...); refusing a partial load")
        if dropped or leftover:
            log.warning("checkpoint of step %d was written on another mesh shape: its "
                        "error-feedback buffers (per device) restart from zero", step)
        return sources

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def checksum_cost(directory: str, num_params: int = 10**9, *, leaves: int = 8,
                  repeats: int = 2) -> dict[str, float]:
    """What the checksums cost: a float32 state of ``num_params`` values (``leaves`` arrays)
    saved and restored by :class:`Checkpointer` with and without them, interleaved, the best
    of ``repeats`` each. Without them is the former format (orbax, then a listing of sizes);
    with them, the manifest's CRC-32s are computed after the save and verified before the
    restore. Files are read back from the page cache where the host has the memory (as right
    after a save).

    Args:
      directory: a scratch folder (local or object store); each checkpoint is deleted after
        it is measured.
      num_params: float32 values in the state (1e9: 4 GB).
      leaves: arrays the values are split into.
      repeats: rounds of (without, with); the minimum of each is reported.

    Returns:
      ``{"params", "bytes", "save_s", "save_checksums_s", "restore_s",
      "restore_checksums_s", "write_checksums_s", "verify_s", "checksum_GB_per_s"}``:
      seconds of the saves and restores without and with checksums, the checksums' own
      share of each (``write_checksums_s``: :func:`write_manifest`; ``verify_s``:
      :func:`verify_manifest`), and the checksum rate.
    """
    import jax.numpy as jnp

    config = ml_collections.ConfigDict({"bench": {"num_params": int(num_params)}})
    per = num_params // leaves
    key = jax.random.key(0)
    state = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (per,), jnp.float32)
             for i in range(leaves)}
    jax.block_until_ready(state)
    nbytes = sum(int(x.nbytes) for x in state.values())
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, math.inf), seconds)

    for r in range(repeats):
        for checksums in (False, True):
            tag = "_checksums" if checksums else ""
            workdir = epath.Path(directory) / f"round{r}{tag}"
            ckpt = Checkpointer(str(workdir), config, keep=1, checksums=checksums)
            start = time.perf_counter()
            ckpt.save(1, state, data_position=0)
            keep(f"save{tag}_s", time.perf_counter() - start)
            root = epath.Path(ckpt.directory) / "1"
            if checksums:
                start = time.perf_counter()
                write_manifest(root)  # again, alone: the checksums' share of the save
                keep("write_checksums_s", time.perf_counter() - start)
                start = time.perf_counter()
                verify_manifest(root)
                keep("verify_s", time.perf_counter() - start)
            start = time.perf_counter()
            restored = ckpt.restore(state)
            jax.block_until_ready(restored.state)
            keep(f"restore{tag}_s", time.perf_counter() - start)
            del restored
            ckpt.close()
            if workdir.exists():
                if str(workdir).startswith(("gs://", "s3://")):
                    workdir.rmtree()
                else:
                    shutil.rmtree(workdir)
    best["checksum_GB_per_s"] = nbytes / 1e9 / best["verify_s"]
    return {"params": int(per * leaves), "bytes": nbytes, **best}
