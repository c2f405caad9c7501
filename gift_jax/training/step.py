"""The train step: ``jax.jit`` of a ``jax.shard_map`` with per-replica gradients.

Inside ``shard_map`` (``check_vma=False``, so ``jax.grad`` of the replicated parameters is the
*local* gradient and no implicit fp32 all-reduce is inserted) each replica

1. rebuilds the model from the parameters (``nnx.merge``),
2. computes the gradient of its shard of the batch — a ``lax.scan`` over ``grad_accum_steps``
   microbatches when accumulating, so there is one reduction per optimizer step — and, in a
   GIFT refresh variant, the input statistics of the selected layers (with ``gift.two_sided``
   also the output-side ones, from the same backward pass),
3. runs the optimizer chain, whose first stage is the reduction (see :mod:`.optim`).

On a data-parallel mesh the ``shard_map`` is manual over every axis: parameters are replicated
(``P()``), the batch is split over the data axes, the optimizer state is replicated except the
per-device error-feedback buffers. On a sharded mesh (``fsdp``/``tensor`` > 1, see
:mod:`.sharding`) it is manual over ``data`` only: inside a replica GSPMD partitions the model
over the model axes (parameters, gradients and optimizer state stay split as
:class:`~.sharding.ParamLayout` says; the replica's rows are split over ``fsdp``), and the
all-reduce stage reduces each device's local shard across ``data`` in a nested ``shard_map``
(:class:`gift_jax.LocalShards`). Either way the step is one ``jax.jit`` over the whole mesh.

Variants: GIFT factor and PLUMAGE projection refreshes are static choices; the host picks
``refresh=True/False`` per step (:meth:`TrainStep.refresh_due`) and each variant is compiled
once, ahead of time, with the same in/out shardings, so carried state moves between variants
without resharding or recompilation. GIFT's bias-corrected EMA adds a third,
:data:`~gift_jax.training.method.STATS` (capture the statistics and fold them, no
eigendecomposition), on the steps its plan says, compiled on the first of them. Parameters
and optimizer state are donated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gift_jax.comm.overlap import loss_and_reduced_grads
from gift_jax.comm.wire import WireReport, parse_hlo
from gift_jax.models import model_spec
from gift_jax.training.mesh import FSDP_AXIS, batch_axes, data_axes, model_axes
from gift_jax.training.method import STATS, Optimizer, captures
from gift_jax.training.optim import SkipState
from gift_jax.training.sharding import (
    ParamLayout,
    manual_specs,
    shardings,
    state_specs,
)
from gift_jax.utils.axes import axis_name_of
from gift_jax.utils.block_hook import BlockRunner, block_runner
from gift_jax.utils.tree_paths import join_path, leaf_path
from gift_jax.whitening.capture import kfac_value_and_grad, with_input_coverage, with_input_stats
from gift_jax.whitening.fidelity import fidelity_report

Params = Any
OptState = Any
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """A Flax NNX model's static graph (parameters are carried separately as a pure dict) and
    its family's training loss (:meth:`~gift_jax.models.ModelSpec.loss`)."""

    graphdef: Any
    loss: Callable
    compute_dtypes: tuple[tuple[str, str], ...] = ()

    def merge(self, params: Params) -> nnx.Module:
        """The model with ``params`` merged into its graph.

        Args:
          params: the parameters, a pure dict of the graph's ``nnx.Param`` state.

        Returns:
          The ``nnx.Module``.
        """
        return nnx.merge(self.graphdef, params)

    def for_compute(self, params: Params) -> Params:
        """``params`` with each linear layer's kernel and bias cast to the layer's compute
        dtype (``compute_dtypes``: ``(path, dtype name)``), the first thing the layer does
        with them, so the model computes the same values; the differentiated parameters stay
        in their storage dtype (the cast's transpose converts each cotangent back, as the
        layer's own cast does).

        Cast once, before the model runs, a scanned stack's weights enter the layer loop in
        the compute dtype: converted once per step instead of once per layer in the forward
        and again in the rematerialised forward, and an ``fsdp``-split weight is gathered
        in the compute dtype (``docs/api/pod.md``, the model-program changes). Embeddings
        stay as they are: a tied table's two uses would sum their cotangents in the compute
        dtype, and a lookup's scatter-add would accumulate in it.

        Args:
          params: the parameters, a pure dict of the graph's ``nnx.Param`` state.

        Returns:
          The same tree, the listed leaves cast.
        """
        if not self.compute_dtypes:
            return params
        dtypes = dict(self.compute_dtypes)

        def cast(path, x):
            dtype = dtypes.get(leaf_path(path))
            return x if dtype is None else x.astype(dtype)

        return jax.tree_util.tree_map_with_path(cast, params)

    def merge_for_compute(self, params: Params) -> nnx.Module:
        """:meth:`merge` of :meth:`for_compute`: the model the trainer's loss differentiates
        through (the gradient is with respect to ``params``, in their storage dtype).

        Args:
          params: the parameters, a pure dict of the graph's ``nnx.Param`` state.

        Returns:
          The ``nnx.Module``, its linear layers' weights in their compute dtype.
        """
        return self.merge(self.for_compute(params))


