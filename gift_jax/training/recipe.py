"""The run's typed recipe: the front door of :mod:`gift_jax.training`.

:meth:`Recipe.from_config` checks a completed config against the devices
(:func:`~gift_jax.training.config.validate_config`) and turns it into typed, frozen parts;
below it nothing reads a ``ConfigDict`` or compares a codec or optimizer name:

* ``model``: the family's :class:`~gift_jax.models.ModelSpec` and its config dataclass;
* ``comm``: :class:`CommOptions`, the all-reduce's settings resolved against its
  :class:`~gift_jax.comm.codecs.Codec` (block scales only where the codec supports them,
  stochastic rounding and error feedback only where it quantizes), which builds the stage;
* ``optimizer``: :class:`OptimizerOptions` (the ``optimizer`` group, typed) with its
  registry entry (:mod:`~gift_jax.training.optimizers`) and learning-rate schedule;
* ``gift``, ``plumage``: :class:`GiftOptions`, :class:`PlumageOptions` (their groups, typed;
  ``gift.route_frame="optimizer"`` resolved through the optimizer's entry);
* ``method``: the :class:`~gift_jax.training.method.CommPlan` of ``comm.method``.

The config itself stays the record of the run (a checkpoint stores it, resuming compares
it); the trainer's loop reads its cadences (``train.log_every`` …) from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections
import optax

from gift_jax.comm.codecs import Codec, get_codec
from gift_jax.comm.fsdp import FsdpCodecs
from gift_jax.comm.layer_groups import LayerGroups
from gift_jax.comm.stage import allreduce
from gift_jax.models import ModelSpec, model_config_of, model_spec
from gift_jax.training.config import (
    GIFT_REMAINDERS,
    METHODS,
    ConfigError,
    schedule_length,
    validate_config,
    warmup_length,
)
from gift_jax.training.mesh import DEFAULT_RULES, FSDP_AXIS
from gift_jax.training.method import CommPlan, GiftPlan, PlumagePlan
from gift_jax.training.optim import learning_rate_schedule, stacked_kernels
from gift_jax.training.optimizers import STACKED_AXES, OptimizerEntry, get_optimizer
from gift_jax.utils.axes import axis_name_of
from gift_jax.utils.matrices import MatrixDimensionNumbers
from gift_jax.whitening.stage import gift

__all__ = [
    "CommOptions",
    "GiftOptions",
    "OptimizerOptions",
    "PlumageOptions",
    "Recipe",
]


def _typed(cls: type, group: Mapping[str, Any], **resolved: Any) -> Any:
    """``cls`` (a frozen dataclass) from a config group: every field read from ``group``
    except those given resolved."""
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**{n: resolved[n] if n in resolved else group[n] for n in names})


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """The ``optimizer`` group, typed (see :func:`gift_jax.training.defaults.default_config`
    for each setting). ``schedule_steps`` is resolved: the schedule's length in steps;
    ``warmup_steps`` too: the warmup's (``optimizer.warmup_fraction`` applied)."""

    name: str
    learning_rate: float
    final_learning_rate: float
    warmup_steps: int
    warmup_fraction: float
    schedule: str
    weight_decay: float
    b1: float
    b2: float
    eps: float
    grad_clip_norm: float
    momentum: float
    nesterov: bool
    muon_scale_mode: str
    muon_extra_scale_factor: float
    schedule_steps: int

    @property
    def entry(self) -> OptimizerEntry:
        """The optimizer's registry entry."""
        return get_optimizer(self.name)

    def learning_rate_schedule(self) -> optax.Schedule:
        """Warmup, then decay over :attr:`schedule_steps`
        (:func:`~gift_jax.training.optim.learning_rate_schedule`)."""
        return learning_rate_schedule(self, self.schedule_steps)


