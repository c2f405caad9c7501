"""The data-parallel train step: ``jax.jit`` of a ``jax.shard_map`` with per-device gradients.

Inside ``shard_map`` (``check_vma=False``, so ``jax.grad`` of the replicated parameters is the
*local* gradient and no implicit fp32 all-reduce is inserted) each device

1. rebuilds the model from the replicated parameters (``nnx.merge``),
2. computes the gradient of its shard of the batch — a ``lax.scan`` over ``grad_accum_steps``
   microbatches when accumulating, so there is one reduction per optimizer step — and, in a
   GIFT refresh variant, the input statistics of the selected layers (with ``gift.two_sided``
   also the output-side ones, from the same backward pass),
3. runs the optimizer chain, whose first stage is the reduction (see :mod:`.optim`).

Parameters are replicated (``P()``), the batch is split over the data axes, and the optimizer
state is replicated except the per-device error-feedback buffers (``P(data)`` on their leading
axis, from :func:`gift_jax.partition_specs`).

Variants: GIFT factor and PLUMAGE projection refreshes are static choices; the host picks
``refresh=True/False`` per step (:meth:`TrainStep.refresh_due`) and each variant is compiled
once, ahead of time, with the same in/out shardings, so carried state moves between variants
without resharding or recompilation. Parameters and optimizer state are donated.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax
from gift_jax.models import Llama, LlamaConfig, next_token_loss
from gift_jax.training.mesh import data_axes
from gift_jax.training.method import Optimizer
from gift_jax.training.optim import SkipState

Params = Any
OptState = Any
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """A Flax NNX model's static graph (parameters are carried separately as a pure dict)."""

    graphdef: Any

    def merge(self, params: Params) -> nnx.Module:
        return nnx.merge(self.graphdef, params)


def _axis(mesh: Mesh) -> str | tuple[str, ...]:
    axes = data_axes(mesh)
    return axes[0] if len(axes) == 1 else axes


def model_def_of(model_config: LlamaConfig) -> ModelDef:
    """The static graph of the Llama (built abstractly, no arrays allocated)."""
    abstract = nnx.eval_shape(lambda: Llama(model_config, rngs=nnx.Rngs(0)))
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("the model has non-parameter state; the trainer only carries params")
    return ModelDef(graphdef)


@functools.lru_cache(maxsize=8)
def params_init_fn(model_config: LlamaConfig, seed: int, mesh: Mesh) -> Callable[[], Params]:
    """Jitted ``() → params`` (a pure dict), initialised on device and replicated over
    ``mesh``: the same values on every process, a function of ``seed`` only."""

    def build():
        model = Llama(model_config, rngs=nnx.Rngs(seed))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    return jax.jit(build, out_shardings=NamedSharding(mesh, P()))


def state_specs(opt_state: OptState, mesh: Mesh) -> Any:
    """``PartitionSpec`` tree of an optimizer state: per-device buffers over the data axes."""
    return gift_jax.partition_specs(opt_state, _axis(mesh))


def opt_init_fn(optimizer: Optimizer, abstract_params: Params, mesh: Mesh) -> Callable:
    """Jitted ``params → opt_state``: ``tx.init`` inside ``shard_map``, so per-device buffers
    (error feedback) are created per device and sharded over the data axes (as
    :func:`gift_jax.init_on_mesh`)."""
    probe = jax.eval_shape(jax.shard_map(optimizer.tx.init, mesh=mesh, in_specs=P(),
                                         out_specs=P(), check_vma=False), abstract_params)
    specs = state_specs(probe, mesh)
    return jax.jit(jax.shard_map(optimizer.tx.init, mesh=mesh, in_specs=P(), out_specs=specs,
                                 check_vma=False))


