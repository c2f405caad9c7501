"""Reduce a gradient tree in the groups the backward pass completes one after another.

The backward pass of a decoder finishes the output head first, then the blocks from the last
to the first, then the embedding. A reduction that waits for the whole gradient tree (one
bucket plan over every leaf) can only start when the backward ends; reduced group by group, in
that order, each group's collective can be issued while the backward of the layers below is
still running (Megatron-LM's bucketed data-parallel reduction, buckets in reverse layer
order). :class:`LayerGroups` is that partition, a static fact of the tree's paths and shapes:

* unrolled blocks (``layers/<i>/…``, an ``nnx.List``): whole layers, from the last to the
  first, merged into one group until the group holds ``bucket_elems`` elements or more (a
  Megatron bucket closes once it is full, so a group is at least one layer and at most one
  layer over the size);
* scanned blocks (``layers/…`` stacked over a leading layer axis, ``nnx.scan``): one group per
  layer, the layer's slice of every stacked leaf (a loop iteration cannot share a bucket with
  the next one); reduced inside the backward loop by :mod:`gift_jax.comm.overlap`;
* every other top-level module (embedding, final norm, output head): a group of its own;
* a tree of at most ``bucket_elems`` elements: one group (nothing to overlap).

Each group is packed and reduced exactly as :func:`~gift_jax.comm.collectives.all_reduce_tree`
reduces a tree of its own (its own bucket plan, so its per-tensor scales follow its own
packing); a layer slice of a stacked leaf is one tensor. Stochastic rounding draws group ``g``'s
bits from ``fold_in(key, g)`` (layer ``l`` of the scanned group: ``fold_in(fold_in(key,
G), l)``, ``G`` the number of other groups). Error-feedback buffers keep the layout of
:func:`~gift_jax.comm.collectives.init_residuals`: leaf-shaped local buffers, then the shard
buffers of every group's buckets in group order, a scanned group's stacked as ``(1, layers,
rows, row_size)``. The grouped reduction after the backward (:func:`all_reduce_groups`) and
the one inside it (:mod:`gift_jax.comm.overlap`) call the same per-group functions, so they
give the same bits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from gift_jax.comm.collectives import AllReduceSpec, all_reduce_tree, init_residuals
from gift_jax.utils.tree_paths import leaf_path


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """The groups of one tree, in the order the backward pass completes them.

    Attributes:
      loose: groups of whole leaves (indices into the flattened tree).
      stacked: the leaves stacked over layers (a scanned block stack), reduced layer by layer;
        empty when the blocks are unrolled or the tree is one group.
      num_layers: the stacked leaves' leading axis (0 when there are none).
    """

    loose: tuple[tuple[int, ...], ...]
    stacked: tuple[int, ...] = ()
    num_layers: int = 0

    @property
    def num_groups(self) -> int:
        """Reductions per step: the loose groups and one per stacked layer."""
        return len(self.loose) + self.num_layers


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """How a model's gradient tree splits into reverse-layer-order groups (module docstring).

    Attributes:
      stacked: the model scans its blocks (leaves under ``block_key/`` are stacked over a
        leading layer axis); else the blocks are unrolled, ``block_key/<i>/…``.
      block_key: the top-level key of the block stack (``layers`` in every family here).
    """

    stacked: bool = False
    block_key: str = "layers"

    def plan(self, tree: Any, bucket_elems: int) -> GroupPlan:
        """The groups of ``tree`` (arrays or their abstract shapes).

        Args:
          tree: the gradient tree.
          bucket_elems: the bucket size: unrolled layers merge into a group until it holds at
            least this many elements; a tree of at most this many is one group.

        Returns:
          The :class:`GroupPlan`.

        Raises:
          ValueError: ``bucket_elems`` is not positive; a stacked leaf without the common
            leading layer axis; an unrolled block key that is not a layer index.
        """
        if bucket_elems <= 0:
            raise ValueError(f"bucket_elems={bucket_elems} must be a positive int")
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        paths = [leaf_path(p).split("/") for p, _ in flat]
        sizes = [math.prod(jnp.shape(x)) for _, x in flat]
        if one_bucket(tree, bucket_elems):
            return GroupPlan((tuple(range(len(flat))),))
        blocks = [i for i, p in enumerate(paths) if p[0] == self.block_key and len(p) > 1]
        modules: dict[str, list[int]] = {}
        for i, p in enumerate(paths):
            if i not in blocks:
                modules.setdefault(p[0], []).append(i)
        rest = tuple(tuple(v) for v in modules.values())
        if self.stacked:
            lead = {jnp.shape(flat[i][1])[:1] for i in blocks}
            if len(lead) > 1 or lead == {()}:
                raise ValueError(f"the leaves under {self.block_key}/ must share a leading layer "
                                 f"axis (a scanned block stack); they lead with {sorted(lead)}")
            return GroupPlan(rest, tuple(blocks), lead.pop()[0] if blocks else 0)
        by_layer: dict[int, list[int]] = {}
        for i in blocks:
            if not paths[i][1].isdigit():
                raise ValueError(f"{'/'.join(paths[i])}: an unrolled block stack has paths "
                                 f"{self.block_key}/<layer index>/…")
            by_layer.setdefault(int(paths[i][1]), []).append(i)
        groups, current, held = [], [], 0
        for layer in sorted(by_layer, reverse=True):
            current += by_layer[layer]
            held += sum(sizes[i] for i in by_layer[layer])
            if held >= bucket_elems:
                groups.append(tuple(sorted(current)))
                current, held = [], 0
        if current:
            groups.append(tuple(sorted(current)))
        return GroupPlan(tuple(groups) + rest)


def one_bucket(tree: Any, bucket_elems: int) -> bool:
    """Whether ``bucket_elems`` holds the whole tree: it is then one group, reduced once the
    backward pass is done (nothing to overlap).

    Args:
      tree: the gradient tree (arrays or abstract shapes).
      bucket_elems: the bucket size.

    Returns:
      ``True`` when the tree has at most ``bucket_elems`` elements.
    """
    return sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(tree)) <= bucket_elems


def group_key(key: jax.Array | None, g: int) -> jax.Array | None:
    """The stochastic-rounding key of loose group ``g``.

    Args:
      key: the step's key, or ``None`` (no stochastic rounding).
      g: the group's index in :attr:`GroupPlan.loose`.

    Returns:
      ``fold_in(key, g)``, or ``None``.
    """
    return None if key is None else jax.random.fold_in(key, g)


def layer_keys(key: jax.Array | None, plan: GroupPlan) -> jax.Array | None:
    """The keys of the stacked group's layers.

    Args:
      key: the step's key, or ``None`` (no stochastic rounding).
      plan: the tree's :class:`GroupPlan`.

    Returns:
      ``fold_in(fold_in(key, len(plan.loose)), l)`` for every layer ``l``, stacked
      ``(layers, 2)``; ``None`` without a key or a stacked group.
    """
    if key is None or not plan.stacked:
        return None
    base = jax.random.fold_in(key, len(plan.loose))
    return jax.vmap(lambda l: jax.random.fold_in(base, l))(jnp.arange(plan.num_layers))


# ---- one group's reduction (shared by the reduction after the backward and the one inside it)


def reduce_group(leaves: list, spec: AllReduceSpec, key: jax.Array | None, residuals: Any
                 ) -> tuple[list, Any]:
    """All-reduce one loose group as a tree of its own.

    Args:
      leaves: the group's gradient leaves (per device, inside ``jax.shard_map``).
      spec: the reduction's settings.
      key: the group's stochastic-rounding key (:func:`group_key`), or ``None``.
      residuals: the group's error-feedback buffers ``(local leaves, shard buffers)``, or
        ``None``.

    Returns:
      ``(reduced leaves, new residuals)``.
    """
    return all_reduce_tree(list(leaves), spec, key, residuals)


def reduce_layer(leaves: list, spec: AllReduceSpec, key: jax.Array | None, residuals: Any
                 ) -> tuple[list, Any]:
    """All-reduce one layer's slices of the stacked leaves (each slice one tensor).

    Args:
      leaves: the layer's slices.
      spec: the reduction's settings (its ``stack_axes`` does not apply to a slice).
      key: the layer's key (a row of :func:`layer_keys`), or ``None``.
      residuals: the layer's buffers without their leading device axis, or ``None``.

    Returns:
      ``(reduced slices, new residuals without the device axis)``.
    """
    lead = None if residuals is None else jax.tree.map(lambda x: x[None], residuals)
    out, new = all_reduce_tree(list(leaves), _slice_spec(spec), key, lead)
    return out, None if new is None else jax.tree.map(lambda x: x[0], new)


def _slice_spec(spec: AllReduceSpec) -> AllReduceSpec:
    return dataclasses.replace(spec, stack_axes=None)


def _slices(leaves: list, plan: GroupPlan) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(jnp.shape(leaves[i])[1:], jnp.result_type(leaves[i]))
            for i in plan.stacked]


def split_residuals(residuals: Any, leaves: list, spec: AllReduceSpec, plan: GroupPlan,
                    devices_inside: bool = False) -> tuple[list, Any]:
    """Per group, its part of the error-feedback buffers (call where the axes are bound).

    Args:
      residuals: ``(local, shard)`` in the grouped layout (module docstring), or ``None``.
      leaves: the flattened gradient tree (as each device reduces it: its shapes count the
        groups' shard buffers).
      spec: the reduction's settings (the groups' bucket plans count their shard buffers).
      plan: the tree's :class:`GroupPlan`.
      devices_inside: the buffers are still stacked over the devices of further (model)
        axes, whose map is entered group by group: the stacked group's shard buffers keep
        that axis, behind the layer axis (``(layers, devices, rows, B)``).

    Returns:
      ``(per loose group (local leaves, shard buffers), the stacked group's (local slices
      stacked over layers, shard buffers stacked over layers))``, without the device axis for
      the stacked group (but see ``devices_inside``); ``None`` entries without error feedback.
    """
    if residuals is None:
        return [None] * len(plan.loose), None
    local, shard = residuals
    local = jax.tree_util.tree_leaves(local)
    loose, offset = [], 0
    for idx in plan.loose:
        n = len(spec.plan([leaves[i] for i in idx])[0])
        loose.append(([local[i] for i in idx], tuple(shard[offset:offset + n])))
        offset += n
    layers = None
    if plan.stacked:
        layers = ([local[i][0] for i in plan.stacked],
                  tuple(jnp.moveaxis(b, 1, 0) if devices_inside else b[0]
                        for b in shard[offset:]))
    return loose, layers


def join_residuals(residuals: Any, plan: GroupPlan, loose: list, layers: Any) -> Any:
    """The inverse of :func:`split_residuals`: new group buffers back in the grouped layout.

    Args:
      residuals: the old ``(local, shard)`` (for the local tree's structure), or ``None``.
      plan: the tree's :class:`GroupPlan`.
      loose: the loose groups' new ``(local leaves, shard buffers)``.
      layers: the stacked group's new ``(local slices, shard buffers)`` stacked over layers
        (no device axis), or ``None``.

    Returns:
      The new ``(local, shard)``, or ``None``.
    """
    if residuals is None:
        return None
    local_leaves, treedef = jax.tree_util.tree_flatten(residuals[0])
    shards = []
    for idx, (local, shard) in zip(plan.loose, loose, strict=True):
        for i, value in zip(idx, local, strict=True):
            local_leaves[i] = value
        shards += shard
    if layers is not None:
        for i, value in zip(plan.stacked, layers[0], strict=True):
            local_leaves[i] = value[None]
        shards += [b[None] for b in layers[1]]
    return jax.tree_util.tree_unflatten(treedef, local_leaves), tuple(shards)


def init_group_residuals(tree: Any, spec: AllReduceSpec, groups: LayerGroups) -> Any:
    """Zero error-feedback buffers in the grouped layout (call where the axes are bound).

    Args:
      tree: the gradient tree (arrays or abstract shapes).
      spec: the reduction's settings.
      groups: the partition.

    Returns:
      ``(local, shard)``: leaf-shaped local buffers with a leading device axis of 1, then every
      group's shard buffers in group order (the stacked group's ``(1, layers, rows, B)``).
    """
    leaves = jax.tree_util.tree_leaves(tree)
    plan = groups.plan(tree, spec.bucket_elems)
    local = init_residuals(tree, spec)[0]
    shards = []
    for idx in plan.loose:
        shards += init_residuals([leaves[i] for i in idx], spec)[1]
    if plan.stacked:
        for b in init_residuals(_slices(leaves, plan), _slice_spec(spec))[1]:
            shards.append(jnp.broadcast_to(b[:, None], (1, plan.num_layers, *b.shape[1:])))
    return local, tuple(shards)


def all_reduce_groups(tree: Any, spec: AllReduceSpec, groups: LayerGroups,
                      key: jax.Array | None = None, residuals: Any = None) -> tuple[Any, Any]:
    """The grouped all-reduce after the backward: each group reduced as a tree of its own,
    the scanned layers one by one (a ``lax.map`` over the layer axis).

    Args:
      tree: the per-device gradient tree (inside ``jax.shard_map``).
      spec: the reduction's settings (codec, axes, bucket size).
      groups: the partition.
      key: the step's stochastic-rounding key (identical on every replica), or ``None``.
      residuals: buffers from :func:`init_group_residuals`, or ``None``.

    Returns:
      ``(reduced tree, new residuals)``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    plan = groups.plan(tree, spec.bucket_elems)
    loose_res, layer_res = split_residuals(residuals, leaves, spec, plan)
    out, new_loose = list(leaves), []
    for g, idx in enumerate(plan.loose):
        red, res = reduce_group([leaves[i] for i in idx], spec, group_key(key, g), loose_res[g])
        for i, value in zip(idx, red, strict=True):
            out[i] = value
        new_loose.append(res)
    new_layers = None
    if plan.stacked:
        red, new_layers = jax.lax.map(
            lambda xs: reduce_layer(xs[0], spec, xs[1], xs[2]),
            ([leaves[i] for i in plan.stacked], layer_keys(key, plan), layer_res))
        for i, value in zip(plan.stacked, red, strict=True):
            out[i] = value
    return (jax.tree_util.tree_unflatten(treedef, out),
            join_residuals(residuals, plan, new_loose, new_layers))