@dataclasses.dataclass(frozen=True)
class CommOptions:
    """The ``comm`` group resolved against its codec: what the all-reduce stage is built from.

    Attributes:
      codec: the wire format (a :class:`~gift_jax.comm.codecs.Codec`).
      block_size: elements per scale (``comm.scaling='block'`` on a codec that supports
        block scaling), else ``None`` (per tensor, or the format's own blocks).
      stochastic_rounding, error_feedback: as set, and off on an exact codec (fp32).
      fp8_accumulation: emulate the FP8 ring (a global scale and FP8 partial sums).
      intra_codec: the codec inside the intra-node axis of a hierarchical mesh.
      distribute_refresh: spread GIFT/PLUMAGE refresh decompositions over the replicas.
      seed: the run's seed (stochastic-rounding keys).
      stacked_layers: the model scans its blocks (one matrix per layer in stacked kernels).
      reduce_in: ``"after"`` the backward pass or inside it, ``"backward"``
        (:mod:`gift_jax.comm.overlap`; the stage then reduces by
        :class:`~gift_jax.comm.layer_groups.LayerGroups`).
      bucket_elems: the bucket size in elements.
      exchange: how quantized bytes cross the data axis (``"auto"``, ``"all_to_all"``,
        ``"permute"``; :func:`gift_jax.allreduce`).
      scale_sync_every: per-tensor scales synced every this many steps and reused in between
        (1: fresh every step; :func:`gift_jax.allreduce`).
      pack: how buckets are packed, ``"bytes"`` or ``"floats"`` (:func:`gift_jax.allreduce`).
      fsdp: the blocks' ``fsdp`` collectives' codecs (``comm.fsdp_codec``,
        ``comm.fsdp_weight_codec``; :mod:`gift_jax.comm.fsdp`), or ``None`` (XLA's).
    """

    codec: Codec
    block_size: int | None
    stochastic_rounding: bool
    error_feedback: bool
    fp8_accumulation: bool
    intra_codec: str
    distribute_refresh: bool
    seed: int
    stacked_layers: bool
    reduce_in: str
    bucket_elems: int
    exchange: str
    scale_sync_every: int = 1
    pack: str = "bytes"
    fsdp: FsdpCodecs | None = None

    @classmethod
    def of(cls, comm: Mapping[str, Any], seed: int, stacked_layers: bool) -> CommOptions:
        """From a validated ``comm`` group.

        Args:
          comm: the validated ``comm`` group (any mapping of its settings).
          seed: ``train.seed`` (the stochastic-rounding keys).
          stacked_layers: the model scans its blocks (``model.scan_layers``).

        Returns:
          The options: a block size only for ``comm.scaling='block'`` on a codec that supports
          it, stochastic rounding and error feedback off on an exact codec.
        """
        codec = get_codec(comm["codec"])
        block = comm["block_size"] if (codec.supports_block_scaling
                                       and comm["scaling"] == "block") else None
        fsdp = None
        if comm.get("fsdp_codec"):  # scaled as the data axis's codec (comm.scaling)
            scaled = lambda name: get_codec(name, comm["block_size"] if (
                get_codec(name).supports_block_scaling and comm["scaling"] == "block") else None)
            weight = comm.get("fsdp_weight_codec") or None
            fsdp = FsdpCodecs(FSDP_AXIS, scaled(comm["fsdp_codec"]),
                              None if weight is None else scaled(weight))
        return cls(codec=codec, block_size=block,
                   stochastic_rounding=bool(comm["stochastic_rounding"]) and not codec.is_exact,
                   error_feedback=bool(comm["error_feedback"]) and not codec.is_exact,
                   fp8_accumulation=bool(comm["fp8_accumulation"]),
                   intra_codec=comm["intra_codec"],
                   distribute_refresh=bool(comm["distribute_refresh"]), seed=seed,
                   stacked_layers=stacked_layers, reduce_in=comm["reduce_in"],
                   bucket_elems=int(comm["bucket_elems"]), exchange=comm["exchange"],
                   scale_sync_every=int(comm.get("scale_sync_every", 1)),
                   pack=comm.get("pack", "bytes"), fsdp=fsdp)

    def allreduce(self, axes: tuple[str, ...], shards: Any = None
                  ) -> optax.GradientTransformation:
        """The quantized all-reduce stage over the data axes ``axes``.

        Args:
          axes: the data axes, ``('data',)`` or ``('data', 'intra')`` (a second axis: the
            intra-node one of a hierarchical reduction, reduced first in ``intra_codec``).
          shards: reduce each device's local shard (:class:`gift_jax.LocalShards`, on a
            sharded mesh), or ``None``.

        Returns:
          The :func:`gift_jax.allreduce` stage.
        """
        hierarchical = len(axes) > 1  # ('data', 'intra'): reduce over 'intra' first
        return allreduce(
            axes[0],
            codec=self.codec.name,
            block_size=self.block_size,
            stochastic_rounding=self.stochastic_rounding,
            error_feedback=self.error_feedback,
            seed=self.seed,
            global_scale=self.fp8_accumulation,
            accumulate="fp8" if self.fp8_accumulation else "fp32",
            intra_axis=axes[1] if hierarchical else None,
            intra_codec=self.intra_codec,
            shards=shards,
            stack_axes=stacked_kernels if self.stacked_layers else None,
            bucket_elems=self.bucket_elems,
            groups=LayerGroups(self.stacked_layers) if self.reduce_in == "backward" else None,
            exchange=self.exchange,
            scale_sync_every=self.scale_sync_every,
            pack=self.pack,
        )