def replica_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map`` of ``fn`` that is manual over the data axes only (the model axes, if
    any, stay with GSPMD); specs name data axes only.

    Args:
      fn: the per-replica function.
      mesh: the run's mesh.
      in_specs, out_specs: ``shard_map``'s specs of ``fn``'s arguments and results.

    Returns:
      ``fn`` shard-mapped (``check_vma=False``; on a data-parallel mesh manual over every
      axis).
    """
    kwargs = {"axis_names": set(data_axes(mesh))} if model_axes(mesh) else {}
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False, **kwargs)


def loss_for(model_def: ModelDef, mesh: Mesh) -> Callable:
    """The loss of the step on ``mesh``: the model family's loss
    (:func:`~gift_jax.models.next_token_loss` for both families), with ``one_hot=True`` on a
    sharded mesh (a gather along a split vocabulary does not partition).

    Args:
      model_def: the model's static graph and loss.
      mesh: the run's mesh.

    Returns:
      ``(model, tokens) → loss``.
    """
    if model_axes(mesh):
        return functools.partial(model_def.loss, one_hot=True)
    return model_def.loss


def _constrain(tree: Any, specs: Any) -> Any:
    """``with_sharding_constraint`` on the model axes (inside :func:`replica_map`)."""
    if specs is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, specs)


def model_def_of(model_config: Any) -> ModelDef:
    """The static graph of the model of ``model_config``, any family (built abstractly, no
    arrays allocated), with the family's loss.

    Args:
      model_config: the model family's config dataclass.

    Returns:
      The :class:`ModelDef`.

    Raises:
      ValueError: the model has state other than ``nnx.Param`` (the trainer carries
        parameters only).
    """
    spec = model_spec(model_config)
    model = spec.abstract(model_config)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("the model has non-parameter state; the trainer only carries params")
    return ModelDef(graphdef, spec.loss, _linear_compute_dtypes(model))


def _linear_compute_dtypes(model: nnx.Module) -> tuple[tuple[str, str], ...]:
    """``(path, dtype name)`` of every ``nnx.Linear`` kernel and bias stored in another dtype
    than its layer computes in (:meth:`ModelDef.for_compute`)."""
    out = []
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, nnx.Linear) or module.dtype is None:
            continue
        for name in ("kernel", "bias"):
            var = getattr(module, name, None)
            if var is not None and var.get_value().dtype != jnp.dtype(module.dtype):
                out.append((join_path((*path, name)), jnp.dtype(module.dtype).name))
    return tuple(out)


def params_init_fn(model_config: Any, seed: int, mesh: Mesh, layout: ParamLayout, *,
                   compiler_options: dict[str, Any] | None = None) -> Callable[[], Params]:
    """Jitted ``() → params`` (a pure dict), initialised on device directly on the layout's
    shardings (a sharded model never materialises whole on one device or on the host): the
    same values on every process and every mesh, a function of ``seed`` only (compiled with
    ``compiler_options``, as every program of :class:`TrainStep`'s run).

    Args:
      model_config: the model family's config dataclass.
      seed: the initialisation seed (``train.seed``).
      mesh: the run's mesh.
      layout: the parameters' layout (its specs are the output shardings).
      compiler_options: XLA options, or ``None``.

    Returns:
      The jitted initialiser.
    """

    def build():
        model = model_spec(model_config).build(model_config, rngs=nnx.Rngs(seed))
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    abstract = jax.eval_shape(build)
    return jax.jit(build, out_shardings=shardings(layout.specs(abstract), mesh),
                   compiler_options=compiler_options or None)


def opt_init_fn(optimizer: Optimizer, abstract_params: Params, mesh: Mesh,
                layout: ParamLayout, *, compiler_options: dict[str, Any] | None = None
                ) -> Callable:
    """Jitted ``params → opt_state``: ``tx.init`` inside :func:`replica_map`, so per-device
    buffers (error feedback) are created per device and sharded over every axis (as
    :func:`gift_jax.init_on_mesh`), the rest as :func:`~.sharding.state_specs` says.

    Args:
      optimizer: the run's :class:`~gift_jax.training.method.Optimizer` (``tx`` is
        initialised).
      abstract_params: the parameters' shapes (``jax.eval_shape`` of the initialiser).
      mesh: the run's mesh.
      layout: the parameters' layout (the input shardings, and the state's split).
      compiler_options: XLA options, or ``None``.

    Returns:
      The jitted initialiser.
    """
    probe = jax.eval_shape(replica_map(optimizer.tx.init, mesh, P(), P()), abstract_params)
    specs = state_specs(probe, layout, mesh)
    return jax.jit(replica_map(optimizer.tx.init, mesh, P(), manual_specs(specs, mesh)),
                   in_shardings=(shardings(layout.specs(abstract_params), mesh),),
                   out_shardings=shardings(specs, mesh),
                   compiler_options=compiler_options or None)


def _local_loss_and_grads(model_def: ModelDef, tokens: jax.Array, params: Params,
                          accum_steps: int, capture_layers: tuple[str, ...],
                          two_sided: bool = False, strided: bool = False,
                          loss_fn: Callable | None = None,
                          coverage_bases: dict[str, Any] | None = None):
    """(mean loss, mean gradient, mean input statistics) of this replica's tokens; with
    ``two_sided`` the statistics are ``(A, B)``, B the per-token output-side second moment
    (:func:`gift_jax.whitening.capture.kfac_value_and_grad`); with ``coverage_bases`` (no
    ``capture_layers``) the input-coverage sums of GIFT's adaptive refresh
    (:func:`gift_jax.whitening.capture.with_input_coverage`). ``strided``: microbatch ``i``
    takes rows ``i, i + accum_steps, …`` (so each keeps the rows' split over ``fsdp``)
    instead of a contiguous block. ``loss_fn``: ``(model, tokens) → loss`` (default: the
    family's, ``model_def.loss``)."""
    loss_fn = model_def.loss if loss_fn is None else loss_fn

    def one(p, toks):
        if capture_layers and two_sided:  # differentiates the module: its stored weights
            fn = kfac_value_and_grad(loss_fn, capture_layers)
            (loss, stats), g = fn(model_def.merge(p), toks)
            return loss, nnx.to_pure_dict(g), stats
        if capture_layers or coverage_bases:
            fn = (with_input_stats(loss_fn, capture_layers) if capture_layers
                  else with_input_coverage(loss_fn, coverage_bases))
            (loss, stats), g = jax.value_and_grad(
                lambda q: fn(model_def.merge_for_compute(q), toks), has_aux=True)(p)
            return loss, g, stats
        loss, g = jax.value_and_grad(
            lambda q: loss_fn(model_def.merge_for_compute(q), toks))(p)
        return loss, g, {}

    if accum_steps == 1:
        return one(params, tokens)
    total = _summed(one, params, _microbatches(tokens, accum_steps, strided))
    return jax.tree.map(lambda x: x / accum_steps, total)


def _microbatches(tokens: jax.Array, accum_steps: int, strided: bool) -> jax.Array:
    """``tokens`` as ``[accum_steps, rows / accum_steps, seq + 1]`` (strided: microbatch ``i``
    takes rows ``i, i + accum_steps, …``)."""
    if strided:
        micro = tokens.reshape(tokens.shape[0] // accum_steps, accum_steps, tokens.shape[1])
        return micro.transpose(1, 0, 2)
    return tokens.reshape(accum_steps, tokens.shape[0] // accum_steps, tokens.shape[1])


def _summed(one: Callable, params: Params, micro: jax.Array) -> Any:
    """The sum over microbatches of ``one(params, microbatch)`` (a ``lax.scan`` from zeros)."""
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(one, params, micro[0]))

    def body(acc, toks):
        return jax.tree.map(jnp.add, acc, one(params, toks)), None

    return jax.lax.scan(body, zeros, micro)[0]


def _loss_and_reduced_grads(model_def: ModelDef, tokens: jax.Array, params: Params,
                            accum_steps: int, loss_fn: Callable, stage: Any, stage_state: Any,
                            strided: bool = False):
    """(mean loss, reduced mean gradient, the stage's new state): the gradient reduced inside
    the backward pass of the last microbatch (:func:`gift_jax.comm.overlap.
    loss_and_reduced_grads`), the earlier ones summed first as :func:`_local_loss_and_grads`
    sums them (``strided`` as there), so the values are those of its mean reduced by
    ``stage`` after the backward."""

    def reduced(toks, acc):
        return loss_and_reduced_grads(lambda q: loss_fn(model_def.merge(q), toks), params,
                                      stage, stage_state, acc=acc, accum_steps=accum_steps,
                                      for_compute=model_def.for_compute)

    if accum_steps == 1:
        return reduced(tokens, None)
    micro = _microbatches(tokens, accum_steps, strided)
    earlier_loss, earlier_grads = _summed(
        lambda p, toks: jax.value_and_grad(
            lambda q: loss_fn(model_def.merge_for_compute(q), toks))(p),
        params, micro[:-1])
    loss, grads, state = reduced(micro[-1], earlier_grads)
    return (earlier_loss + loss) / accum_steps, grads, state


def _model_specs(layout: ParamLayout | None, mesh: Mesh, tree: Any) -> Any:
    """The layout's specs of ``tree`` on a sharded mesh, else ``None`` (no constraint)."""
    return layout.specs(tree) if layout is not None and model_axes(mesh) else None


def train_step_fn(model_def: ModelDef, optimizer: Optimizer, mesh: Mesh, opt_specs: Any, *,
                  accum_steps: int = 1, refresh: bool = False,
                  layout: ParamLayout | None = None,
                  runner: BlockRunner | None = None) -> Callable:
    """``(params, opt_state, batch) → (params, opt_state, metrics)``, not yet jitted.

    ``batch`` is int32 ``[global_batch, seq + 1]`` split over the data axes (and ``fsdp``).
    ``opt_specs``: the state's ``shard_map`` specs (data axes only); ``layout``: the
    parameters' split over the model axes (a sharded mesh). ``metrics``: ``loss`` (mean over
    the global batch), ``grad_norm`` (of the reduced gradient; NaN on a skipped step),
    ``skipped`` (this step), ``skipped_total``.

    Args:
      model_def: the model's static graph.
      optimizer: the run's :class:`~gift_jax.training.method.Optimizer`.
      mesh: the run's mesh.
      opt_specs: the optimizer state's ``shard_map`` specs.
      accum_steps: microbatches per step.
      refresh: the variant: ``False`` (ordinary), ``True`` (refresh: statistics captured,
        extra update arguments) or :data:`~gift_jax.training.method.STATS` (statistics
        captured and folded, no refresh).
      layout: the parameters' split over the model axes, or ``None``.
      runner: runs each block of the model's stack in the variants that capture no
        statistics (:func:`gift_jax.comm.fsdp.fsdp_block_runner`: the blocks' ``fsdp``
        collectives quantized), or ``None``.

    Returns:
      The step function.
    """
    axes = data_axes(mesh)
    blocks = (contextlib.nullcontext() if runner is None or captures(refresh)
              else block_runner(runner))
    plan = optimizer.plan
    # refresh variants capture the statistics of the layers a GIFT stage whitens (method gift,
    # or plumage with plumage.gift); the plan says which (none for every other variant)
    capture = plan.capture_layers(refresh)
    sharded = bool(model_axes(mesh))
    rows = P(FSDP_AXIS) if FSDP_AXIS in model_axes(mesh) else P()

    def body(params, opt_state, tokens):
        specs = _model_specs(layout, mesh, params)
        params = _constrain(params, specs)
        if sharded:
            tokens = jax.lax.with_sharding_constraint(tokens, rows)
        if optimizer.in_backward and not captures(refresh):  # reduced inside the backward
            with blocks:
                loss, grads, reduced = _loss_and_reduced_grads(
                    model_def, tokens, params, accum_steps, loss_for(model_def, mesh),
                    optimizer.backward_stage, optax.tree.get(opt_state, plan.stage_state),
                    sharded)
            kwargs = {**plan.update_kwargs(refresh, {}), "reduced_in_backward": reduced}
        else:
            with blocks:
                loss, grads, stats = _local_loss_and_grads(
                    model_def, tokens, params, accum_steps, capture, plan.gift_two_sided,
                    sharded, loss_for(model_def, mesh), plan.coverage_bases(refresh, opt_state))
            grads = _constrain(grads, specs)
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
        return _constrain(params, specs), opt_state, metrics

    return replica_map(body, mesh, (P(), opt_specs, P(axes)), (P(), opt_specs, P()))


def eval_step_fn(model_def: ModelDef, mesh: Mesh, layout: ParamLayout | None = None, *,
                 compiler_options: dict[str, Any] | None = None) -> Callable:
    """Jitted ``(params, batch) → mean loss`` over the global batch.

    Args:
      model_def: the model's static graph.
      mesh: the run's mesh.
      layout: the parameters' split over the model axes, or ``None`` (pure data parallelism).
      compiler_options: XLA options of the compiled step, or ``None``.

    Returns:
      The jitted evaluation step.
    """
    axes = data_axes(mesh)

    def body(params, tokens):
        params = _constrain(params, _model_specs(layout, mesh, params))
        loss_fn = loss_for(model_def, mesh)
        return jax.lax.pmean(loss_fn(model_def.merge(params), tokens), axes)

    return jax.jit(replica_map(body, mesh, (P(), P(axes)), P()),
                   compiler_options=compiler_options or None)


def fidelity_fn(model_def: ModelDef, optimizer: Optimizer, mesh: Mesh, opt_specs: Any,
                accum_steps: int, layout: ParamLayout | None = None, *,
                compiler_options: dict[str, Any] | None = None) -> Callable:
    """Jitted ``(params, opt_state, batch) → {metric: value}``: one-step round trip of this
    run's reduction against the fp32 mean, on the first microbatch's per-device gradients.

    The reduction is the run's communication stage with its current state (GIFT factors) but
    zeroed error-feedback buffers; for PLUMAGE, its all-reduce stage on the full gradient.
    Metrics are :func:`gift_jax.whitening.fidelity.fidelity_report`'s aggregate (plus the
    whitened error of GIFT's selected layers).

    Args:
      model_def: the model's static graph and loss.
      optimizer: the run's :class:`~gift_jax.training.method.Optimizer` (its ``stage`` and
        its plan's :meth:`~gift_jax.training.method.CommPlan.roundtrip`).
      mesh: the run's mesh.
      opt_specs: the optimizer state's ``shard_map`` specs (data axes only).
      accum_steps: microbatches per step (the diagnostic takes the first).
      layout: the parameters' split over the model axes, or ``None``.
      compiler_options: XLA options, or ``None``.

    Returns:
      The jitted diagnostic.
    """
    axes = data_axes(mesh)
    axis = axis_name_of(axes)

    def body(params, opt_state, tokens):
        # the first microbatch (strided on a sharded mesh: rows stay split over fsdp)
        sharded = bool(model_axes(mesh))
        micro = tokens[::accum_steps] if sharded else tokens[: tokens.shape[0] // accum_steps]
        params = _constrain(params, _model_specs(layout, mesh, params))
        grads = jax.grad(lambda q: loss_for(model_def, mesh)(model_def.merge(q), micro))(params)
        grads = _constrain(grads, _model_specs(layout, mesh, params))
        ref = jax.tree.map(lambda g: jax.lax.pmean(g.astype(jnp.float32), axis), grads)
        approx, factors = optimizer.plan.roundtrip(optimizer.stage, grads, opt_state.inner)
        report = fidelity_report(approx, ref, factors, muon=None)["aggregate"]
        return {k: v.astype(jnp.float32) for k, v in report.items()}

    return jax.jit(replica_map(body, mesh, (P(), opt_specs, P(axes)), P()),
                   compiler_options=compiler_options or None)


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
                 compiler_options: dict[str, Any] | None = None,
                 layout: ParamLayout | None = None, runner: BlockRunner | None = None):
        """Args:
          model_def: the model's static graph and loss.
          optimizer: the run's :class:`~gift_jax.training.method.Optimizer`.
          mesh: the run's mesh.
          params, opt_state: the carried parameters and optimizer state (abstract arrays
            suffice: only shapes and dtypes are read).
          global_batch, seq_len: the batch is int32 ``[global_batch, seq_len + 1]``.
          accum_steps: microbatches per step.
          compiler_options: XLA options of every variant, or ``None``.
          layout: the parameters' split over the model axes, or ``None`` (replicated).
          runner: runs each block (:func:`train_step_fn`), or ``None``.
        """
        self.model_def, self.optimizer, self.mesh = model_def, optimizer, mesh
        self.runner = runner
        self.accum_steps = accum_steps
        self.compiler_options = dict(compiler_options or {})
        self.layout = layout if layout is not None else ParamLayout({}, {})
        full_specs = state_specs(opt_state, self.layout, mesh)
        self.opt_specs = manual_specs(full_specs, mesh)  # the shard_map specs
        self.param_shardings = shardings(self.layout.specs(params), mesh)
        self.opt_shardings = shardings(full_specs, mesh)
        self.batch_sharding = NamedSharding(mesh, P(batch_axes(mesh)))
        abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        self._abstract = (
            jax.tree.map(abstract, params, self.param_shardings),
            jax.tree.map(abstract, opt_state, self.opt_shardings),
            jax.ShapeDtypeStruct((global_batch, seq_len + 1), jnp.int32,
                                 sharding=self.batch_sharding),
        )
        self._compiled: dict[Any, jax.stages.Compiled] = {}
        self._wire: dict[Any, WireReport] = {}
        self.compile_count = 0

    def abstract_args(self) -> tuple[Any, Any, jax.ShapeDtypeStruct]:
        """The step's arguments ``(params, opt_state, batch)`` as abstract arrays carrying
        their shardings (what the variants are compiled for)."""
        return self._abstract

    def place(self, params: Params, opt_state: OptState) -> tuple[Params, OptState]:
        """``params`` and ``opt_state`` on exactly the shardings the compiled variants use.

        Args:
          params: the parameters (fresh or restored).
          opt_state: the optimizer state (fresh or restored).

        Returns:
          ``(params, opt_state)``, placed.
        """
        return (jax.device_put(params, self.param_shardings),
                jax.device_put(opt_state, self.opt_shardings))

    def _variant(self, refresh: Any) -> Any:
        """``refresh`` as a key of the compiled variants: :data:`STATS` where the plan has
        statistics steps, else ``True`` where it has a refresh variant, else ``False``."""
        if refresh is STATS:
            return STATS if self.optimizer.plan.stats_variant else False
        return bool(refresh) and True in self.variants()

    def is_compiled(self, refresh: Any) -> bool:
        """Whether a variant has been compiled.

        Args:
          refresh: the variant, as :meth:`compiled`.
        """
        return self._variant(refresh) in self._compiled

    def compiled(self, refresh: Any) -> jax.stages.Compiled:
        """The compiled variant (compiling it on first use).

        Args:
          refresh: the variant: ``False``, ``True`` (the refresh variant; a run without one
            gets the ordinary variant) or :data:`~gift_jax.training.method.STATS` (the
            statistics-only variant; a run without one gets the ordinary variant).

        Returns:
          The compiled ``(params, opt_state, batch) → (params, opt_state, metrics)``
          (``params`` and ``opt_state`` are donated).
        """
        refresh = self._variant(refresh)
        if refresh not in self._compiled:
            fn = train_step_fn(self.model_def, self.optimizer, self.mesh, self.opt_specs,
                               accum_steps=self.accum_steps, refresh=refresh,
                               layout=self.layout, runner=self.runner)
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

    def refresh_due(self, step: int, opt_state: OptState) -> Any:
        """The variant ``step`` (0-based) runs (the plan's rule): ``True`` (refresh),
        :data:`~gift_jax.training.method.STATS` (statistics only; falsy, ``int`` 0) or
        ``False``.

        Args:
          step: the 0-based index of the step about to run.
          opt_state: the whole optimizer state before the step.

        Returns:
          The variant to call.
        """
        return self.optimizer.plan.refresh_due(step, opt_state)

    def __call__(self, params: Params, opt_state: OptState, batch: jax.Array,
                 refresh: Any = False) -> tuple[Params, OptState, Metrics]:
        return self.compiled(refresh)(params, opt_state, batch)

    def wire_report(self, refresh: Any = False) -> WireReport:
        """Collectives of a variant and their bytes per device (from the compiled HLO).

        Args:
          refresh: the variant, as :meth:`compiled` (compiled first if it is not yet).

        Returns:
          The variant's :class:`~gift_jax.comm.wire.WireReport` (cached).
        """
        refresh = self._variant(refresh)
        if refresh not in self._wire:
            self._wire[refresh] = parse_hlo(self.compiled(refresh).as_text(),
                                                     mesh=self.mesh)
        return self._wire[refresh]

    def variants(self) -> tuple[bool, ...]:
        """The variants this run compiles ahead: ``(False,)`` or ``(False, True)`` (a plan's
        statistics-only variant, :data:`~gift_jax.training.method.STATS`, compiles on its
        first step, off the trainer's clock)."""
        return self.optimizer.plan.variants()
