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

A stage around the all-reduce that maps some leaves into another frame and back (GIFT:
whiten, reduce, unwhiten) reduces in the backward too: it declares the change of frame
(:class:`Frame`, through a ``frame_in_backward`` method, :class:`AroundAllReduce`), and each
hook maps its group's mean gradient into the frame, reduces it, and maps it back — the
stage's own per-leaf maps, on the same values. A frame may also keep the reduced gradient
(PLUMAGE: the projected coordinates ``D⁻¹PᵀG``, of another shape than the parameter): each
such leaf then has a zero input in the frame's shape, whose cotangent the hook sets to the
reduced value, and the returned gradient holds it in place of the leaf's.

Both forms call the same per-group functions (:func:`~gift_jax.comm.layer_groups.reduce_group`,
:func:`~gift_jax.comm.layer_groups.reduce_layer`) on the same values, so the step is bit for
bit the step that reduces after the backward with the same stage (``tests/test_overlap.py``;
with scanned blocks and the fp32 codec or GIFT's whitening, XLA:CPU may round the two graphs'
gradients an ulp apart).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec

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


@dataclasses.dataclass(frozen=True)
class Frame:
    """A change of frame of some leaves around their reduction, applied leaf by leaf inside
    each group's hook: the group's mean gradient mapped by ``enter``, reduced, mapped back by
    ``leave`` — what a stage around the all-reduce does after the backward (GIFT: ``W·G``,
    reduce, ``W⁻¹·``).

    Attributes:
      enter: ``(leaf index, gradient, data, one_layer) → gradient in the frame``;
        ``one_layer``: the gradient is one layer's slice of a stacked leaf, and ``data`` that
        layer's slice of the leaf's data. The all-reduce groups the leaves by their shapes in
        the frame (``enter`` of each whole leaf, traced with ``jax.eval_shape``).
      leave: ``(leaf index, reduced gradient, data, one_layer) → gradient``; ``None``: the
        reduced gradient stays in the frame (it is returned in place of the leaf's gradient,
        in the frame's shape).
      data: ``{leaf index: pytree of arrays}`` of the mapped leaves (indices into the
        flattened parameters); each array's leading axis lists the leaf's matrices, a stacked
        leaf's layers outermost (layer ``l``'s slice is ``x.reshape(layers, -1, ...)[l]``).
    """

    enter: Callable[[int, jax.Array, Any, bool], jax.Array]
    leave: Callable[[int, jax.Array, Any, bool], jax.Array] | None
    data: dict[int, Any]

    def shapes(self, leaves: list) -> list:
        """What the all-reduce sees of ``leaves``.

        Args:
          leaves: the flattened parameters (arrays or abstract shapes).

        Returns:
          Each mapped leaf's shape in the frame (a ``jax.ShapeDtypeStruct``, ``enter`` of
          the whole leaf traced with ``jax.eval_shape``), the other leaves as they are.
        """
        return [x if i not in self.data else jax.eval_shape(
            lambda v, d, i=i: self.enter(i, v, d, False), x, self.data[i])
            for i, x in enumerate(leaves)]


@dataclasses.dataclass(frozen=True)
class AroundAllReduce:
    """What a stage around a grouped all-reduce declares to reduce in the backward (its
    ``frame_in_backward(params, state)`` method; GIFT's stage has one).

    Attributes:
      stage: the grouped :func:`gift_jax.allreduce` it wraps.
      state: that stage's state in this step (an ``AllReduceState``).
      frame: the change of frame around it (``None``: none).
      finish: ``the all-reduce's new state → the wrapping stage's new state``.
    """

    stage: optax.GradientTransformation
    state: Any
    frame: Frame | None
    finish: Callable[[Any], Any]


def _mapped(fn: Callable | None, idx: tuple[int, ...], leaves: list, data: list | None,
            one_layer: bool) -> list:
    if fn is None:
        return list(leaves)
    return [x if d is None else fn(i, x, d, one_layer)
            for i, x, d in zip(idx, leaves, data, strict=True)]


