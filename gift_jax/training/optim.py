"""The optimizer chain of a run, built from its typed recipe (:mod:`.recipe`).

Which chain is built is the :class:`~gift_jax.training.method.CommPlan`'s decision
(``comm.codec`` + ``comm.method``); this module holds the pieces. Per-device gradients enter
the chain inside ``jax.shard_map``; the order is

    skip_nonfinite(                                 # the whole step is skipped on Inf/NaN
      chain(communication,                          # all-reduce in comm.codec; GIFT around it
            record_grad_norm(),                     # ‖reduced gradient‖ for the metrics
            clip_by_global_norm(c),                 # after the reduction: same on every replica
            optimizer))                             # AdamW, or Muon (matrices) + AdamW (rest)

PLUMAGE communicates *inside* the optimizer (it reduces the projected coordinates), so with
``comm.method='plumage'`` the chain is ``skip_nonfinite(plumage(communicate=chain(all-reduce,
record_grad_norm(), clip)))``: clipping acts on what was reduced — the projected coordinates
``R = D⁻¹PᵀG`` and the dense leaves on ordinary steps (‖PR‖ = ‖R‖ for orthonormal ``P``, so this
is the norm of the unbiased estimate ``Ĝ``) and the full gradient on refresh steps.
With ``plumage.gift=True`` ordinary steps use ``chain(gift(all-reduce, gift.layers),
record_grad_norm(), clip)`` — the coordinates ``R = MᵀG`` of ``gift.layers`` are whitened with
the factor of ``MᵀAM`` (GIFT reads ``k = plumage.rank`` from their shapes) — and refresh steps
reduce the full
gradient through the plain chain (``communicate_refresh``); each PLUMAGE refresh passes the
captured input statistics ``A`` so GIFT's factors follow the new projection ``M``.

Since the finiteness check looks at the chain's *output* (computed from reduced quantities,
identical on every replica), every replica takes the same decision; a skipped step leaves the
parameters and the whole optimizer state (moments, error-feedback buffers, keys) untouched.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gift_jax.lowrank.views import resolve_layouts
from gift_jax.training.optimizers import STACKED_AXES, get_optimizer
from gift_jax.utils.matrices import MatrixDimensionNumbers
from gift_jax.utils.tree_paths import flat_paths, leaf_path, path_mask, require_matches

log = logging.getLogger("gift_jax.training")



# ---- schedule -------------------------------------------------------------------------------


def learning_rate_schedule(opt: Any, num_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``opt.learning_rate`` over ``opt.warmup_steps`` (at most
    ``opt.warmup_fraction`` of ``num_steps``, at least 1 step, where that is set), then
    cosine/linear decay to ``opt.final_learning_rate`` at ``num_steps`` (or constant).

    Args:
      opt: the optimizer settings (:class:`~gift_jax.training.recipe.OptimizerOptions`, or
        a config's ``optimizer`` group: the fields are read by name).
      num_steps: the schedule's length.

    Returns:
      The schedule.
    """
    peak, final, warmup = opt.learning_rate, opt.final_learning_rate, opt.warmup_steps
    fraction = getattr(opt, "warmup_fraction", 0)  # caps the warmup at a share of the run
    if fraction:
        warmup = min(warmup, max(1, int(fraction * num_steps)))
    decay = max(num_steps - warmup, 1)
    if opt.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay, alpha=final / peak if peak else 0.0)
    elif opt.schedule == "linear":
        after = optax.linear_schedule(peak, final, decay)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


# ---- small stages ---------------------------------------------------------------------------


class GradNormState(NamedTuple):
    """State of :func:`record_grad_norm`."""

    norm: jax.Array  # () float32: global L2 norm of the last updates seen


def record_grad_norm() -> optax.GradientTransformation:
    """Identity stage that keeps the global norm of its input in state (for metrics)."""

    def init_fn(params):
        del params
        return GradNormState(jnp.zeros([], jnp.float32))

    def update_fn(updates, state, params=None):
        del state, params
        return updates, GradNormState(optax.tree.norm(updates).astype(jnp.float32))

    return optax.GradientTransformation(init_fn, update_fn)


class SkipState(NamedTuple):
    """State of :func:`skip_nonfinite`."""

    inner: Any  # state of the wrapped transformation (unchanged by skipped steps)
    skipped: jax.Array  # () int32: steps skipped so far
    last_skipped: jax.Array  # () bool: whether the most recent step was skipped


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner``; if any output update is not finite, returns zero updates and keeps the
    previous inner state (a skipped step, counted in :class:`SkipState`). Extra args are
    forwarded to ``inner``.

    Args:
      inner: the chain to guard.

    Returns:
      The guarded transformation, state :class:`SkipState`.
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipState(inner.init(params), jnp.zeros([], jnp.int32), jnp.zeros([], bool))

    def update_fn(updates, state, params=None, **extra_args):
        new_updates, new_inner = inner.update(updates, state.inner, params, **extra_args)
        finite = jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(new_updates)] or [jnp.bool_(True)]
        ))
        out = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        kept = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_inner, state.inner)
        skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        return out, SkipState(kept, skipped, jnp.logical_not(finite))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---- the chain ------------------------------------------------------------------------------