@dataclasses.dataclass(frozen=True)
class GiftOptions:
    """The ``gift`` group, typed; ``route_frame`` resolved (``"optimizer"`` → the optimizer
    entry's frame)."""

    layers: tuple[str, ...]
    rank: int
    refresh_every: int
    damping: float
    ema: float
    remainder: str
    two_sided: bool
    route_frame: str
    refresh: str
    refresh_threshold: float
    min_refresh_every: int
    max_refresh_every: int
    eig_method: str
    ema_scheme: str = "bias_corrected"
    stats_every: int = 5
    stats_half_life: float = 10.0

    @property
    def stats_clock(self) -> int | None:
        """Every how many steps statistics are folded without a refresh (``gift.stats_every``
        under the bias-corrected EMA), or ``None``: only on refreshes (the artifact's EMA)."""
        return int(self.stats_every) if self.ema_scheme == "bias_corrected" else None

    @property
    def adaptive_refresh(self) -> tuple[float, int, int] | None:
        """``(threshold, min_every, max_every)`` of ``refresh='adaptive'``, else ``None``."""
        if self.refresh != "adaptive":
            return None
        return (float(self.refresh_threshold), int(self.min_refresh_every),
                int(self.max_refresh_every))

    def dimension_numbers(self, stacked_layers: bool) -> dict | None:
        """GIFT's ``dimension_numbers``: the stacked kernels' axes when the model scans its
        layers, else ``None`` (2-D kernels need none).

        Args:
          stacked_layers: the model scans its blocks (kernels ``(layers, in, out)``).

        Returns:
          ``{pattern: MatrixDimensionNumbers(1, 2)}`` for each of :attr:`layers`, or ``None``.
        """
        if not stacked_layers:
            return None
        return {p: MatrixDimensionNumbers(*STACKED_AXES) for p in self.layers}

    def stage(self, inner: optax.GradientTransformation, axes: tuple[str, ...],
              comm: CommOptions, adam_eps: float, *, layers: tuple[str, ...] | None = None,
              two_sided: bool = False, track_coverage: bool = False
              ) -> optax.GradientTransformation:
        """:func:`~gift_jax.whitening.stage.gift` around ``inner`` with these settings.

        Args:
          inner: the all-reduce stage.
          axes: the data axes the statistics are averaged over.
          comm: the run's communication options (refresh spreading, seed).
          adam_eps: ε of the ``"adam"`` routing frame (the optimizer's).
          layers: the whitened layer patterns (default: :attr:`layers`).
          two_sided: also whiten the output side.
          track_coverage: keep the adaptive refresh's staleness signal.

        Returns:
          The GIFT stage.
        """
        return gift(
            inner,
            layers=self.layers if layers is None else layers,
            dimension_numbers=self.dimension_numbers(comm.stacked_layers),
            rank=self.rank,
            factor=GIFT_REMAINDERS[self.remainder],
            damping=self.damping,
            eig_method=self.eig_method,
            ema=self.ema if self.ema_scheme == "artifact" else None,
            axis_name=axis_name_of(axes),
            two_sided=two_sided,
            distribute_refresh=comm.distribute_refresh,
            seed=comm.seed,
            route_frame=self.route_frame,
            route_adam_eps=adam_eps,
            track_coverage=track_coverage,
            ema_scheme=self.ema_scheme,
            stats_half_life=float(self.stats_half_life),
        )


@dataclasses.dataclass(frozen=True)
class PlumageOptions:
    """The ``plumage`` group, typed."""

    layers: tuple[str, ...]
    projector: str
    rank: int
    refresh_every: int
    scale: float
    realign_moments: bool
    gift: bool