def _reducer(reduce: Callable, spec, accum_steps: int, maps: tuple, idx: tuple[int, ...],
             one_layer: bool, dtypes: tuple, cotangents, inputs):
    """A hook's backward rule: ``reduce`` (:func:`reduce_group` or :func:`reduce_layer`) of
    the step's mean gradient, inside the frame ``maps = (enter, leave)`` (or ``(None,
    None)``); the new buffers are the cotangent of the buffers' input. The cotangents enter
    in the parameters' dtypes ``dtypes`` (a weight the loss casts to its compute dtype
    before the layer loop has its cotangent in that dtype; the cast back is exact). Leaves
    with a slot (an input in the reduced gradient's shape instead of ``None``) return their
    reduced gradient as the slot's cotangent, and zero as the leaf's: those whose reduced
    gradient stays in the frame (a zero input in the frame's shape), and those the hook
    sees in another dtype than the parameter's (the parameter itself)."""
    key, acc, residuals, data, slots = inputs
    enter, leave = maps
    total = _total([c.astype(d) for c, d in zip(cotangents, dtypes, strict=True)], acc,
                   accum_steps)
    out, new = reduce(_mapped(enter, idx, total, data, one_layer), spec, key, residuals)
    back = _mapped(leave, idx, out, data, one_layer)
    if slots is None:
        return back, (None, None, new, None, None)
    kept = [None if slot is None else b for b, slot in zip(back, slots, strict=True)]
    back = [b if slot is None else jax.numpy.zeros_like(c)
            for b, c, slot in zip(back, cotangents, slots, strict=True)]
    return back, (None, None, new, None, kept)


def _pick(leaves: list | None, idx: tuple[int, ...]) -> list | None:
    return None if leaves is None else [leaves[i] for i in idx]


def _frame_data(frame: Frame | None, idx: tuple[int, ...], num_layers: int = 0
                ) -> list | None:
    """The frame's data of the leaves ``idx`` (``None`` where a leaf is not mapped); with
    ``num_layers``, reshaped to lead with the layer axis (the scan slices it)."""
    if frame is None:
        return None
    split = lambda d: jax.tree.map(lambda x: x.reshape((num_layers, -1) + x.shape[1:]), d)
    return [None if i not in frame.data else split(frame.data[i]) if num_layers
            else frame.data[i] for i in idx]


def _slots(frame: Frame | None, seen: list) -> dict[int, jax.Array]:
    """Zero inputs in the frame's shape of the leaves whose reduced gradient stays there."""
    if frame is None or frame.leave is not None:
        return {}
    return {i: jax.numpy.zeros(seen[i].shape, seen[i].dtype) for i in frame.data}


def _on_shards(reduce: Callable, shards, specs: list, one_layer: bool) -> Callable:
    """``reduce`` (:func:`reduce_group` or :func:`reduce_layer`) run by every device on its
    own shard of each leaf (``specs``: the leaves' specs over ``shards.axes``), as the stage
    after the backward runs its whole grouped reduction. Error-feedback buffers enter in the
    layout :class:`~gift_jax.comm.stage.LocalShards` gives them (a layer's shard buffers
    ``(devices, rows, B)``, whose device axis is dropped inside and restored after)."""
    if shards is None:
        return reduce
    axes = set(shards.axes)

    def on_device(spec, leaves, key, residuals):
        if residuals is not None and one_layer:
            residuals = (residuals[0], tuple(b[0] for b in residuals[1]))
        out, new = reduce(leaves, spec, key, residuals)
        if new is not None and one_layer:
            new = (new[0], tuple(b[None] for b in new[1]))
        return out, new

    def on_shards(leaves, spec, key, residuals):
        res_specs = None if residuals is None else (
            [s if one_layer else PartitionSpec(None, *s) for s in specs],
            tuple(PartitionSpec(shards.axes) for _ in residuals[1]))
        return jax.shard_map(functools.partial(on_device, spec),
                             in_specs=(specs, PartitionSpec(), res_specs),
                             out_specs=(specs, res_specs), axis_names=axes,
                             check_vma=False)(leaves, key, residuals)

    return on_shards


def _local_shapes(tree: Any, shards) -> Any:
    """What each device holds of ``tree``'s leaves inside ``shards``' nested map (their
    shapes; ``tree`` itself without shards)."""
    if shards is None:
        return tree
    return jax.eval_shape(lambda t: jax.shard_map(
        lambda x: x, in_specs=(shards.specs(t),), out_specs=PartitionSpec(),
        axis_names=set(shards.axes), check_vma=False)(t), tree)