def stacked_kernels(path, leaf) -> int:
    """``stack_axes`` of a scanned model's gradients (and PLUMAGE's coordinates of them): the
    stacked kernels ``layers/… (layers, in, out)`` stack one matrix per layer, each quantized
    on its own scales as in the unrolled model; other leaves are one tensor.

    Args:
      path: the leaf's key path (``jax.tree_util`` keys).
      leaf: the array (anything with a shape).

    Returns:
      1 for a leaf under ``layers/`` with at least 3 dimensions (one leading stack axis), else 0.
    """
    return int(leaf_path(path).startswith("layers/") and len(jnp.shape(leaf)) >= 3)


def clip_stages(opt: Any) -> list[optax.GradientTransformation]:
    """``[clip_by_global_norm(opt.grad_clip_norm)]``, or ``[]`` when it is 0.

    Args:
      opt: the typed optimizer options, :class:`~gift_jax.training.recipe.OptimizerOptions`
        (only ``grad_clip_norm`` is read).

    Returns:
      The clipping stage in a list, or ``[]``.
    """
    c = opt.grad_clip_norm
    return [optax.clip_by_global_norm(c)] if c and c > 0 else []


def dense_optimizer(opt: Any, schedule: optax.Schedule,
                    scan_layers: bool) -> optax.GradientTransformation:
    """The update rule of ``opt.name`` (its :mod:`~gift_jax.training.optimizers` entry, built
    from the typed options ``opt`` and the schedule).

    Args:
      opt: the typed optimizer options (:class:`~gift_jax.training.recipe.OptimizerOptions`).
      schedule: the learning rate per step.
      scan_layers: kernels are stacked ``(layers, in, out)`` (Muon then orthogonalises each
        layer's matrix).

    Returns:
      The dense optimizer.

    Raises:
      ValueError: an unknown ``opt.name``.
    """
    return get_optimizer(opt.name).build(opt, schedule, scan_layers)


def lowrank_dimension_numbers(stacked_layers: bool):
    """PLUMAGE's ``weight_dimension_numbers``: the stacked kernels' axes when the model scans
    its layers (leaves of 3 dimensions), else ``None`` (the 2-D default).

    Args:
      stacked_layers: the model scans its blocks (kernels ``(layers, in, out)``).

    Returns:
      ``params → {leaf: MatrixDimensionNumbers(1, 2) for 3-D leaves, else None}``, or ``None``.
    """
    if not stacked_layers:
        return None
    return lambda params: jax.tree.map(
        lambda x: MatrixDimensionNumbers(*STACKED_AXES) if x.ndim == 3 else None, params)


def plumage_mask(layers: tuple[str, ...], rank: int, dimension_numbers=None):
    """PLUMAGE's mask callable (``plumage.layers``). A pattern that selects no parameter is an
    :class:`~gift_jax.utils.tree_paths.UnmatchedPatternError`; the first time it sees the
    params it warns when the mask and rank project no leaf (every selected matrix has its
    smaller side ``<= plumage.rank``): the run would silently be dense Adam with full-size
    communication.

    Args:
      layers: ``plumage.layers``, patterns of module or parameter paths.
      rank: ``plumage.rank`` (read by the warning only).
      dimension_numbers: PLUMAGE's ``weight_dimension_numbers`` (``None``: 2-D leaves), read
        by the warning only.

    Returns:
      ``params → bool tree`` of the leaves the patterns select (raising
      :class:`~gift_jax.utils.tree_paths.UnmatchedPatternError` when called on params that a
      pattern does not match).
    """
    warned = []

    def mask(params):
        require_matches(layers, flat_paths(params), "plumage.layers")
        tree = path_mask(params, layers)
        if not warned:
            warned.append(True)
            _warn_if_nothing_projected(params, tree, rank, layers, dimension_numbers)
        return tree

    return mask


def _warn_if_nothing_projected(params, mask_tree, rank: int, layers, dims) -> None:
    if jax.tree.leaves(resolve_layouts(params, rank, dims, mask_tree)):  # LeafLayouts only
        return
    sides = [(min(x.shape[-2:]), leaf_path(p)) for (p, x), sel in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(mask_tree), strict=True)
        if sel and len(x.shape) >= 2]
    if not sides:
        detail = f"plumage.layers={layers} select no 2-D parameter"
    else:
        side, path = min(sides)
        detail = (f"plumage.rank={rank} >= the smaller side of every selected matrix (smallest: "
                  f"{side}, {path})")
    log.warning(
        "comm.method='plumage' projects NO parameter: %s; every leaf stays dense, so this run is "
        "plain Adam with full-size gradient communication", detail)
