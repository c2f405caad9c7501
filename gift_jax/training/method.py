"""The run's communication method: one object owns every method-dependent question.

A run's gradient communication is two settings:

* ``comm.codec`` — the wire format of the all-reduce (``fp32 | bf16 | fp8_e4m3 | fp8_e5m2 |
  mxfp8 | nvfp4 | int8``, with ``comm.scaling`` / ``comm.block_size``);
* ``comm.method`` — what is done around it: ``none`` (a plain quantized all-reduce),
  ``gift`` (GIFT whitening of ``gift.layers``, factors refreshed every ``gift.refresh_every``
  steps) or ``plumage`` (PLUMAGE low-rank Adam, which reduces the projected coordinates; with
  ``plumage.gift`` they are GIFT-whitened too).

The run's :class:`~gift_jax.training.recipe.Recipe` holds its :class:`CommPlan`, and the
trainer asks it — never the config — which optax chain to build (:meth:`CommPlan.build`),
which variant a step runs (:meth:`CommPlan.refresh_due`: ordinary ``False``, refresh ``True``,
or :data:`STATS`, GIFT's statistics-only step), which layers' statistics a step captures
(:meth:`CommPlan.capture_layers`), which extra arguments go to the optimizer's update
(:meth:`CommPlan.update_kwargs`), where the recorded gradient norm lives
(:meth:`CommPlan.grad_norm`) and how the fidelity diagnostic reproduces the reduction
(:meth:`CommPlan.roundtrip`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from gift_jax.comm.overlap import reducible_in_backward
from gift_jax.comm.stage import reset_error_feedback, saturation_metrics
from gift_jax.lowrank import find_plumage_state, plumage
from gift_jax.lowrank import refresh_due as plumage_refresh_due
from gift_jax.training import optim
from gift_jax.training.config import ConfigError
from gift_jax.training.optim import GradNormState, skip_nonfinite
from gift_jax.training.optimizers import decay_mask
from gift_jax.utils.axes import axis_name_of
from gift_jax.whitening.stage import (
    coverage_bases,
    refresh_due_adaptive,
    whitened_fraction,
)
from gift_jax.whitening.stage import refresh_due as gift_refresh_due


class StatsVariant:
    """The type of :data:`STATS`, the statistics-only step variant (capture the input
    statistics and fold them into GIFT's EMA, no eigendecomposition): falsy and ``int(STATS)
    == 0`` (a caller that counts refreshes as ``int(variant)`` counts none), equal only to
    itself (a key of its own beside ``False`` and ``True``)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __int__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "STATS"

    def __reduce__(self) -> str:
        return "STATS"


#: The statistics-only step variant (:class:`StatsVariant`); the other two are ``False``
#: (ordinary) and ``True`` (refresh).
STATS = StatsVariant()


def is_refresh(variant: Any) -> bool:
    """Whether a step variant is the refresh one (``True``; not ``False`` or :data:`STATS`).

    Args:
      variant: ``False``, ``True`` or :data:`STATS`.

    Returns:
      ``True`` for the refresh variant.
    """
    return variant is not STATS and bool(variant)


def captures(variant: Any) -> bool:
    """Whether a step variant captures input statistics (refresh or :data:`STATS`).

    Args:
      variant: ``False``, ``True`` or :data:`STATS`.

    Returns:
      ``True`` for the refresh and statistics variants.
    """
    return variant is STATS or is_refresh(variant)


@dataclasses.dataclass(frozen=True)
class CommPlan:
    """``comm.method='none'``: the chain is ``all-reduce → record norm → clip → optimizer``.

    Attributes:
      codec: ``comm.codec``, the all-reduce's wire format.
      refresh_every: period of the refresh variant (GIFT factors / PLUMAGE projection), or
        ``None`` when the method has no refresh variant.
      gift_layers: layer patterns whose input statistics a refresh step captures (``()``
        without a GIFT stage).
      gift_two_sided: a refresh also captures the output-side statistics ``B = E[g gᵀ]``.
      update_rule: ``schedule → optax transformation`` replacing the config's AdamW/Muon after
        the reduction and clipping (the experiments' baselines); ``None``: the config's.
      adaptive_refresh: ``(threshold, min_every, max_every)`` of ``gift.refresh='adaptive'``
        (:func:`~gift_jax.whitening.stage.refresh_due_adaptive`), ``None``: the fixed clock.
      shards: the all-reduce's :class:`gift_jax.LocalShards` on a sharded mesh, else ``None``.
    """

    codec: str
    refresh_every: int | None = None
    gift_layers: tuple[str, ...] = ()
    gift_two_sided: bool = False
    update_rule: Callable[[optax.Schedule], optax.GradientTransformation] | None = None
    adaptive_refresh: tuple[float, int, int] | None = None
    shards: Any = None

    name = "none"
    #: the type name of the communication stage's state in the optimizer state (what the
    #: in-backward reduction reads, ``optax.tree.get``)
    stage_state = "AllReduceState"

    # ---- host side ----------------------------------------------------------------------

    def variants(self) -> tuple[bool, ...]:
        """The step variants a run compiles ahead: ``(False,)``, or ``(False, True)`` with a
        refresh variant (GIFT's statistics-only variant :data:`STATS`, where a plan has one,
        :attr:`stats_variant`, compiles on its first step, off the trainer's clock)."""
        return (False,) if self.refresh_every is None else (False, True)

    @property
    def stats_variant(self) -> bool:
        """Whether some steps run the statistics-only variant :data:`STATS` (never here)."""
        return False

    def refresh_due(self, step: int, opt_state: Any) -> bool:
        """Whether ``step`` (0-based) runs the refresh variant; never for this plan.

        Args:
          step: the 0-based index of the step about to run.
          opt_state: the whole optimizer state before the step.

        Returns:
          ``False``.
        """
        del step, opt_state
        return False

    def refresh_fraction(self) -> float:
        """Nominal fraction of steps that refresh (for the mean wire bytes per step)."""
        return 1.0 / self.refresh_every if self.refresh_every else 0.0

    # ---- inside the step ----------------------------------------------------------------

    def capture_layers(self, refresh: Any) -> tuple[str, ...]:
        """Layers whose input statistics the step variant ``refresh`` captures: the GIFT
        layers on refresh and statistics steps, else none.

        Args:
          refresh: the step variant (``False``, ``True`` or :data:`STATS`).

        Returns:
          :attr:`gift_layers` on a refresh or statistics step, else ``()``.
        """
        return self.gift_layers if captures(refresh) else ()

    def coverage_bases(self, refresh: bool, opt_state: Any) -> dict[str, Any] | None:
        """The factor bases whose input coverage the step variant ``refresh`` measures (GIFT's
        adaptive refresh, ordinary steps), read from the traced ``opt_state``; else ``None``.

        Args:
          refresh: whether the step is the refresh variant.
          opt_state: the whole optimizer state inside the step (traced).

        Returns:
          ``None`` (no coverage is measured without GIFT's adaptive refresh).
        """
        del refresh, opt_state
        return None

    def update_kwargs(self, refresh: bool, stats: Any) -> dict[str, Any]:
        """Extra keyword arguments of ``tx.update`` for the variant ``refresh`` given the
        captured statistics.

        Args:
          refresh: whether the step is the refresh variant.
          stats: what the step captured: ``{layer path: A}``, ``(A, B)`` when two-sided, or
            ``{}`` when it captured nothing.

        Returns:
          ``{"gift_stats": A}`` (plus ``"gift_output_stats": B`` when two-sided) on a step
          that captures layers (:meth:`capture_layers`), with ``"gift_refresh": False`` on a
          statistics step (:data:`STATS`: fold, no refresh), else ``{}``.
        """
        kwargs: dict[str, Any] = {}
        if self.capture_layers(refresh):
            if self.gift_two_sided:
                kwargs["gift_stats"], kwargs["gift_output_stats"] = stats
            else:
                kwargs["gift_stats"] = stats
            if refresh is STATS:
                kwargs["gift_refresh"] = False
        return kwargs

    def state_metrics(self, opt_state: Any) -> dict[str, float]:
        """Metrics read from the optimizer state for the diagnostics record: with stale
        per-tensor scales (``comm.scale_sync_every > 1``) each leaf's saturation on the last
        step (:func:`gift_jax.comm.stage.saturation_metrics`: ``comm/saturation/<path>``, the
        share of the replicas' gradient elements beyond their stale scale, and
        ``comm/saturation_mean/<path>``, of the reduced mean's).

        Args:
          opt_state: the whole optimizer state (on the host's side of the step).

        Returns:
          ``{metric: value}`` (``{}`` without stale scales).
        """
        return saturation_metrics(opt_state)

    def grad_norm(self, inner_state: Any, refresh: bool) -> jax.Array:
        """The reduced-gradient norm this step recorded.

        Args:
          inner_state: the chain's state inside
            :func:`~gift_jax.training.optim.skip_nonfinite` (``SkipState.inner``).
          refresh: whether the step is the refresh variant (no effect here).

        Returns:
          The () float32 norm of the :class:`~gift_jax.training.optim.GradNormState` in
          ``inner_state``.
        """
        del refresh
        return _grad_norm_state(inner_state).norm

    def roundtrip(self, stage: optax.GradientTransformation, grads: Any,
                  inner_state: Any) -> tuple[Any, dict | None]:
        """``(reduced grads, GIFT factors or None)``: the run's reduction of ``grads`` for the
        fidelity diagnostic, from a fresh stage state.

        Args:
          stage: the communication stage alone (:attr:`Optimizer.stage`).
          grads: this device's gradients (inside ``shard_map``).
          inner_state: the chain's state inside :func:`~gift_jax.training.optim.skip_nonfinite`
            (not read here).

        Returns:
          ``(reduced grads, None)``.
        """
        del inner_state
        approx, _ = stage.update(grads, stage.init(grads))
        return approx, None

    # ---- the chain ----------------------------------------------------------------------

    def build(self, recipe: Any, axes: tuple[str, ...], schedule: optax.Schedule
              ) -> tuple[optax.GradientTransformation, optax.GradientTransformation]:
        """``(chain, stage)``: the chain before
        :func:`~gift_jax.training.optim.skip_nonfinite`, and the communication stage alone (for
        the fidelity diagnostic).

        Args:
          recipe: the run's :class:`~gift_jax.training.recipe.Recipe` (communication,
            optimizer, GIFT/PLUMAGE options; it builds the plan, so the plan reads it by
            attribute rather than importing it).
          axes: the data-parallel mesh axes.
          schedule: the learning rate per step.

        Returns:
          ``(chain, stage)``.
        """
        stage = recipe.comm.allreduce(axes, self.shards)
        return self._dense_chain(recipe, stage, schedule), stage

    def backward_stage(self, chain: optax.GradientTransformation,
                       stage: optax.GradientTransformation) -> Any:
        """What the in-backward reduction runs
        (:func:`gift_jax.comm.overlap.loss_and_reduced_grads`), on the state named
        :attr:`stage_state`: the communication stage itself (GIFT's stage declares its frame
        itself).

        Args:
          chain: the chain :meth:`build` returned.
          stage: the stage :meth:`build` returned.

        Returns:
          ``stage``.
        """
        del chain
        return stage

    def _dense_chain(self, recipe: Any, stage, schedule) -> optax.GradientTransformation:
        opt = recipe.optimizer
        rule = optim.dense_optimizer(opt, schedule, recipe.comm.stacked_layers) if (
            self.update_rule is None) else self.update_rule(schedule)
        if recipe.comm.reduce_in == "backward":  # the trainer may hand in the reduced state
            stage = reducible_in_backward(stage)
        return optax.chain(stage, optim.record_grad_norm(), *optim.clip_stages(opt), rule)


@dataclasses.dataclass(frozen=True)
class GiftPlan(CommPlan):
    """``comm.method='gift'``: GIFT whitening around the all-reduce; refresh steps (every
    ``gift.refresh_every``) capture the input (and with ``gift.two_sided`` output) statistics
    of ``gift.layers`` and pass them as ``gift_stats=`` (``gift_output_stats=``); under the
    bias-corrected EMA so do the statistics steps (:data:`STATS`, every ``gift.stats_every``
    steps), with ``gift_refresh=False``.

    Attributes:
      stats_every: ``gift.stats_every`` under the bias-corrected EMA, ``None`` under the
        artifact's (statistics on refreshes only).
    """

    stats_every: int | None = None

    name = "gift"
    stage_state = "GiftState"

    @property
    def stats_variant(self) -> bool:
        """Whether some steps only fold statistics (:data:`STATS`): the bias-corrected EMA
        with ``gift.stats_every`` not a multiple of the fixed refresh period (else every
        statistics step is a refresh step), or with the adaptive rule."""
        every = self.stats_every
        if every is None:
            return False
        return self.adaptive_refresh is not None or every % self.refresh_every != 0

    def refresh_due(self, step: int, opt_state: Any) -> Any:
        """The step's variant: refresh (``True``) under ``gift.refresh='fixed'`` every
        ``gift.refresh_every`` steps, under ``'adaptive'`` when the GIFT state's staleness
        signal says so (reads it from ``opt_state``); else, under the bias-corrected EMA,
        :data:`STATS` every ``gift.stats_every`` steps (fold the statistics, keep the
        factors); else ``False``.

        Args:
          step: the 0-based index of the step about to run (read by the fixed clocks).
          opt_state: the whole optimizer state before the step (the adaptive rule reads its
            :class:`~gift_jax.whitening.stage.GiftState`, a device-to-host transfer).

        Returns:
          ``True``, :data:`STATS` or ``False``.
        """
        if self.adaptive_refresh is None:
            due = gift_refresh_due(step, self.refresh_every)
        else:
            due = refresh_due_adaptive(optax.tree.get(opt_state, "GiftState"),
                                       *self.adaptive_refresh)
        if due:
            return True
        if self.stats_every is not None and step % self.stats_every == 0:
            return STATS
        return False

    def coverage_bases(self, refresh, opt_state):
        """Adaptive refresh: on ordinary steps, the bases of the GIFT state's factors (the
        step measures its layers' input coverage in them, :mod:`gift_jax.whitening.capture`).

        Args:
          refresh: whether the step is the refresh variant.
          opt_state: the whole optimizer state inside the step (traced), holding the
            :class:`~gift_jax.whitening.stage.GiftState`.

        Returns:
          ``{kernel path: (B, S)}`` of :func:`~gift_jax.whitening.stage.coverage_bases`, or
          ``None`` on refresh steps, under the fixed rule, or when no factor has a basis yet.
        """
        if captures(refresh) or self.adaptive_refresh is None:
            return None
        return coverage_bases(optax.tree.get(opt_state, "GiftState")) or None

    def update_kwargs(self, refresh, stats):
        """:meth:`CommPlan.update_kwargs`, except on the ordinary steps of the adaptive rule,
        which pass the input-coverage sums they measured as ``gift_coverage=``.

        Args:
          refresh: whether the step is the refresh variant.
          stats: the captured statistics (refresh steps) or, on ordinary steps of the adaptive
            rule, the coverage sums ``{layer path: lead + (2,)}`` (``{}``: none measured).

        Returns:
          ``{"gift_coverage": stats}`` (``{}`` without sums) on an ordinary step of the
          adaptive rule, else :meth:`CommPlan.update_kwargs`'s arguments.
        """
        if self.adaptive_refresh is not None and not captures(refresh):
            return {"gift_coverage": stats} if stats else {}
        return super().update_kwargs(refresh, stats)

    def state_metrics(self, opt_state):
        """:meth:`CommPlan.state_metrics`, and with ``gift.route_frame`` on:
        ``gift/whitened_fraction`` (of all selected matrices) and ``gift/whitened/<layer
        path>`` (fraction of that leaf's matrices, e.g. the layers of a scanned stack) sent
        through the whitened transport until the next refresh.

        Args:
          opt_state: the whole optimizer state, holding the
            :class:`~gift_jax.whitening.stage.GiftState`.

        Returns:
          These metrics as floats (none of GIFT's with ``gift.route_frame='off'``).
        """
        out = super().state_metrics(opt_state)
        state = optax.tree.get(opt_state, "GiftState")
        frac = whitened_fraction(state)
        if frac is None:
            return out
        out["gift/whitened_fraction"] = float(frac)
        for path, use in state.member("use_whitening").items():
            out[f"gift/whitened/{path}"] = float(jax.numpy.mean(use.astype("float32")))
        return out

    def roundtrip(self, stage, grads, inner_state):
        """The GIFT stage with its current factors and zeroed error-feedback buffers; returns
        the factors of single-block layers for the whitened-frame error.

        Args:
          stage: the GIFT stage (:attr:`Optimizer.stage`).
          grads: this device's gradients (inside ``shard_map``).
          inner_state: the chain's state inside :func:`~gift_jax.training.optim.skip_nonfinite`,
            holding the :class:`~gift_jax.whitening.stage.GiftState`.

        Returns:
          ``(reduced grads, factors)``: ``{layer path: factor}`` of the layers with one block
          (batch size 1), batch axis dropped, or ``None`` when there is none.
        """
        gift_state = reset_error_feedback(optax.tree.get(inner_state, "GiftState"))
        approx, _ = stage.update(grads, gift_state)
        factors = {path: jax.tree.map(lambda x: x[0], f)
                   for path, f in gift_state.member("factor").items()
                   if all(x.shape[0] == 1 for x in jax.tree.leaves(f))}
        return approx, factors or None

    def build(self, recipe, axes, schedule):
        """``(chain, stage)``: the GIFT stage (``recipe.gift.stage``, tracking coverage under
        the adaptive rule) around the all-reduce, then the dense chain.

        Args:
          recipe, axes, schedule: as :meth:`CommPlan.build`.

        Returns:
          ``(chain, stage)``, ``stage`` the GIFT stage.
        """
        stage = recipe.gift.stage(
            recipe.comm.allreduce(axes, self.shards), axes, recipe.comm, recipe.optimizer.eps,
            layers=self.gift_layers, two_sided=self.gift_two_sided,
            track_coverage=self.adaptive_refresh is not None)
        return self._dense_chain(recipe, stage, schedule), stage


@dataclasses.dataclass(frozen=True)
class PlumagePlan(CommPlan):
    """``comm.method='plumage'``: PLUMAGE reduces inside the optimizer (projected coordinates
    on ordinary steps, the full gradient on refresh steps). The refresh rule reads PLUMAGE's
    state (``plumage.refresh_every``, or the interval an adaptive rule maintains) and is passed
    as ``plumage_refresh=``; with ``plumage.gift`` refresh steps also capture the statistics of
    ``gift.layers`` for GIFT's projected factors."""

    name = "plumage"
    stage_state = "PlumageState"

    def refresh_due(self, step: int, opt_state: Any) -> bool:
        """Whether PLUMAGE's state says a refresh is due (:func:`gift_jax.lowrank.refresh_due`:
        before the first refresh, then every refresh interval).

        Args:
          step: the 0-based index of the step about to run (not read: the state counts).
          opt_state: the whole optimizer state before the step, holding one
            :class:`~gift_jax.lowrank.PlumageState` (a device-to-host transfer).

        Returns:
          Whether the step refreshes PLUMAGE's projection.
        """
        del step
        return bool(plumage_refresh_due(opt_state))

    def update_kwargs(self, refresh, stats):
        """``plumage_refresh=refresh``, and with ``plumage.gift`` the GIFT statistics a refresh
        step captured (:meth:`CommPlan.update_kwargs`).

        Args:
          refresh: whether the step is the refresh variant.
          stats: what the step captured (``{}`` when nothing).

        Returns:
          ``{"plumage_refresh": refresh, ...}``.
        """
        return {"plumage_refresh": refresh, **super().update_kwargs(refresh, stats)}

    def grad_norm(self, inner_state, refresh):
        """PLUMAGE keeps two communication states (ordinary and refresh steps): the one used
        (refresh steps fall back to the ordinary one when no separate refresh stage exists).

        Args:
          inner_state: the chain's state inside :func:`~gift_jax.training.optim.skip_nonfinite`,
            holding the :class:`~gift_jax.lowrank.PlumageState`.
          refresh: whether the step was a refresh step.

        Returns:
          The () float32 norm.
        """
        state = find_plumage_state(inner_state)
        found = _grad_norm_state(state.refresh_comm_state) if refresh else None
        return (_grad_norm_state(state.comm_state) if found is None else found).norm

    def backward_stage(self, chain, stage):
        """PLUMAGE's projection around the all-reduce
        (:meth:`~gift_jax.lowrank.PlumageTransformation.around`): ordinary steps reduce the
        projected coordinates inside the backward pass.

        Args:
          chain: the PLUMAGE chain :meth:`build` returned.
          stage: its all-reduce.

        Returns:
          The :class:`~gift_jax.lowrank.ProjectionAroundAllReduce`.
        """
        return chain.around(stage)

    def build(self, recipe, axes, schedule):
        """``(chain, stage)``: PLUMAGE as the optimizer, reducing through ``all-reduce → record
        norm → clip`` (with ``plumage.gift``: GIFT around the all-reduce on ordinary steps, the
        plain chain on refresh steps).

        Args:
          recipe, axes, schedule: as :meth:`CommPlan.build`.

        Returns:
          ``(chain, stage)``, ``stage`` the plain all-reduce.

        Raises:
          ConfigError: the plan carries an ``update_rule`` (PLUMAGE is the optimizer).
        """
        if self.update_rule is not None:
            raise ConfigError("an update_rule replaces the dense optimizer; with "
                              "comm.method='plumage' PLUMAGE is the optimizer")
        pl, opt, comm = recipe.plumage, recipe.optimizer, recipe.comm
        stage = comm.allreduce(axes, self.shards)
        first = reducible_in_backward(stage) if comm.reduce_in == "backward" else stage
        communicate = optax.chain(first, optim.record_grad_norm(), *optim.clip_stages(opt))
        communicate_refresh = None
        if self.gift_layers:  # ordinary steps: GIFT-whitened (k, N) coordinates
            communicate_refresh = communicate  # refresh steps: the full gradient, plain
            # GIFT for PLUMAGE's (k, N) coordinates R = MᵀG of gift.layers: whitened with the
            # factor of MᵀAM, rebuilt on every PLUMAGE refresh (gift.refresh_every does not
            # apply); GIFT reads k from the coordinates and the layers' input widths from
            # PLUMAGE's hook (GiftState.with_input_widths)
            communicate = optax.chain(recipe.gift.stage(stage, axes, comm, opt.eps),
                                      optim.record_grad_norm(), *optim.clip_stages(opt))
        dims = optim.lowrank_dimension_numbers(comm.stacked_layers)
        tx = plumage(
            schedule,
            rank=pl.rank,
            refresh_every=pl.refresh_every,
            weight_decay=opt.weight_decay,
            weight_decay_mask=decay_mask,
            strategy=pl.projector,
            realign=pl.realign_moments,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            scale=pl.scale,
            seed=comm.seed,
            mask=optim.plumage_mask(pl.layers, pl.rank, dims),
            weight_dimension_numbers=dims,
            communicate=communicate,
            communicate_refresh=communicate_refresh,
            axis_name=axis_name_of(axes),
            distribute_refresh=comm.distribute_refresh,
        )
        return tx, stage


def _grad_norm_state(tree: Any) -> GradNormState | None:
    """The one :class:`~gift_jax.training.optim.GradNormState` in ``tree`` (found by type name
    with ``optax.tree.get``; ``None`` when there is none, a ``KeyError`` when there are two)."""
    return optax.tree.get(tree, GradNormState.__name__)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The run's optax chain and what the trainer needs to drive it.

    Attributes:
      tx: the full chain (update inside ``shard_map`` on per-device gradients).
      schedule: learning rate per step (for logging).
      plan: the :class:`CommPlan` of ``comm.codec`` +
        ``comm.method``: refresh schedule, captured statistics, extra update arguments.
      stage: the communication stage alone (for fidelity diagnostics; for PLUMAGE its
        all-reduce, applied to full gradients).
      in_backward: the trainer reduces inside the backward pass
        (:func:`gift_jax.comm.overlap.loss_and_reduced_grads` with ``backward_stage``, its new
        state handed to ``tx.update`` as ``reduced_in_backward``).
      backward_stage: what the in-backward reduction runs (:meth:`CommPlan.backward_stage`;
        ``stage``, or PLUMAGE's projection around it).
    """

    tx: optax.GradientTransformationExtraArgs
    schedule: optax.Schedule
    plan: CommPlan
    stage: optax.GradientTransformation
    in_backward: bool = False
    backward_stage: Any = None

    @property
    def refresh_every(self) -> int | None:
        """Period of the refresh variant (GIFT/PLUMAGE), else ``None``."""
        return self.plan.refresh_every


def build_optimizer(recipe: Any, axes: tuple[str, ...],
                    update_rule: Callable[[optax.Schedule], optax.GradientTransformation]
                    | None = None, *, shards: Any = None) -> Optimizer:
    """The chain of a run: :meth:`CommPlan.build` of the recipe's plan, wrapped in
    :func:`~gift_jax.training.optim.skip_nonfinite`.

    Args:
      recipe: the run's :class:`~gift_jax.training.recipe.Recipe`.
      axes: the data-parallel mesh axes.
      update_rule: ``schedule → transformation`` replacing the config's optimizer after the
        reduction and clipping (``comm.method`` none or gift), or ``None``.
      shards: a :class:`gift_jax.LocalShards` when the gradients are split over model axes
        inside each replica (the all-reduce reduces each device's local shard), or ``None``.

    Returns:
      The :class:`Optimizer`.
    """
    plan = recipe.method
    if update_rule is not None:
        plan = dataclasses.replace(plan, update_rule=update_rule)
    if shards is not None:
        plan = dataclasses.replace(plan, shards=shards)
    schedule = recipe.optimizer.learning_rate_schedule()
    chain, stage = plan.build(recipe, axes, schedule)
    return Optimizer(skip_nonfinite(chain), schedule, plan, stage,
                     in_backward=recipe.comm.reduce_in == "backward",
                     backward_stage=plan.backward_stage(chain, stage))
