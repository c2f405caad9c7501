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
A checkpoint written with a different config is refused with the list of differing fields.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from gift_jax.training.config import config_differences, to_json


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not belong to this run's config or state layout."""


@dataclasses.dataclass
class Restored:
    """What :meth:`Checkpointer.restore` returns."""

    step: int  # optimizer steps taken
    data_position: int  # index of the next batch
    state: Any  # same structure as the template


def _flat_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    # unique (index first) and readable (the path after it); orbax keys are plain names
    names = [f"{i:05d}_" + jax.tree_util.keystr(p, simple=True, separator=".")
             for i, (p, _) in enumerate(leaves)]
    names = ["_".join(n.replace("/", ".").split()) for n in names]
    return names, [x for _, x in leaves], treedef


def _signature(x: Any) -> list:
    return [list(x.shape), str(x.dtype)]


class Checkpointer:
    """Saves and restores a training state under ``<workdir>/checkpoints``.

    Every process must call :meth:`save` and :meth:`restore` (orbax coordinates them); all
    see the same directory.
    """

    def __init__(self, workdir: str, config: ml_collections.ConfigDict, *, keep: int = 3):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        self.config = config
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The most recent checkpointed step, or ``None``."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, *, data_position: int, skipped: int = 0,
             force: bool = True) -> None:
        """Writes ``state`` at ``step`` (blocking until it is on disk)."""
        if step in self.manager.all_steps():
            return
        names, leaves, _ = _flat_paths(state)
        meta = {"step": int(step), "data_position": int(data_position),
                "skipped": int(skipped), "config": to_json(self.config), "paths": names,
                "shapes": [_signature(x) for x in leaves]}
        # orbax refuses zero-size arrays (placeholders in optax states): they come back from
        # the template, their shape and dtype are checked through the metadata
        arrays = {n: x for n, x in zip(names, leaves, strict=True) if x.size}
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                    meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        self.manager.wait_until_finished()

    def check_config(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of ``step`` (default: latest), after checking its config.

        Raises:
          FileNotFoundError: no checkpoint.
          CheckpointMismatchError: written with a different config.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = meta["meta"]
        diffs = config_differences(meta["config"], self.config)
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} (step {step}) was written with a different "
                f"config: {'; '.join(diffs)}. Resume with the original config or use a new "
                "workdir."
            )
        return meta

    def restore(self, template: Any, step: int | None = None) -> Restored:
        """Restores ``step`` (default: latest) into the structure and shardings of ``template``.

        Raises:
          FileNotFoundError: no checkpoint.
          CheckpointMismatchError: written with a different config or state layout.
        """
        meta = self.check_config(step)
        step = meta["step"]
        names, leaves, treedef = _flat_paths(template)
        signatures = [_signature(x) for x in leaves]
        if names != meta["paths"] or signatures != meta["shapes"]:
            diff = next((f"{a} {sa} (checkpoint) != {b} {sb} (now)" for a, sa, b, sb in zip(
                meta["paths"], meta["shapes"], names, signatures, strict=False)
                if (a, sa) != (b, sb)), f"{len(meta['paths'])} != {len(names)} arrays")
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} (step {step}) holds a different state layout "
                f"({diff}); refusing a partial load"
            )
        abstract = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    for n, x in zip(names, leaves, strict=True) if x.size}
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        state = jax.tree_util.tree_unflatten(
            treedef, [restored[n] if x.size else x for n, x in zip(names, leaves, strict=True)])
        return Restored(int(meta["step"]), int(meta["data_position"]), state)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