def route_frame(config: ml_collections.ConfigDict) -> str:
    """``gift.route_frame`` of a validated config, ``"optimizer"`` resolved to the frame of the
    update the optimizer takes from the reduced gradient (its registry entry's
    :attr:`~gift_jax.training.optimizers.OptimizerEntry.route_frame`).

    Args:
      config: a validated config.

    Returns:
      A value of :data:`gift_jax.whitening.stage.ROUTE_FRAMES` (``"off"`` when the config has
      no ``gift.route_frame``).
    """
    frame = config.gift.get("route_frame", "off")
    if frame == "optimizer":
        return get_optimizer(config.optimizer.name).route_frame
    return frame


def comm_plan(method: str, codec: Codec, gift_options: GiftOptions,
              plumage_options: PlumageOptions) -> CommPlan:
    """The :class:`~gift_jax.training.method.CommPlan` of ``comm.method``.

    Args:
      method: ``comm.method``, one of :data:`~gift_jax.training.config.METHODS`.
      codec: the wire format (the plan records its name).
      gift_options: the ``gift`` group (layers, refresh period, two-sided, adaptive rule).
      plumage_options: the ``plumage`` group (refresh period; with ``gift``, refresh steps
        capture the statistics of ``gift_options.layers``).

    Returns:
      A ``CommPlan`` (``none``), ``GiftPlan`` (``gift``) or ``PlumagePlan`` (``plumage``).

    Raises:
      ConfigError: an unknown method, naming the allowed ones.
    """
    g = gift_options
    if method == "gift":
        return GiftPlan(codec.name, g.refresh_every, g.layers, g.two_sided,
                        adaptive_refresh=g.adaptive_refresh, stats_every=g.stats_clock)
    if method == "plumage":
        layers = g.layers if plumage_options.gift else ()
        return PlumagePlan(codec.name, plumage_options.refresh_every, layers)
    if method == "none":
        return CommPlan(codec.name)
    raise ConfigError(f"comm.method={method!r} is not supported; allowed: {', '.join(METHODS)}")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A validated run configuration as typed parts (module docstring).

    Attributes:
      config: the validated config (the run's record: checkpoints store it).
      model: the model family's spec.
      model_config: the family's config dataclass.
      comm: the all-reduce options.
      optimizer: the ``optimizer`` group, typed.
      gift, plumage: their groups, typed.
      method: the communication plan of ``comm.method``.
      seed: ``train.seed`` (initialisation, data order, sampling keys).
      global_batch_size, seq_len, grad_accum_steps: the step's shape.
      mesh_rules: logical axis → mesh axis (``mesh.rules``).
    """

    config: ml_collections.ConfigDict
    model: ModelSpec
    model_config: Any
    comm: CommOptions
    optimizer: OptimizerOptions
    gift: GiftOptions
    plumage: PlumageOptions
    method: CommPlan
    seed: int
    global_batch_size: int
    seq_len: int
    grad_accum_steps: int
    mesh_rules: dict[str, str]

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict, num_devices: int) -> Recipe:
        """Checks ``config`` (completed, see :func:`~gift_jax.training.config.complete_config`)
        for ``num_devices`` devices and builds its typed parts.

        Args:
          config: a completed config.
          num_devices: the number of devices of the run's mesh.

        Returns:
          The :class:`Recipe` (it keeps ``config`` as the run's record).

        Raises:
          ConfigError: a bad setting, in one line naming it and what is allowed.
        """
        validate_config(config, num_devices)
        model_config = model_config_of(config.model)
        tc = config.train
        comm = CommOptions.of(config.comm, tc.seed, bool(model_config.scan_layers))
        optimizer = _typed(OptimizerOptions, config.optimizer,
                           schedule_steps=schedule_length(config),
                           warmup_steps=warmup_length(config))
        gift_options = _typed(GiftOptions, config.gift, layers=tuple(config.gift.layers),
                              route_frame=route_frame(config))
        plumage_options = _typed(PlumageOptions, config.plumage,
                                 layers=tuple(config.plumage.layers))
        return cls(
            config=config, model=model_spec(model_config), model_config=model_config,
            comm=comm, optimizer=optimizer, gift=gift_options, plumage=plumage_options,
            method=comm_plan(config.comm.method, comm.codec, gift_options, plumage_options),
            seed=tc.seed, global_batch_size=tc.global_batch_size, seq_len=tc.seq_len,
            grad_accum_steps=tc.grad_accum_steps,
            mesh_rules=dict(config.mesh.get("rules", DEFAULT_RULES)),
        )
