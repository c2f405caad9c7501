"""Everything a run compiles, built once per (config, mesh) and cached in the process.

A :class:`Program` holds the run's typed :class:`~gift_jax.training.recipe.Recipe`, the
model graph, the optimizer chain, the jitted initialisers, the
train step variants, the eval step and the fidelity diagnostic. All of it is a function of
the config (minus logging/checkpoint cadence) and the mesh, so repeated :func:`train` calls in
one process — resuming, sweeps in a notebook, tests — reuse the compiled executables.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from gift_jax.comm.fsdp import fsdp_block_runner
from gift_jax.training.config import RUN_CONTROL_FIELDS, to_json
from gift_jax.training.mesh import FSDP_AXIS, data_axes, model_axes
from gift_jax.training.method import Optimizer, build_optimizer
from gift_jax.training.recipe import Recipe
from gift_jax.training.sharding import ParamLayout, activation_axes
from gift_jax.training.step import (
    TrainStep,
    eval_step_fn,
    fidelity_fn,
    model_def_of,
    opt_init_fn,
    params_init_fn,
)
from gift_jax.utils.block_hook import BlockRunner

_CACHE_SIZE = 16
_CACHE: collections.OrderedDict[tuple, Program] = collections.OrderedDict()


class Program:
    """The compiled pieces of one run configuration on one mesh."""

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh,
                 compiler_options: dict[str, Any] | None = None,
                 update_rule: Callable | None = None):
        """Args:
          config: a completed config (checked by :meth:`Recipe.from_config`).
          mesh: the run's mesh.
          compiler_options: XLA options of every compiled program, or ``None``.
          update_rule: ``schedule → transformation`` replacing the config's optimizer (see
            :func:`~gift_jax.training.method.build_optimizer`), or ``None``.

        Raises:
          ConfigError: a bad setting, or parameters the mesh cannot split.
        """
        self.mesh = mesh
        self.recipe = recipe = Recipe.from_config(config, mesh.devices.size)
        self.model_config = recipe.model_config
        self.layout = ParamLayout.of(self.model_config, dict(mesh.shape), recipe.mesh_rules)
        if model_axes(mesh):  # see LlamaConfig (every family): embed_lookup, activation_axes
            self.model_config = dataclasses.replace(
                self.model_config, embed_lookup="one_hot",
                activation_axes=activation_axes(mesh, recipe.mesh_rules))
        self.model_def = model_def_of(self.model_config)
        self.update_rule = update_rule  # kept alive: its id is part of the cache key
        self.optimizer: Optimizer = build_optimizer(recipe, data_axes(mesh), update_rule,
                                                    shards=self.layout.local_shards(mesh))
        self.init_params = params_init_fn(self.model_config, recipe.seed, mesh, self.layout,
                                          compiler_options=compiler_options)
        abstract_params = jax.eval_shape(self.init_params)
        self.init_opt_state = opt_init_fn(self.optimizer, abstract_params, mesh, self.layout,
                                          compiler_options=compiler_options)
        abstract_state = jax.eval_shape(self.init_opt_state, abstract_params)
        self.step = TrainStep(self.model_def, self.optimizer, mesh, abstract_params,
                              abstract_state, global_batch=recipe.global_batch_size,
                              seq_len=recipe.seq_len, accum_steps=recipe.grad_accum_steps,
                              compiler_options=compiler_options, layout=self.layout,
                              runner=self._block_runner(mesh))
        self._accum = recipe.grad_accum_steps

    def _block_runner(self, mesh: Mesh) -> BlockRunner | None:
        """The blocks' quantized ``fsdp`` collectives (``comm.fsdp_codec``), or ``None``."""
        codecs = self.recipe.comm.fsdp
        if codecs is None or FSDP_AXIS not in model_axes(mesh):
            return None
        return fsdp_block_runner(codecs, self.layout.block_specs(
            bool(self.model_config.scan_layers)))

    def init(self) -> tuple[Any, Any]:
        """Fresh ``(params, opt_state)`` on the step's shardings."""
        params = self.init_params()
        return self.step.place(params, self.init_opt_state(params))

    @functools.cached_property
    def evaluate(self) -> Callable:
        """Jitted ``(params, batch) → mean loss``."""
        return eval_step_fn(self.model_def, self.mesh, self.layout,
                            compiler_options=self.step.compiler_options)

    @functools.cached_property
    def diagnose(self) -> Callable:
        """Jitted fidelity diagnostic (:func:`~gift_jax.training.step.fidelity_fn`)."""
        return fidelity_fn(self.model_def, self.optimizer, self.mesh, self.step.opt_specs,
                           self._accum, self.layout,
                           compiler_options=self.step.compiler_options)


def _key(config: ml_collections.ConfigDict, mesh: Mesh, compiler_options,
         update_rule) -> tuple:
    # data.pipeline enters no compiled program; validation resolves its "auto" in place
    fields = {k: v for k, v in json.loads(to_json(config)).items()
              if k not in RUN_CONTROL_FIELDS and k != "data.pipeline"}
    devices = tuple(int(d.id) for d in mesh.devices.flat)
    options = json.dumps(compiler_options or {}, sort_keys=True, default=str)
    rule = None if update_rule is None else id(update_rule)
    return (json.dumps(fields, sort_keys=True), mesh.axis_names, mesh.devices.shape, devices,
            options, rule)


def program_for(config: ml_collections.ConfigDict, mesh: Mesh,
                compiler_options: dict[str, Any] | None = None,
                update_rule: Callable | None = None) -> Program:
    """The cached :class:`Program` of ``config`` on ``mesh`` (built on first use); with an
    ``update_rule`` (see :func:`~gift_jax.training.method.build_optimizer`) the cache is keyed
    by that object's identity (the cached program holds it).

    Args:
      config: a completed, valid config.
      mesh: the run's mesh.
      compiler_options: XLA options of every compiled program (init, steps, eval,
        diagnostics), or ``None``.
      update_rule: ``schedule → transformation`` replacing the config's optimizer, or ``None``.

    Returns:
      The :class:`Program`.
    """
    key = _key(config, mesh, compiler_options, update_rule)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    program = Program(config, mesh, compiler_options, update_rule)
    _CACHE[key] = program
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return program