def _local_loss_and_grads(model_def: ModelDef, tokens: jax.Array, params: Params,
                          accum_steps: int, capture_layers: tuple[str, ...],
                          two_sided: bool = False):
    """(mean loss, mean gradient, mean input statistics) of this device's tokens; with
    ``two_sided`` the statistics are ``(A, B)``, B the per-token output-side second moment
    (:func:`gift_jax.whitening.capture.kfac_value_and_grad`)."""

    def one(p, toks):
        if capture_layers and two_sided:
            from gift_jax.whitening.capture import kfac_value_and_grad

            fn = kfac_value_and_grad(next_token_loss, capture_layers)
            (loss, stats), g = fn(model_def.merge(p), toks)
            return loss, nnx.to_pure_dict(g), stats
        if capture_layers:
            from gift_jax.whitening.capture import with_input_stats

            fn = with_input_stats(next_token_loss, capture_layers)
            (loss, stats), g = jax.value_and_grad(
                lambda q: fn(model_def.merge(q), toks), has_aux=True)(p)
            return loss, g, stats
        loss, g = jax.value_and_grad(lambda q: next_token_loss(model_def.merge(q), toks))(p)
        return loss, g, {}

    if accum_steps == 1:
        return one(params, tokens)
    micro = tokens.reshape(accum_steps, tokens.shape[0] // accum_steps, tokens.shape[1])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(one, params, micro[0]))

    def body(acc, toks):
        return jax.tree.map(jnp.add, acc, one(params, toks)), None

    total, _ = jax.lax.scan(body, zeros, micro)
    return jax.tree.map(lambda x: x / accum_steps, total)


def train_step_fn(model_def: ModelDef, optimizer: Optimizer, mesh: Mesh, opt_specs: Any, *,
                  accum_steps: int = 1, refresh: bool = False) -> Callable:
    """``(params, opt_state, batch) → (params, opt_state, metrics)``, not yet jitted.

    ``batch`` is int32 ``[global_batch, seq + 1]`` split over the data axes. ``metrics``:
    ``loss`` (mean over the global batch), ``grad_norm`` (of the reduced gradient; NaN on a
    skipped step), ``skipped`` (this step), ``skipped_total``.
    """
    axes = data_axes(mesh)
    plan = optimizer.plan
    # refresh variants capture the statistics of the layers a GIFT stage whitens (method gift,
    # or plumage with plumage.gift); the plan says which (none for every other variant)
    capture = plan.capture_layers(refresh)

    def body(params, opt_state, tokens):
        loss, grads, stats = _local_loss_and_grads(model_def, tokens, params, accum_steps,
                                                   capture, plan.gift_two_sided)
        kwargs = plan.update_kwargs(refresh, stats)
        updates, opt_state = optimizer.tx.update(grads, opt_state, params, **kwargs)
        params = optax.apply_updates(params, updates)
        assert isinstance(opt_state, SkipState)
        norm = plan.grad_norm(opt_state.inner, refresh)
        metrics = {
            "loss": jax.lax.pmean(loss, axes),
            "grad_norm": jnp.where(opt_state.last_skipped, jnp.nan, norm),
            "skipped": opt_state.last_skipped.astype(jnp.int32),
            "skipped_total": opt_state.skipped,
        }
        return params, opt_state, metrics

    batch_spec = P(axes)
    return jax.shard_map(body, mesh=mesh, in_specs=(P(), opt_specs, batch_spec),
                         out_specs=(P(), opt_specs, P()), check_vma=False)


def eval_step_fn(model_def: ModelDef, mesh: Mesh) -> Callable:
    """Jitted ``(params, batch) → mean loss`` over the global batch."""
    axes = data_axes(mesh)

    def body(params, tokens):
        return jax.lax.pmean(next_token_loss(model_def.merge(params), tokens), axes)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(),
                                 check_vma=False))


def fidelity_available() -> bool:
    """Whether :mod:`gift_jax.whitening.fidelity` (round-trip metrics) is installed."""
    return importlib.util.find_spec("gift_jax.whitening.fidelity") is not None


def fidelity_fn(model_def: ModelDef, optimizer: Optimizer, mesh: Mesh, opt_specs: Any,
                accum_steps: int) -> Callable:
    """Jitted ``(params, opt_state, batch) → {metric: value}``: one-step round trip of this
    run's reduction against the fp32 mean, on the first microbatch's per-device gradients.

    The reduction is the run's communication stage with its current state (GIFT factors) but
    zeroed error-feedback buffers; for PLUMAGE, its all-reduce stage on the full gradient.
    Metrics are :func:`gift_jax.whitening.fidelity.fidelity_report`'s aggregate (plus the
    whitened error of GIFT's selected layers).
    """
    from gift_jax.whitening.fidelity import fidelity_report

    axes = data_axes(mesh)
    axis = axes[0] if len(axes) == 1 else axes

    def body(params, opt_state, tokens):
        micro = tokens[: tokens.shape[0] // accum_steps]
        grads = jax.grad(lambda q: next_token_loss(model_def.merge(q), micro))(params)
        ref = jax.tree.map(lambda g: jax.lax.pmean(g.astype(jnp.float32), axis), grads)
        approx, factors = optimizer.plan.roundtrip(optimizer.stage, grads, opt_state.inner)
        report = fidelity_report(approx, ref, factors, muon=None)["aggregate"]
        return {k: v.astype(jnp.float32) for k, v in report.items()}

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), opt_specs, P(axes)),
                                 out_specs=P(), check_vma=False))