def _layer_hook(reduce: Callable, spec, accum_steps: int, paths: list[str], maps: tuple,
                idx: tuple[int, ...], dtypes: list) -> Callable[[Any, Any], Any]:
    """The :func:`~gift_jax.utils.block_hook.block_hook` function of the scanned group."""
    reducer = functools.partial(_reducer, reduce, spec, accum_steps, maps, idx, True,
                                tuple(dtypes))

    def hook(block_state, layer_inputs):
        flat, treedef = jax.tree_util.tree_flatten_with_path(block_state)
        got = [leaf_path(p) for p, _ in flat]
        if got != paths:
            raise ValueError(f"the scanned block's state has leaves {got}, the stacked "
                             f"gradient leaves {paths}: they must match in order")
        out = _reduced_on_the_way_back(reducer, [x for _, x in flat], layer_inputs)
        return jax.tree_util.tree_unflatten(treedef, out)

    return hook


def loss_and_reduced_grads(loss_fn: Callable[[Any], jax.Array], params: Any,
                           stage: optax.GradientTransformation, state: Any, *,
                           acc: Any = None, accum_steps: int = 1,
                           for_compute: Callable[[Any], Any] | None = None
                           ) -> tuple[jax.Array, Any, Any]:
    """``jax.value_and_grad(loss_fn)(params)`` with the gradient reduced inside the backward.

    Call inside ``jax.shard_map`` (manual over the stage's axes), on per-device parameters.

    Args:
      loss_fn: ``params → scalar loss`` of this device's batch; a model with scanned blocks
        must apply them with :func:`gift_jax.models.common.apply_blocks` (every family here
        does).
      params: the parameters.
      stage: a grouped :func:`gift_jax.allreduce` (``groups`` set; with ``shards``, each hook
        reduces every device's own shard), or a stage around one with a
        ``frame_in_backward`` method (:class:`AroundAllReduce`; GIFT's stage on its ordinary
        steps, PLUMAGE's projection around its all-reduce).
      state: the stage's state before the step.
      acc: the sum of the earlier microbatches' gradients (like ``params``), or ``None``.
      accum_steps: microbatches in the step (the reduced gradient is their mean).
      for_compute: ``params → params`` that ``loss_fn`` gets, applied after the hooks of
        the loose groups and before those of the scanned blocks (e.g.
        :meth:`gift_jax.training.step.ModelDef.for_compute`: weights cast to the compute
        dtype once, before the layer loop); a scanned leaf it recasts is reduced in its
        parameter's dtype, the leaf itself the slot its gradient comes back through;
        ``None``: the identity.

    Returns:
      ``(loss, reduced gradient, new stage state)``: what ``stage.update`` of the mean
      gradient would return, bit for bit; a leaf whose reduced gradient stays in the frame
      (``Frame.leave`` is ``None``) holds it in the frame's shape.

    Raises:
      ValueError: ``stage`` is not a grouped all-reduce, nor around one.
    """
    around = getattr(stage, "frame_in_backward", None)
    around = (AroundAllReduce(stage, state, None, lambda s: s) if around is None
              else around(params, state))
    stage, frame = around.stage, around.frame
    if not isinstance(stage, AllReduceTransformation) or stage.groups is None:
        raise ValueError("reducing in the backward needs gift_jax.allreduce(..., groups=...)")
    shards = stage.shards
    spec, groups = stage.spec, stage.groups
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    seen = [x for _, x in flat] if frame is None else frame.shapes([x for _, x in flat])
    seen_tree = jax.tree_util.tree_unflatten(treedef, seen)
    # planned on what each device reduces, as the stage after the backward plans it
    local_tree = _local_shapes(seen_tree, shards)
    warn_if_one_bucket(local_tree, spec.bucket_elems)
    plan: GroupPlan = groups.plan(local_tree, spec.bucket_elems)
    local = jax.tree_util.tree_leaves(local_tree)
    specs = None if shards is None else jax.tree_util.tree_leaves(
        shards.specs(seen_tree), is_leaf=lambda x: isinstance(x, PartitionSpec))
    group_reduce = lambda idx: _on_shards(
        reduce_group, shards, None if specs is None else [specs[i] for i in idx], False)
    layer_reduce = _on_shards(reduce_layer, shards, None if specs is None else
                              [PartitionSpec(*specs[i][1:]) for i in plan.stacked], True)
    key, sub = step_keys(around.state)
    prefix = len(groups.block_key) + 1
    layer_paths = [leaf_path(flat[i][0])[prefix:] for i in plan.stacked]
    maps = (None, None) if frame is None else (frame.enter, frame.leave)
    dtypes = [x.dtype for _, x in flat]
    computed = ([x for _, x in flat] if for_compute is None
                else jax.tree_util.tree_leaves(jax.eval_shape(for_compute, params)))
    # scanned leaves the loss recasts (bf16 weights cast once, before the layer loop): the
    # model runs on a copy without gradient, and the leaf itself rides into the loop as the
    # slot that receives its reduced gradient (no zeros to materialise)
    recast = [i for i in plan.stacked if computed[i].dtype != dtypes[i]]
    slots = _slots(frame, seen)

    def slots_of(held: dict, idx: tuple[int, ...]) -> list | None:
        return [held.get(i) for i in idx] if held else None

    def loss_of(p, residuals, held):
        leaves = jax.tree_util.tree_leaves(p)
        held = {**{i: leaves[i] for i in recast}, **held}
        leaves = [jax.lax.stop_gradient(x) if i in recast else x for i, x in enumerate(leaves)]
        acc_leaves = None if acc is None else jax.tree_util.tree_leaves(acc)
        loose_res, layer_res = split_residuals(residuals, local, spec, plan,
                                               devices_inside=shards is not None)
        hooked = list(leaves)
        for g, idx in enumerate(plan.loose):
            inputs = (group_key(sub, g), _pick(acc_leaves, idx), loose_res[g],
                      _frame_data(frame, idx), slots_of(held, idx))
            out = _reduced_on_the_way_back(
                functools.partial(_reducer, group_reduce(idx), spec, accum_steps, maps, idx,
                                  False, tuple(_pick(dtypes, idx))),
                _pick(leaves, idx), inputs)
            for i, value in zip(idx, out, strict=True):
                hooked[i] = value
        model_params = jax.tree_util.tree_unflatten(treedef, hooked)
        if for_compute is not None:
            model_params = for_compute(model_params)
        if not plan.stacked:
            return loss_fn(model_params)
        per_layer = (layer_keys(sub, plan), _pick(acc_leaves, plan.stacked), layer_res,
                     _frame_data(frame, plan.stacked, plan.num_layers),
                     slots_of(held, plan.stacked))
        with block_hook(_layer_hook(layer_reduce, spec, accum_steps, layer_paths, maps,
                                    plan.stacked, _pick(dtypes, plan.stacked)), per_layer):
            return loss_fn(model_params)

    loss, (grads, residuals, kept) = jax.value_and_grad(loss_of, argnums=(0, 1, 2))(
        params, around.state.residuals, slots)
    if kept:
        leaves = jax.tree_util.tree_leaves(grads)
        grads = jax.tree_util.tree_unflatten(
            treedef, [kept.get(i, x) for i, x in enumerate(leaves)])
    return loss, grads, around.finish(AllReduceState(key, residuals))


