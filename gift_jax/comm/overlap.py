"""Reduce as gradients appear: a grouped all-reduce issued inside the backward pass.

:func:`gift_jax.allreduce` with ``groups`` (:class:`~gift_jax.comm.layer_groups.LayerGroups`)
reduces the gradient group by group, in the order the backward pass completes the groups.
:func:`loss_and_reduced_grads` runs that same reduction *inside* the backward pass: every
group's parameters pass through a ``jax.custom_vjp`` identity whose backward rule receives the
group's complete gradient (the cotangent of every use of its parameters) and returns it
reduced. The rule's other inputs are the group's error-feedback buffers, whose cotangents are
the updated buffers — the carried-state pattern of Flax's FP8 training, which returns its
updated scales as cotangents — and its stochastic-rounding key and accumulated gradient
(no cotangent). So ``jax.value_and_grad`` returns the reduced gradient and the stage's new
state, and the compiler may start a group's collective as soon as that group's gradient
exists, while the layers below are still in their backward:

* unrolled blocks and the other top-level modules: the hook wraps a group's leaves before the
  model is built;
* scanned blocks: the hook wraps each layer's slice inside the ``nnx.scan`` body
  (:func:`gift_jax.utils.block_hook.block_hook`), so each layer's reduction runs inside the
  backward loop's iteration that produced its gradient.

Gradient accumulation: the first microbatches' gradients are summed as usual; the last
microbatch's backward adds that sum to its cotangent and divides by the count — the operations
of the reduction after the backward, in the same order.

Both forms call the same per-group functions (:func:`~gift_jax.comm.layer_groups.reduce_group`,
:func:`~gift_jax.comm.layer_groups.reduce_layer`) on the same values, so the step is bit for
bit the step that reduces after the backward with the same stage (``tests/test_overlap.py``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import optax

from gift_jax.comm.layer_groups import (
    GroupPlan,
    group_key,
    layer_keys,
    one_bucket,
    reduce_group,
    reduce_layer,
    split_residuals,
)
from gift_jax.comm.stage import AllReduceState, AllReduceTransformation, step_keys
from gift_jax.utils.block_hook import block_hook
from gift_jax.utils.tree_paths import leaf_path


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduced_on_the_way_back(reduce: Callable, values: list, inputs: Any) -> list:
    """The identity on ``values``; its backward rule is ``reduce(cotangents, inputs) →
    (reduced cotangents, cotangents of inputs)``."""
    del reduce, inputs
    return values


def _fwd(reduce, values, inputs):
    del reduce
    return values, inputs


def _bwd(reduce, inputs, cotangents):
    return reduce(cotangents, inputs)


_reduced_on_the_way_back.defvjp(_fwd, _bwd)


def _total(cotangents: list, acc: list | None, accum_steps: int) -> list:
    """The step's mean gradient: the last microbatch's plus the sum of the earlier ones."""
    if acc is None:
        return list(cotangents)
    return [(a + c) / accum_steps for a, c in zip(acc, cotangents, strict=True)]


def _reducer(reduce: Callable, spec, accum_steps: int, cotangents, inputs):
    """A hook's backward rule: ``reduce`` (:func:`reduce_group` or :func:`reduce_layer`) of
    the step's mean gradient; the new buffers are the cotangent of the buffers' input."""
    key, acc, residuals = inputs
    out, new = reduce(_total(cotangents, acc, accum_steps), spec, key, residuals)
    return out, (None, None, new)


def _pick(leaves: list | None, idx: tuple[int, ...]) -> list | None:
    return None if leaves is None else [leaves[i] for i in idx]


def _layer_hook(spec, accum_steps: int, paths: list[str]) -> Callable[[Any, Any], Any]:
    """The :func:`~gift_jax.utils.block_hook.block_hook` function of the scanned group."""

    def hook(block_state, layer_inputs):
        flat, treedef = jax.tree_util.tree_flatten_with_path(block_state)
        got = [leaf_path(p) for p, _ in flat]
        if got != paths:
            raise ValueError(f"the scanned block's state has leaves {got}, the stacked "
                             f"gradient leaves {paths}: they must match in order")
        out = _reduced_on_the_way_back(functools.partial(_reducer, reduce_layer, spec, accum_steps),
                                       [x for _, x in flat], layer_inputs)
        return jax.tree_util.tree_unflatten(treedef, out)

    return hook


def loss_and_reduced_grads(loss_fn: Callable[[Any], jax.Array], params: Any,
                           stage: optax.GradientTransformation, state: AllReduceState, *,
                           acc: Any = None, accum_steps: int = 1
                           ) -> tuple[jax.Array, Any, AllReduceState]:
    """``jax.value_and_grad(loss_fn)(params)`` with the gradient reduced inside the backward.

    Call inside ``jax.shard_map`` (manual over the stage's axes), on per-device parameters.

    Args:
      loss_fn: ``params → scalar loss`` of this device's batch; a model with scanned blocks
        must apply them with :func:`gift_jax.models.common.apply_blocks` (every family here
        does).
      params: the parameters.
      stage: a grouped :func:`gift_jax.allreduce` (``groups`` set; no ``shards``).
      state: the stage's state before the step.
      acc: the sum of the earlier microbatches' gradients (like ``params``), or ``None``.
      accum_steps: microbatches in the step (the reduced gradient is their mean).

    Returns:
      ``(loss, reduced gradient, new stage state)``: what ``stage.update`` of the mean
      gradient would return, bit for bit.

    Raises:
      ValueError: ``stage`` is not a grouped all-reduce on whole leaves.
    """
    if not isinstance(stage, AllReduceTransformation) or stage.groups is None:
        raise ValueError("reducing in the backward needs gift_jax.allreduce(..., groups=...)")
    if stage.shards is not None:
        raise ValueError("reducing in the backward needs whole leaves per replica "
                         "(an allreduce stage without shards)")
    spec, groups = stage.spec, stage.groups
    plan: GroupPlan = groups.plan(params, spec.bucket_elems)
    key, sub = step_keys(state)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    prefix = len(groups.block_key) + 1
    layer_paths = [leaf_path(flat[i][0])[prefix:] for i in plan.stacked]

    def loss_of(p, residuals):
        leaves, treedef = jax.tree_util.tree_flatten(p)
        acc_leaves = None if acc is None else jax.tree_util.tree_leaves(acc)
        loose_res, layer_res = split_residuals(residuals, leaves, spec, plan)
        hooked = list(leaves)
        for g, idx in enumerate(plan.loose):
            inputs = (group_key(sub, g), _pick(acc_leaves, idx), loose_res[g])
            out = _reduced_on_the_way_back(
                functools.partial(_reducer, reduce_group, spec, accum_steps), _pick(leaves, idx),
                inputs)
            for i, value in zip(idx, out, strict=True):
                hooked[i] = value
        model_params = jax.tree_util.tree_unflatten(treedef, hooked)
        if not plan.stacked:
            return loss_fn(model_params)
        per_layer = (layer_keys(sub, plan), _pick(acc_leaves, plan.stacked), layer_res)
        with block_hook(_layer_hook(spec, accum_steps, layer_paths), per_layer):
            return loss_fn(model_params)

    loss, (grads, residuals) = jax.value_and_grad(loss_of, argnums=(0, 1))(
        params, state.residuals)
    return loss, grads, AllReduceState(key, residuals)


def reducible_in_backward(stage: optax.GradientTransformation
                          ) -> optax.GradientTransformationExtraArgs:
    """``stage`` as the first element of a chain whose caller may already have reduced the
    gradient inside the backward (:func:`loss_and_reduced_grads`).

    ``update(g, state, params, reduced_in_backward=new_state)`` passes ``g`` through and
    takes ``new_state`` as the stage's state; without that argument it is ``stage.update``. The
    rest of the chain (clipping, the optimizer, a non-finite guard) then runs on the reduced
    gradient exactly as after a reduction by ``stage.update``.

    Args:
      stage: the grouped all-reduce stage.

    Returns:
      The transformation (``init`` is ``stage.init``).
    """

    def update_fn(updates, state, params=None, *, reduced_in_backward=None, **extra_args):
        del extra_args
        if reduced_in_backward is None:
            return stage.update(updates, state, params)
        return updates, reduced_in_backward

    return optax.GradientTransformationExtraArgs(stage.init, update_fn)


def warn_if_one_bucket(params: Any, bucket_elems: int) -> bool:
    """Log one warning when ``bucket_elems`` holds the whole gradient: the grouped reduction is
    then one bucket, reduced once the backward pass is done (nothing to overlap).

    Args:
      params: the parameters (arrays or abstract shapes).
      bucket_elems: the bucket size (``comm.bucket_elems``).

    Returns:
      Whether it warned.
    """
    if not one_bucket(params, bucket_elems):
        return False
    logging.getLogger(__name__).warning(
        "comm.bucket_elems=%d holds the whole gradient (%d elements): one bucket, reduced "
        "after the backward pass (nothing overlaps); a smaller bucket overlaps", bucket_elems,
        sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
    return True
