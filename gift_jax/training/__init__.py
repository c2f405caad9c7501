"""The training system: mesh, shard_map train step, optimizer chain, checkpoints, loop.

* :func:`train` — run (or resume) a whole training run from a config; :class:`Trainer` —
  the same run as an object (setup, ``run(steps)``, ``finish()``) that experiments drive.
* :class:`TrainStep`, :func:`train_step_fn` — the compiled data-parallel step and its variants;
  :func:`program_for` — everything a config compiles (cached per process).
* :class:`Recipe` — the front door: ``Recipe.from_config(config, num_devices)`` checks a
  config and turns it into typed parts (model spec, all-reduce options, optimizer, GIFT and
  PLUMAGE options, and the :class:`CommPlan` of ``comm.codec`` + ``comm.method`` that owns
  every method-dependent choice); nothing below it reads the config.
* :func:`build_optimizer` — the optax chain of a recipe (communication stage first).
* :class:`Checkpointer` — orbax checkpoints of the whole training state.
* :func:`make_mesh`, :func:`initialize_distributed` — devices and processes.
* :func:`complete_config`, :func:`validate_config`, :func:`apply_overrides` — configs.
"""

from gift_jax.training.checkpoint import Checkpointer, CheckpointMismatchError
from gift_jax.training.config import (
    CODECS,
    METHODS,
    OPTIMIZERS,
    TRAINER_DEFAULTS,
    ConfigError,
    apply_overrides,
    complete_config,
    validate_config,
)
from gift_jax.training.loop import (
    Preempted,
    Trainer,
    TrainingStalledError,
    TrainResult,
    data_batches,
    train,
)
from gift_jax.training.mesh import data_axes, initialize_distributed, make_mesh
from gift_jax.training.method import CommPlan, Optimizer, build_optimizer
from gift_jax.training.optim import learning_rate_schedule, skip_nonfinite
from gift_jax.training.program import Program, program_for
from gift_jax.training.recipe import Recipe
from gift_jax.training.step import TrainStep, eval_step_fn, train_step_fn

__all__ = [
    "CODECS",
    "METHODS",
    "OPTIMIZERS",
    "TRAINER_DEFAULTS",
    "CheckpointMismatchError",
    "Checkpointer",
    "CommPlan",
    "ConfigError",
    "Optimizer",
    "Preempted",
    "Program",
    "Recipe",
    "TrainResult",
    "TrainStep",
    "Trainer",
    "TrainingStalledError",
    "apply_overrides",
    "build_optimizer",
    "complete_config",
    "data_axes",
    "data_batches",
    "eval_step_fn",
    "initialize_distributed",
    "learning_rate_schedule",
    "make_mesh",
    "program_for",
    "skip_nonfinite",
    "train",
    "train_step_fn",
    "validate_config",
]
