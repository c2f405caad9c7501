"""The quantized all-reduce as an Optax stage: :func:`allreduce`.

Put it first in an ``optax.chain`` whose ``update`` runs inside ``jax.shard_map`` on per-device
gradients; everything after it (clipping, the optimizer) sees the reduced gradient, identical on
every replica::

    tx = optax.chain(gift_jax.allreduce("data", codec="fp8_e4m3"), optax.adamw(3e-4))

State: a PRNG key when stochastic rounding is on (identical on every replica; folded with the
replica index inside), error-feedback buffers when ``error_feedback=True`` (different on
every replica: initialise the state inside ``shard_map`` and shard those buffers over the data
axis with :func:`partition_specs`), and with ``scale_sync_every > 1`` the held per-tensor
scales, the step count of their clock and each leaf's saturation on the last step (identical
on every replica).

Non-finite gradients: a NaN or Inf in any replica's leaf (per-tensor codecs) or block
(per-block codecs) makes that leaf or block NaN in the result of *every* replica — never finite
garbage — so a finiteness check after the reduction (``optax.apply_if_finite``, or the
trainer's) takes the same decision everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from gift_jax.comm.buckets import DEFAULT_BUCKET_ELEMS
from gift_jax.comm.codecs import Codec
from gift_jax.comm.collectives import (
    AllReduceSpec,
    AxisName,
    all_reduce_tree,
    all_reduce_tree_stale,
    init_residuals,
    init_stale_scales,
    reframe_residuals,
    resolve_codecs,
)
from gift_jax.comm.layer_groups import LayerGroups, all_reduce_groups, init_group_residuals
from gift_jax.utils.axes import require_per_device
from gift_jax.utils.tree_paths import leaf_path


class AllReduceState(NamedTuple):
    """State of :func:`allreduce`."""

    key: jax.Array | None  # uint32[2] PRNG key for stochastic rounding (replicated), or None
    residuals: Any  # error-feedback buffers (per device, leading axis 1), or None
    # scale_sync_every > 1 (replicated), else None: per leaf f32[2, stacked tensors], the held
    # senders' and owners' scales (0: none yet); () int32 steps so far; per leaf f32[2], the
    # share of its elements clipped on the last step [replicas' values, reduced mean]
    scales: Any = None
    scale_step: jax.Array | None = None
    saturation: Any = None


class AllReduceTransformation(optax.GradientTransformation):
    """What :func:`allreduce` returns: optax's ``(init, update)`` pair, which also declares the
    static facts of its reduction, read through :func:`allreduce_spec` and
    :func:`allreduce_shards` by the stages that wrap it (GIFT's routing and error-feedback
    reframing, :func:`transport_only`).

    Attributes:
      spec: the :class:`~gift_jax.comm.collectives.AllReduceSpec` (axes, codec, bucket plan).
      shards: the :class:`LocalShards` it reduces on, or ``None`` (whole leaves).
      groups: the :class:`~gift_jax.comm.layer_groups.LayerGroups` it reduces by, or
        ``None`` (one bucket plan over the whole tree).
      scattered: the :class:`ScatteredLeaves` it reduce-scatters into shards, or ``None``.
    """

    spec: AllReduceSpec
    shards: LocalShards | None
    groups: LayerGroups | None
    scattered: ScatteredLeaves | None

    def __new__(cls, init, update, spec: AllReduceSpec, shards: LocalShards | None = None,
                groups: LayerGroups | None = None, scattered: ScatteredLeaves | None = None):
        self = super().__new__(cls, init, update)
        self.spec, self.shards, self.groups = spec, shards, groups
        self.scattered = scattered
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class ScatteredLeaves:
    """The leaves an all-reduce stage reduce-scatters over its data axis instead of reducing
    whole (FSDP on the data axis: :func:`gift_jax.data_parallel_grad` builds such a stage):
    their reduced values come back as this device's shard, the slice ``axis_index(axis)`` of
    dimension ``dims[path]``, every other leaf whole.

    Attributes:
      axis: the data axis the leaves are split over.
      dims: ``{leaf path: the dimension split over axis}``.
    """

    axis: str
    dims: Mapping[str, int]


@dataclasses.dataclass(frozen=True, eq=False)
class LocalShards:
    """The gradient leaves are sharded inside each data-parallel replica over further mesh
    axes (FSDP, tensor parallelism), which the caller leaves to GSPMD (``jax.shard_map`` manual
    over the data axes only).

    ``axes``: those mesh axes; ``specs(tree)``: the ``PartitionSpec`` (over ``axes``) of every
    leaf of a tree of arrays shaped like what the stage reduces. With them, :func:`allreduce`
    runs its reduction inside a nested ``shard_map`` manual over ``axes`` too, so every device
    quantizes and exchanges across the data axes *only its own shard* of each leaf: the bytes
    on the wire per device are the codec's ratio times the fp32 bytes of the local shard, and
    no gradient is gathered over ``axes`` first.
    """

    axes: tuple[str, ...]
    specs: Callable[[Any], Any]

    def residual_specs(self, residuals: Any, leaf_specs: Any = None) -> Any:
        """Specs over ``axes`` of error-feedback buffers ``(local, shard)`` (as
        :func:`~gift_jax.comm.collectives.init_residuals` makes them per device): each local
        buffer like its leaf (``leaf_specs``, default: from the buffers' own global shapes)
        behind its leading axis; the shard buffers one per device along their leading axis.

        Args:
          residuals: the buffers ``(local, shard)`` (arrays or their abstract shapes).
          leaf_specs: the ``PartitionSpec`` s of the leaves (:attr:`specs` of the reduced
            tree), or ``None``: :attr:`specs` of the local buffers' shapes without their
            leading axis.

        Returns:
          ``(local specs, shard specs)``: ``PartitionSpec(None, *leaf spec)`` per local buffer
          and ``PartitionSpec(axes)`` per shard buffer.
        """
        local, shard = residuals
        if leaf_specs is None:
            leaf_specs = self.specs(jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), local))
        local_specs = jax.tree.map(lambda s: PartitionSpec(None, *s), leaf_specs,
                                   is_leaf=lambda s: isinstance(s, PartitionSpec))
        return local_specs, tuple(PartitionSpec(self.axes) for _ in shard)



def allreduce(
    axis_name: AxisName | None,
    codec: str | Codec = "fp8_e4m3",
    *,
    block_size: int | None = None,
    mean: bool = True,
    policy: Any = None,
    stochastic_rounding: bool = False,
    error_feedback: bool = False,
    seed: int = 0,
    global_scale: bool = False,
    accumulate: str = "fp32",
    backend: str = "auto",
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    intra_axis: AxisName | None = None,
    intra_codec: str | Codec = "fp32",
    shards: LocalShards | None = None,
    stack_axes: Any = None,
    groups: LayerGroups | None = None,
    exchange: str = "auto",
    scale_sync_every: int = 1,
    pack: str = "bytes",
) -> AllReduceTransformation:
    """Quantized gradient all-reduce over ``axis_name`` (the custom psum) as an Optax stage.

    Args:
      axis_name: mesh axis (or tuple of axes) of data parallelism; ``None`` = single device
        (the stage is then the identity).
      codec: ``"fp32"`` (a plain ``psum``), ``"bf16"``, ``"fp8_e4m3"`` (float8_e4m3fn),
        ``"fp8_e5m2"``, ``"mxfp8"``, ``"nvfp4"`` or ``"int8"``; see :mod:`gift_jax.comm.codecs`.
      block_size: per-block fp32 scales of this many elements, for the codecs whose
        :attr:`~gift_jax.comm.codecs.Codec.supports_block_scaling` is true (``None`` = one
        scale per tensor; ``mxfp8`` and ``nvfp4`` accept only their own block size).
      mean: average over replicas (the data-parallel gradient) instead of summing.
      policy: per-leaf codec: a callable ``(path, leaf) → codec`` or a pytree of codecs
        matching the gradients (e.g. :func:`matrices_only`).
      stochastic_rounding: round stochastically (unbiased) instead of to nearest.
      error_feedback: keep each replica's quantization error (and each shard owner's
        re-quantization error) in state and add it to the next step's gradient.
      seed: seed of the stochastic-rounding key.
      global_scale: one ``pmax``-shared scale per tensor (only needed for ``accumulate="fp8"``).
      accumulate: ``"fp32"`` (default) or ``"fp8"`` (emulated FP8 ring accumulation).
      backend: ``"auto"`` (Pallas on GPU/TPU, XLA on CPU), ``"xla"`` or ``"pallas"``.
      bucket_elems: capacity of the flat buffers that small leaves are packed into.
      intra_axis, intra_codec: hierarchical all-reduce — reduce-scatter over ``intra_axis``
        in ``intra_codec`` first (e.g. full precision inside a node), then the quantized
        all-reduce across ``axis_name``, then an all-gather over ``intra_axis``.
      shards: the leaves are sharded over further (GSPMD) mesh axes inside each replica:
        reduce each device's local shard (see :class:`LocalShards`). Error-feedback buffers
        are then per device over the data axes *and* ``shards.axes``. The stochastic-rounding
        key is the same on every device of a replica (folded with the replica index only): a
        leaf replicated over ``shards.axes`` is then rounded alike on each of its copies, which
        stay bit-identical; the shards of a split leaf draw the same bits at the same offsets.
      stack_axes: a callable ``(path, leaf) → k``: the leaf's leading ``k`` axes stack
        separate tensors (the layers of a scanned model), and each tensor gets its own scales,
        as it would unstacked (``None``: one set of scales per leaf).
      groups: reduce group by group in the order the backward pass completes them
        (:class:`~gift_jax.comm.layer_groups.LayerGroups`, groups of about ``bucket_elems``
        elements in reverse layer order), each group on a bucket plan of its own: the
        grouping :mod:`gift_jax.comm.overlap` reduces inside the backward pass, bit for bit.
        ``None``: one bucket plan over the whole tree.
      exchange: how the quantized bytes cross ``axis_name``: ``"all_to_all"`` (one
        ``all_to_all`` and one ``all_gather`` per bucket), ``"permute"`` (``P − 1`` shifted
        ``ppermute`` s per phase: the same bytes, which the TPU compiler issues
        asynchronously and overlaps with compute), or ``"auto"`` (``ppermute`` s on the outer
        axis of a hierarchical reduction only). See
        :meth:`~gift_jax.comm.collectives.AllReduceSpec.permutes`.
      scale_sync_every: ``1`` (default): per-tensor scales fresh on every step. ``K > 1``:
        stale synced scales, as the artifact's per-layer scales synced every 50 steps: on
        steps 0, K, 2K, … every per-tensor scale (the senders' and the reduced mean's) is
        computed fresh and ``pmax``-shared by the replicas (what ``global_scale=True`` gives
        on every step), and reused until the next sync; values beyond ``fmax`` times it are
        clipped, and each leaf's share of clipped elements is kept in the state
        (``AllReduceState.saturation``, :func:`saturation_metrics`). Applies to the buckets
        of per-tensor codecs (fp8, int8 without ``block_size``); a flat reduction of whole
        leaves (no ``intra_axis``, ``shards`` or ``groups``).
      pack: how a bucket is packed: ``"bytes"`` (default): the buckets of per-tensor 8-bit
        codecs (fp8, int8 without ``block_size``) on a flat reduction are scaled and cast
        where each tensor lies and only their bytes are packed into the wire rows, and the
        gathered bytes are decoded where each tensor lies; ``"floats"``: every bucket is
        packed as float32 rows and encoded by the row kernels (the only way for the other
        codecs). The same values with round to nearest; ``"bytes"`` spares a relayout of
        the float gradient each way. See
        :meth:`~gift_jax.comm.collectives.AllReduceSpec.packs_bytes`.

    Returns:
      An ``optax.GradientTransformation`` with :class:`AllReduceState`.

    Raises:
      ValueError / TypeError: at build time for unknown settings; at trace time for an
        unbound axis name or non-float leaves.
    """
    spec = AllReduceSpec(
        axis_name, codec, block_size, mean, policy, bucket_elems, global_scale, accumulate,
        backend, intra_axis, intra_codec, stack_axes, exchange, pack,
    )
    if error_feedback and intra_axis is not None:
        raise ValueError("error_feedback=True is not supported with intra_axis (hierarchical)")
    if isinstance(scale_sync_every, bool) or not isinstance(scale_sync_every, int) or (
            scale_sync_every < 1):
        raise ValueError(f"scale_sync_every={scale_sync_every!r} must be an int >= 1 (steps "
                         "between syncs of the per-tensor scales; 1: fresh every step)")
    stale = scale_sync_every > 1
    if stale and (intra_axis is not None or shards is not None or groups is not None):
        raise ValueError(f"scale_sync_every={scale_sync_every} needs a flat reduction of whole "
                         "leaves after the backward pass: intra_axis, shards and groups None")
    if shards is not None and axis_name is None:
        raise ValueError("shards (sharded leaves) needs an axis_name")
    if not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} must be an int")

    def init_res(tree):
        if groups is None:
            return init_residuals(tree, spec)
        return init_group_residuals(tree, spec, groups)

    def init_fn(params):
        resolve_codecs(params, codec, block_size, policy)  # float leaves, policy structure
        key = jax.random.PRNGKey(seed) if stochastic_rounding else None
        residuals = None
        if error_feedback and axis_name is not None:
            if shards is None:
                residuals = init_res(params)
            else:
                specs = shards.specs(params)
                shapes = jax.eval_shape(lambda p: jax.shard_map(
                    init_res, in_specs=(specs,), out_specs=PartitionSpec(),
                    axis_names=set(shards.axes), check_vma=False)(p), params)
                residuals = jax.shard_map(
                    init_res, in_specs=(specs,),
                    out_specs=shards.residual_specs(shapes, specs),
                    axis_names=set(shards.axes), check_vma=False)(params)
        if not stale:
            return AllReduceState(key, residuals)
        scales, saturation = init_stale_scales(params, spec)
        return AllReduceState(key, residuals, scales, jnp.zeros((), jnp.int32), saturation)

    def reduce(updates, key, residuals):
        if groups is None:
            return all_reduce_tree(updates, spec, key=key, residuals=residuals)
        return all_reduce_groups(updates, spec, groups, key, residuals)

    def update_fn(updates, state, params=None):
        del params
        require_per_device(updates, spec.reduced_axes, "gift_jax.allreduce")
        key, sub = step_keys(state)
        if stale:
            due = state.scale_step % scale_sync_every == 0
            reduced, residuals, scales, saturation = all_reduce_tree_stale(
                updates, spec, state.scales, due, key=sub, residuals=state.residuals)
            return reduced, AllReduceState(key, residuals, scales, state.scale_step + 1,
                                           saturation)
        if shards is None:
            reduced, residuals = reduce(updates, sub, state.residuals)
        else:  # each device reduces its own shard (manual over shards.axes as well)
            specs = shards.specs(updates)
            res_specs = (None if state.residuals is None
                         else shards.residual_specs(state.residuals))
            reduced, residuals = jax.shard_map(
                reduce, in_specs=(specs, PartitionSpec(), res_specs),
                out_specs=(specs, res_specs), axis_names=set(shards.axes),
                check_vma=False)(updates, sub, state.residuals)
        return reduced, AllReduceState(key, residuals)

    return AllReduceTransformation(init_fn, update_fn, spec, shards, groups)


def step_keys(state: AllReduceState) -> tuple[jax.Array | None, jax.Array | None]:
    """``(next state's key, this step's key)`` of an :func:`allreduce` stage: the split its
    update makes (``(None, None)`` without stochastic rounding); reducing inside the backward
    (:mod:`gift_jax.comm.overlap`) makes the same one.

    Args:
      state: the stage's state before the step.

    Returns:
      The two keys, or ``(None, None)``.
    """
    if state.key is None:
        return None, None
    key, sub = jax.random.split(state.key)
    return key, sub


def reset_error_feedback(state: Any, changed: jax.Array | bool | None = None) -> Any:
    """Zero the error-feedback residuals of every :class:`AllReduceState` in ``state``
    (found anywhere: inside ``optax.chain``, GIFT's ``inner_state``, PLUMAGE's comm state).

    For when the residuals no longer mean what they did: PLUMAGE's projected coordinates
    after a projection change (adding the unsent part ``e`` of ``R₁ = D₁⁻¹P₁ᵀG`` to ``R₂`` would
    apply ``P₂D₂e`` instead of ``P₁D₁e``), or a one-off diagnostic reduction that must not see
    the training run's buffers.  ``changed``: ``None`` (always) or a replicated bool (a change
    decided under ``lax.cond``; the buffers are kept where it is False).  Held stale scales
    (``scale_sync_every > 1``) are zeroed with them: the next reduction syncs anew (a scale
    of the former coordinates means nothing either).

    Args:
      state: an optimizer state.
      changed: ``None`` or a replicated bool scalar.

    Returns:
      ``state`` with zero residuals and held scales (where ``changed``).
    """
    if changed is None:
        zero = jnp.zeros_like
    else:
        zero = lambda r: jnp.where(changed, jnp.zeros_like(r), r)

    def fix(node):
        if not isinstance(node, AllReduceState):
            return node
        if node.scales is not None:
            node = node._replace(scales=jax.tree.map(zero, node.scales))
        if node.residuals is None:
            return node
        return node._replace(residuals=jax.tree.map(zero, node.residuals))

    return jax.tree.map(fix, state, is_leaf=lambda x: isinstance(x, AllReduceState))


def reframe_error_feedback(state: Any, stage: optax.GradientTransformation, tree: Any,
                           change: Callable[[Any], Any], moved: Any) -> Any:
    """Carry the error-feedback residuals of every :class:`AllReduceState` in ``state`` across
    a change of frame of some leaves of ``tree`` (see
    :func:`~gift_jax.comm.collectives.reframe_residuals`).

    For stages that wrap an all-reduce ``stage`` and re-express what they send through it
    (GIFT's refresh changes ``W``): ``change`` maps a tree like ``tree`` from the old frame to
    the new one, ``moved`` marks (tree of bools) the leaves whose frame changed. The wrapping
    stage does not see the buffers' layout: each replica's own residual is mapped by
    ``change``; the shard owners' residual rows of moved leaves are zeroed, located through the
    bucket plan when ``stage`` is a bare, non-hierarchical :func:`allreduce` (every shard row
    is zeroed otherwise).

    Args:
      state: an optimizer state holding :class:`AllReduceState` s.
      stage: the wrapped all-reduce stage as built.
      tree: a tree like the stage's input (its structure and shapes).
      change: ``tree → tree``, the old frame to the new one.
      moved: a tree of bools like ``tree``.

    Returns:
      ``state`` with its residuals in the new frame.
    """
    spec = allreduce_spec(stage)
    if spec is not None and (spec.intra_axis is not None or allreduce_shards(stage)
                             or stage.groups is not None or allreduce_scattered(stage)):
        # hierarchical: no error feedback (see allreduce); sharded leaves: the bucket plan is
        # of each device's local shards, which `tree` does not show; grouped: one plan per
        # group, not the tree's; scattered leaves: the plan is of the leaves reduced whole;
        # every shard row is zeroed
        spec = None

    def fix(node):
        if not isinstance(node, AllReduceState):
            return node
        if node.scales is not None:  # a scale of the old frame means nothing: sync anew
            node = node._replace(scales=jax.tree.map(
                lambda s, m: jnp.zeros_like(s) if m else s, node.scales, moved))
        if node.residuals is None:
            return node
        return node._replace(residuals=reframe_residuals(node.residuals, tree, change, moved,
                                                         spec))

    return jax.tree.map(fix, state, is_leaf=lambda x: isinstance(x, AllReduceState))


def saturation_metrics(opt_state: Any) -> dict[str, float]:
    """Each leaf's saturation on the last step under stale synced scales
    (``allreduce(scale_sync_every > 1)``): ``comm/saturation/<leaf path>``, the share of the
    replicas' gradient elements beyond their stale scale (clipped), and
    ``comm/saturation_mean/<leaf path>``, the share of the reduced mean's; host side.

    Args:
      opt_state: an optimizer state holding :class:`AllReduceState` s (found anywhere).

    Returns:
      ``{metric: float}``; ``{}`` where no state holds saturation.
    """
    out: dict[str, float] = {}
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, AllReduceState)) if isinstance(n, AllReduceState) and n.saturation is not None]
    for node in nodes:
        flat = jax.tree_util.tree_flatten_with_path(node.saturation)[0]
        for path, rates in flat:
            rates = jax.device_get(rates)
            name = leaf_path(path)
            out[f"comm/saturation/{name}"] = float(rates[0])
            out[f"comm/saturation_mean/{name}"] = float(rates[1])
    return out


def allreduce_spec(stage: optax.GradientTransformation) -> AllReduceSpec | None:
    """The :class:`~gift_jax.comm.collectives.AllReduceSpec` of an :func:`allreduce` stage (its
    axes, codec and bucket plan, ``spec.plan(tree)``), or ``None`` for any other transformation.

    The protocol by which stages that wrap the all-reduce (GIFT) learn what it does: the stage
    is an :class:`AllReduceTransformation` that declares its static spec, and this accessor is
    the one place that reads it (what such a stage does with its error-feedback buffers goes
    through :func:`reframe_error_feedback`).

    Args:
      stage: any optax transformation.

    Returns:
      The stage's :class:`~gift_jax.comm.collectives.AllReduceSpec`, or ``None``.
    """
    return stage.spec if isinstance(stage, AllReduceTransformation) else None


def allreduce_scattered(stage: optax.GradientTransformation) -> ScatteredLeaves | None:
    """The :class:`ScatteredLeaves` an all-reduce stage reduce-scatters into shards, or
    ``None`` (every leaf is reduced whole; any other transformation).

    Args:
      stage: any optax transformation.

    Returns:
      The stage's :class:`ScatteredLeaves`, or ``None``.
    """
    if not isinstance(stage, AllReduceTransformation):
        return None
    return stage.scattered


def allreduce_shards(stage: optax.GradientTransformation) -> LocalShards | None:
    """The :class:`LocalShards` an :func:`allreduce` stage reduces on, or ``None``.

    Args:
      stage: any optax transformation.

    Returns:
      The stage's :class:`LocalShards`; ``None`` for an :func:`allreduce` of whole leaves and
      for any other transformation.
    """
    return stage.shards if isinstance(stage, AllReduceTransformation) else None


def transport_only(stage: optax.GradientTransformation, full_tree: Any,
                   *variants: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of ``variants`` (``{path: array}``, values for a subset of the leaves of
    ``full_tree``, the tree the :func:`allreduce` ``stage`` reduces) reduced by the stage's
    transport alone: its codecs (each leaf's, as the policy resolves it on ``full_tree``),
    scaling, accumulation and local shards, but no error feedback and rounding to nearest —
    what one exchange does to these values.  All variants go in one reduction per codec;
    where the leaves' scales depend on the bucket plan (:func:`scales_follow_the_packing`),
    each variant is reduced inside the whole tree, packed as a step packs it, so the values
    are exactly the step's.
    Used to measure transports (GIFT's routing) without touching the stage's state.  Inside
    the stage's ``shard_map``; the results are identical on every replica.

    Args:
      stage: the :func:`allreduce` stage as built.
      full_tree: the per-device tree the stage reduces (its paths, dtypes and shapes give each
        leaf's codec, stacked tensors and local-shard spec).
      *variants: ``{leaf path: array}`` (paths as :func:`~gift_jax.utils.tree_paths.leaf_path`
        names them), each array shaped like its leaf of ``full_tree``.

    Returns:
      One ``{leaf path: reduced array}`` per variant, with its keys, summed or averaged as the
      stage's ``mean`` says.

    Raises:
      ValueError: ``stage`` is not an :func:`allreduce` stage.
    """
    spec, shards = allreduce_spec(stage), allreduce_shards(stage)
    if spec is None:
        raise ValueError("transport_only needs a gift_jax.allreduce stage")
    if allreduce_scattered(stage) is not None:
        raise ValueError("transport_only: the stage reduce-scatters leaves split over "
                         f"{allreduce_scattered(stage).axis!r} (FSDP on the data axis); its "
                         "transport of the whole tree is not one all-reduce")
    if scales_follow_the_packing(stage, full_tree, [p for v in variants for p in v]):
        return [{p: _reduce_as_packed(spec, shards, _substituted(full_tree, v))[p] for p in v}
                for v in variants]
    flat = jax.tree_util.tree_flatten_with_path(full_tree)[0]
    paths = [leaf_path(p) for p, _ in flat]
    codecs = dict(zip(paths, resolve_codecs(full_tree, spec.codec, spec.block_size,
                                            spec.policy), strict=True))
    leaf_specs = None
    if shards is not None:
        leaf_specs = dict(zip(paths, jax.tree.leaves(
            shards.specs(full_tree), is_leaf=lambda x: isinstance(x, PartitionSpec)),
            strict=True))
    stack_axes = None  # each variant's leaf stacks the tensors its leaf in full_tree stacks
    if spec.stack_axes is not None:
        axes = {path: spec.stack_axes(p, x) for path, (p, x) in zip(paths, flat, strict=True)}
        stack_axes = lambda key, _: axes[leaf_path(key).split("/", 1)[1]]
    keyed = {(i, p): x for i, v in enumerate(variants) for p, x in v.items()}
    out: list[dict[str, Any]] = [{} for _ in variants]
    for codec in sorted({codecs[p] for _, p in keyed}, key=repr):  # one reduction per codec
        group = {f"{i}/{p}": x for (i, p), x in keyed.items() if codecs[p] == codec}
        one = dataclasses.replace(spec, codec=codec, block_size=None, policy=None,
                                  stack_axes=stack_axes)
        reduce = lambda t, one=one: all_reduce_tree(t, one)[0]
        if shards is None:
            reduced = reduce(group)
        else:
            specs = {k: leaf_specs[k.split("/", 1)[1]] for k in group}
            reduced = jax.shard_map(reduce, in_specs=(specs,), out_specs=specs,
                                    axis_names=set(shards.axes), check_vma=False)(group)
        for k, x in reduced.items():
            i, p = k.split("/", 1)
            out[int(i)][p] = x
    return out


def scales_follow_the_packing(stage: optax.GradientTransformation, tree: Any,
                              paths: list[str]) -> bool:
    """Whether the scales the all-reduce ``stage`` gives the leaves at ``paths`` depend on where
    its bucket plan puts them, so that a reduction packing only these leaves would not
    reproduce the step's values (:func:`transport_only` then reduces the whole tree).

    A per-tensor scale (:attr:`~gift_jax.comm.codecs.Codec.has_leaf_scale`: per-tensor FP8
    and INT8, NVFP4's fp32 tensor scale) is computed by the all-gather leg over each shard
    owner's rows of the leaf (leaf ∩ shard), and the owners' row ranges follow the leaf's
    offset in its bucket and the bucket's size, i.e. the other leaves of the tree. A scale
    shared by every replica (``global_scale``, the FP8 ring) covers the whole leaf and does
    not depend on it, unless the hierarchical reduction first splits the rows over the
    ``intra`` axis. Per-block scales are per row and never depend on it.

    Args:
      stage: the :func:`allreduce` stage as built.
      tree: the per-device tree it reduces.
      paths: the leaf paths asked about.

    Returns:
      True where a reduction of ``paths`` alone could give other values than the step's.
    """
    spec = allreduce_spec(stage)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    codecs = dict(zip((leaf_path(p) for p, _ in flat),
                      resolve_codecs(tree, spec.codec, spec.block_size, spec.policy),
                      strict=True))
    per_tensor = any(codecs[p].has_leaf_scale for p in paths)
    return per_tensor and (not spec.global_scale or spec.intra_axis is not None)


def _substituted(tree: Any, values: dict[str, Any]) -> Any:
    """``tree`` with the leaves at the paths of ``values`` replaced by them."""
    return jax.tree_util.tree_map_with_path(lambda p, x: values.get(leaf_path(p), x), tree)


def _reduce_as_packed(spec: AllReduceSpec, shards: LocalShards | None, tree: Any
                      ) -> dict[str, Any]:
    """``{leaf path: reduced leaf}`` of ``tree`` reduced exactly as a step packs it (the same
    bucket plan, so the same shard owners and scales), without error feedback and rounding to
    nearest. Inside the stage's ``shard_map``."""
    reduce = lambda t: all_reduce_tree(t, spec)[0]  # no key: nearest; no residuals: no EF
    if shards is not None:
        specs = shards.specs(tree)
        reduce = jax.shard_map(reduce, in_specs=(specs,), out_specs=specs,
                               axis_names=set(shards.axes), check_vma=False)
    flat = jax.tree_util.tree_flatten_with_path(reduce(tree))[0]
    return {leaf_path(p): x for p, x in flat}


def allreduce_axis(stage: optax.GradientTransformation) -> AxisName | None:
    """The axis (or tuple of axes, hierarchical included) an :func:`allreduce` stage reduces
    over, or ``None`` for any other transformation.

    Args:
      stage: any optax transformation.

    Returns:
      The axis name or tuple of axis names, or ``None``.
    """
    spec = allreduce_spec(stage)
    return None if spec is None else spec.reduced_axes


def matrices_only(codec: str = "fp8_e4m3", other: str = "fp32"):
    """A codec policy: leaves with 2+ dimensions in ``codec``, vectors and scalars (norm gains,
    biases) in ``other``.

    Args:
      codec: the codec of leaves with 2 or more dimensions.
      other: the codec of vectors and scalars.

    Returns:
      The policy ``(path, leaf) → codec name`` for :func:`allreduce`'s ``policy``.
    """

    def policy(path, leaf):
        del path
        return codec if len(leaf.shape) >= 2 else other

    return policy


def partition_specs(opt_state, axis_name: AxisName, shards: LocalShards | None = None):
    """``PartitionSpec`` tree for an optimizer state inside ``jax.shard_map``.

    Error-feedback buffers of every :class:`AllReduceState` (found anywhere in the state, e.g.
    inside ``optax.chain``) are per device and get ``P(axis_name)`` on their leading axis;
    everything else is replicated, ``P()``. With ``shards`` (the stage reduces sharded leaves,
    see :class:`LocalShards`) the buffers' specs over the whole mesh (for ``jax.jit``'s
    shardings) are returned: the data axes first, then ``shards``' layout.

    Args:
      opt_state: the optimizer state (or its abstract shapes).
      axis_name: the data axis of the per-device buffers.
      shards: the :class:`LocalShards` of a sharded reduction, or ``None``.

    Returns:
      A tree of ``PartitionSpec`` like ``opt_state``.
    """
    lead = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def residuals_specs(residuals):
        if shards is None or residuals is None:
            return jax.tree_util.tree_map(lambda _: PartitionSpec(axis_name), residuals)
        local, shard = shards.residual_specs(residuals)
        local = jax.tree_util.tree_map(lambda s: PartitionSpec(axis_name, *s[1:]), local,
                                       is_leaf=lambda s: isinstance(s, PartitionSpec))
        return local, tuple(PartitionSpec(lead + shards.axes) for _ in shard)

    def specs(node):
        if isinstance(node, AllReduceState):
            per_device = residuals_specs(node.residuals)
            replicated = jax.tree_util.tree_map(lambda _: PartitionSpec(), node)
            return replicated._replace(residuals=per_device)
        return jax.tree_util.tree_map(lambda _: PartitionSpec(), node)

    return jax.tree_util.tree_map(specs, opt_state,
                                  is_leaf=lambda n: isinstance(n, AllReduceState))


def init_on_mesh(tx: optax.GradientTransformation, params, mesh, axis_name: AxisName = "data"):
    """``tx.init(params)`` run inside ``jax.shard_map`` over ``mesh``, so that per-device
    buffers (error feedback) are created per device and sharded over ``axis_name``.

    ``params`` are replicated (``P()``). Returns the state, placed on the mesh.

    Args:
      tx: the optimizer chain (containing :func:`allreduce` stages).
      params: the replicated parameters.
      mesh: the device mesh.
      axis_name: the data axis the per-device buffers are split over.

    Returns:
      The optimizer state, placed on ``mesh``.
    """
    def run(p):
        return jax.shard_map(tx.init, mesh=mesh, in_specs=PartitionSpec(), out_specs=out_specs,
                             check_vma=False)(p)

    # the structure (not the global shapes) is all partition_specs needs
    probe = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=PartitionSpec(),
                                         out_specs=PartitionSpec(), check_vma=False), params)
    out_specs = partition_specs(probe, axis_name)
    return jax.jit(run)(params)