class TrainStep:
    """The compiled train step variants of one run.

    Call ``step(params, opt_state, batch, refresh)``; each variant is compiled ahead of time on
    first use (with ``compiler_options``, e.g. ``{"xla_backend_optimization_level": 0}`` for
    fast compiles of small test models). :meth:`place` puts carried values on the variants'
    shardings (call it once on fresh or restored state), :meth:`wire_report` reads a
    variant's collectives from its HLO.
    """

    def __init__(self, model_def: ModelDef, optimizer: Optimizer, mesh: Mesh, params: Params,
                 opt_state: OptState, *, global_batch: int, seq_len: int, accum_steps: int = 1,
                 compiler_options: dict[str, Any] | None = None):
        self.model_def, self.optimizer, self.mesh = model_def, optimizer, mesh
        self.accum_steps = accum_steps
        self.compiler_options = dict(compiler_options or {})
        self.opt_specs = state_specs(opt_state, mesh)
        named = lambda spec: NamedSharding(mesh, spec)
        is_spec = lambda x: isinstance(x, P)
        self.param_shardings = jax.tree.map(lambda _: named(P()), params)
        self.opt_shardings = jax.tree.map(named, self.opt_specs, is_leaf=is_spec)
        self.batch_sharding = named(P(data_axes(mesh)))
        abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        self._abstract = (
            jax.tree.map(abstract, params, self.param_shardings),
            jax.tree.map(abstract, opt_state, self.opt_shardings),
            jax.ShapeDtypeStruct((global_batch, seq_len + 1), jnp.int32,
                                 sharding=self.batch_sharding),
        )
        self._compiled: dict[bool, jax.stages.Compiled] = {}
        self._wire: dict[bool, gift_jax.WireReport] = {}
        self.compile_count = 0

    def place(self, params: Params, opt_state: OptState) -> tuple[Params, OptState]:
        """``params`` and ``opt_state`` on exactly the shardings the compiled variants use."""
        return (jax.device_put(params, self.param_shardings),
                jax.device_put(opt_state, self.opt_shardings))

    def compiled(self, refresh: bool) -> jax.stages.Compiled:
        """The compiled variant (compiling it on first use)."""
        refresh = bool(refresh) and True in self.variants()
        if refresh not in self._compiled:
            fn = train_step_fn(self.model_def, self.optimizer, self.mesh, self.opt_specs,
                               accum_steps=self.accum_steps, refresh=refresh)
            scalar = NamedSharding(self.mesh, P())
            jitted = jax.jit(
                fn,
                in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding),
                out_shardings=(self.param_shardings, self.opt_shardings, scalar),
                donate_argnums=(0, 1),
            )
            self._compiled[refresh] = jitted.lower(*self._abstract).compile(
                self.compiler_options or None)
            self.compile_count += 1
        return self._compiled[refresh]

    def refresh_due(self, step: int, opt_state: OptState) -> bool:
        """Whether ``step`` (0-based) runs the refresh variant (the plan's rule)."""
        return self.optimizer.plan.refresh_due(step, opt_state)

    def __call__(self, params: Params, opt_state: OptState, batch: jax.Array,
                 refresh: bool = False) -> tuple[Params, OptState, Metrics]:
        return self.compiled(refresh)(params, opt_state, batch)

    def wire_report(self, refresh: bool = False) -> gift_jax.WireReport:
        """Collectives of a variant and their bytes per device (from the compiled HLO)."""
        refresh = bool(refresh) and True in self.variants()
        if refresh not in self._wire:
            self._wire[refresh] = gift_jax.parse_hlo(self.compiled(refresh).as_text(),
                                                     self.mesh.size)
        return self._wire[refresh]

    def variants(self) -> tuple[bool, ...]:
        """The variants this run uses: ``(False,)`` or ``(False, True)``."""
        return self.optimizer.plan.variants()