def reducible_in_backward(stage: optax.GradientTransformation
                          ) -> optax.GradientTransformationExtraArgs:
    """``stage`` as the first element of a chain whose caller may already have reduced the
    gradient inside the backward (:func:`loss_and_reduced_grads`).

    ``update(g, state, params, reduced_in_backward=new_state)`` passes ``g`` through and
    takes ``new_state`` as the stage's state; without that argument it is ``stage.update``
    (given the chain's extra arguments, e.g. GIFT's statistics on a refresh step). The
    rest of the chain (clipping, the optimizer, a non-finite guard) then runs on the reduced
    gradient exactly as after a reduction by ``stage.update``.

    Args:
      stage: the grouped all-reduce stage.

    Returns:
      The transformation (``init`` is ``stage.init``).
    """

    inner = optax.with_extra_args_support(stage)

    def update_fn(updates, state, params=None, *, reduced_in_backward=None, **extra_args):
        if reduced_in_backward is None:
            return inner.update(updates, state, params, **extra_args)
        return updates, reduced_in_backward

    return optax.GradientTransformationExtraArgs(stage.init, update_fn)


def warn_if_one_bucket(params: Any, bucket_elems: int) -> bool:
    """Log one warning when ``bucket_elems`` holds the whole gradient: the grouped reduction is
    then one bucket, reduced once the backward pass is done (nothing to overlap).
    :func:`loss_and_reduced_grads` calls it (once per trace) on what each device reduces.

    Args:
      params: the gradient tree as each device reduces it (arrays or abstract shapes).
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
