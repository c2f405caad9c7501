"""The quantized gradient reduction for GSPMD code: :func:`data_parallel_grad`.

Most JAX training at scale is written GSPMD style: one ``jax.jit`` with in/out shardings,
parameters laid out on a mesh, the gradient reduction left implicit. This module gives such a
step the quantized reduction without restructuring it: ``data_parallel_grad(loss_fn, mesh)``
returns a function, called inside the user's ``jax.jit``, that computes the gradient of
``loss_fn`` on each data-parallel replica's rows (a ``jax.shard_map`` manual over the data
axis only, ``check_vma=False``), reduces it over the data axis through the quantized
collective, and returns it in the parameters' own shardings::

    grad_fn = gift_jax.data_parallel_grad(loss_fn, mesh, comm="fp8_e4m3")

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads, _, _ = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

Parameters may be replicated, split over other mesh axes (FSDP or tensor parallelism on
``fsdp``/``tensor``: each device reduces only its own shard across ``data``,
:class:`~gift_jax.comm.stage.LocalShards`), or split over the data axis itself (FSDP on
``data``, ZeRO++ qgZ style): such a leaf is gathered for the forward pass and its gradient is
reduce-scattered in the codec straight into the parameter's shard, so the reduced gradient is
never held whole.

Flax linen trainers as they are:

* **Boxed parameters.** Parameters boxed in ``nn.Partitioned`` / ``nn.LogicallyPartitioned``
  (``nn.with_partitioning``, ``nn.with_logical_partitioning``) are taken as they are: the
  loss receives them boxed, the gradients come back boxed like them (as ``jax.grad`` gives
  them), and ``param_specs`` may be what flax returns for them (``nn.get_sharding(params,
  mesh)``, ``nn.logical_to_mesh_sharding(...)``, ``nn.get_partition_spec(params)``) or
  ``None``: the boxes' own partitioning, logical names resolved through the linen
  logical-axis rules in context (or the box's own ``rules``), as flax resolves them.
* **Sharding constraints inside the loss.** Inside the map the data axis is manual and the
  rows are already split over it, so every ``jax.lax.with_sharding_constraint`` the loss makes
  while it is traced (a layer's ``nn.with_logical_constraint``, a boxed parameter's unboxing,
  a raw constraint with a ``PartitionSpec`` or a ``NamedSharding`` of the mesh) is applied
  with the data axis dropped from its spec; constraints over the other (``Auto``) axes keep
  working. A constraint gift_jax cannot see (``with_sharding_constraint`` imported by name
  before the call) that names the data axis is one ``ValueError`` saying so.
* **Token-weighted losses.** By default the reduced loss and gradient are the *mean of the
  per-replica means* (each replica's ``loss_fn`` averages over its own rows). That is the
  global mean only when every replica averages the same number of terms: a loss divided by
  the batch's real (unpadded) tokens is biased when padding differs between replicas. Pass
  ``loss_weight=lambda batch: number of real tokens`` and the loss and gradient are the
  global token mean, ``Σ_r w_r·loss_r / Σ_r w_r`` (= the sum of all replicas' per-token
  losses over all their tokens), and ``aux_reduce="weighted"`` averages a metric the same way.
* **State where the trainer keeps it.** The communication state (:meth:`DataParallelGrad.init`:
  error feedback, GIFT's factors) is a pytree of global arrays: keep it in the trainer's own
  train state, e.g. a field of a flax ``TrainState`` subclass, and the trainer's orbax
  checkpoints save and restore it with everything else::

      class TrainState(flax.training.train_state.TrainState):
          comm_state: Any = None

      state = TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                comm_state=grad_fn.init(params))
      loss, grads, comm_state, aux = grad_fn(state.params, batch, state.comm_state)
      state = state.apply_gradients(grads=grads, comm_state=comm_state)

* **GIFT's refresh statistics beside any aux.** Give ``refresh_loss`` (the loss returning
  ``(what loss_fn returns, statistics)``, e.g. the linen capture
  :func:`gift_jax.whitening.capture_linen.with_input_stats` of the same loss) and call
  ``grad_fn(params, batch, comm_state, refresh=True)`` on refresh steps (a static choice, one
  compiled variant each): the statistics go to the stage as ``gift_stats=``, the aux and its
  ``aux_reduce`` stay the loss's own.

Metrics returned as ``aux`` are reduced as the caller names them (``aux_reduce``): a sum stays
a sum (a token count is not averaged into 1/P of itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from gift_jax.comm.codecs import Codec, get_codec
from gift_jax.comm.collectives import (
    Collective,
    quantized_psum,
    reduce_scatter_along,
    resolve_codecs,
)
from gift_jax.comm.stage import (
    AllReduceState,
    AllReduceTransformation,
    LocalShards,
    ScatteredLeaves,
    allreduce,
    partition_specs,
    step_keys,
)
from gift_jax.utils.axes import as_varying
from gift_jax.utils.tree_paths import leaf_path

_REDUCTIONS = {
    "sum": jax.lax.psum,
    "mean": jax.lax.pmean,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
}
#: ``aux_reduce`` values: the collectives above, and ``"weighted"`` (with ``loss_weight``).
_AUX_REDUCTIONS = (*_REDUCTIONS, "weighted")
#: Folded into a step's rounding key for the leaves reduce-scattered by the stage (they draw
#: bits apart from the whole leaves' buckets).
_SCATTER_SALT = 0x5CA77E


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _check_mesh(mesh: jax.sharding.Mesh, data_axis: str) -> int:
    if not isinstance(data_axis, str):
        raise TypeError(f"data_axis={data_axis!r} must be one mesh axis name (a str)")
    if data_axis not in mesh.axis_names:
        raise ValueError(f"data_parallel_grad: the mesh has no axis {data_axis!r} "
                         f"(its axes: {tuple(mesh.axis_names)})")
    size = int(mesh.shape[data_axis])
    if size == 1:
        raise ValueError(f"data_parallel_grad: mesh axis {data_axis!r} has size 1: there is "
                         "nothing to reduce; call jax.value_and_grad(loss_fn) directly")
    return size


# ---- flax's boxes ------------------------------------------------------------------------


@functools.cache
def _flax_meta():
    try:
        from flax.core import meta
    except ImportError:  # pragma: no cover - flax is a dependency
        return None
    return meta


def _is_box(x: Any) -> bool:
    meta = _flax_meta()
    return meta is not None and isinstance(x, meta.AxisMetadata)


def _box_value(x: Any) -> Any:
    """The value inside a flax box (boxes inside boxes too), with no sharding constraint."""
    while _is_box(x):
        try:
            x = x.unbox(apply_constraint=False)
        except TypeError:  # an AxisMetadata without the argument
            x = x.unbox()
    return x


def _unboxed(params: Any) -> tuple[Any, Callable[[list], Any]]:
    """``params`` without flax boxes, and ``leaves → tree boxed like params`` (the boxes are
    pytree nodes with one child each: the leaves of both trees are in the same order)."""
    boxed_def = jax.tree.structure(params)
    plain = jax.tree.map(_box_value, params, is_leaf=_is_box)
    return plain, boxed_def.unflatten


def _is_logical(box: Any) -> bool:
    try:
        from flax.linen import spmd
    except ImportError:  # pragma: no cover
        return False
    return isinstance(box, spmd.LogicallyPartitioned)


def _logical_spec(box: Any, name: str) -> PartitionSpec:
    """A ``LogicallyPartitioned`` box's names resolved to mesh axes as flax resolves them:
    through the box's own rules, else the linen logical-axis rules in context."""
    from flax.linen import spmd

    rules = box.rules or spmd.get_logical_axis_rules()
    if not rules:
        raise ValueError(
            f"data_parallel_grad: {name!r} is an nn.LogicallyPartitioned {tuple(box.names)} "
            "and no logical-axis rules are in context: call grad_fn (and init) under "
            "nn.logical_axis_rules(rules), or pass param_specs=nn.logical_to_mesh_sharding("
            "nn.get_partition_spec(params), mesh, rules)")
    return spmd.logical_to_mesh_axes(box.names, rules)


def _box_spec(box: Any, name: str) -> PartitionSpec:
    if _is_logical(box):
        return _logical_spec(box, name)
    if hasattr(box, "get_partition_spec"):
        return box.get_partition_spec()
    return PartitionSpec()


# ---- the layout ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Each parameter leaf's place on the mesh, split into what the shard_map sees (the data
    axis) and what GSPMD keeps (the other axes)."""

    specs: list  # full PartitionSpec per leaf
    data_dim: list  # the dimension split over the data axis, or None
    model_specs: list  # the spec with the data axis removed (what LocalShards reduces on)
    model_axes: tuple[str, ...]  # mesh axes other than data that split some leaf
    paths: list  # every leaf's path (boxes dropped)


def _given_specs(boxed: Any, param_specs: Any) -> list:
    """One spec (or ``None``, or a sharding) per leaf, and its box or ``None``: the specs
    given as a tree like the parameters with each box (or leaf) replaced by its spec, as
    flax's ``nn.get_sharding`` / ``nn.get_partition_spec`` return them."""
    tops, top_def = jax.tree.flatten(boxed, is_leaf=_is_box)
    if param_specs is None:
        given = [None] * len(tops)
    else:
        if callable(param_specs) and not _is_spec(param_specs):
            param_specs = param_specs(boxed)
        try:
            given = top_def.flatten_up_to(param_specs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"data_parallel_grad: param_specs do not match the parameters' "
                             f"structure ({e})".splitlines()[0]) from None
    out = []
    for top, spec in zip(tops, given, strict=True):
        box = top if _is_box(top) else None
        spec = _box_value(spec) if _is_box(spec) else spec
        out += [(spec, box, param_specs is None)] * len(jax.tree.leaves(top))
    return out


def _leaf_spec(spec: Any, box: Any, default: bool, name: str) -> PartitionSpec:
    if default:
        return PartitionSpec() if box is None else _box_spec(box, name)
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    if spec is None:
        return PartitionSpec()
    if box is not None and _is_logical(box) and _is_spec(spec) and (
            tuple(spec) == tuple(box.names)):
        return _logical_spec(box, name)  # nn.get_partition_spec of a logical box
    return spec


def _layout(boxed: Any, param_specs: Any, mesh, data_axis: str, size: int) -> _Layout:
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(_box_value, boxed,
                                                             is_leaf=_is_box))[0]
    given = _given_specs(boxed, param_specs)
    specs, data_dim, model_specs, model_axes, paths = [], [], [], [], []
    for (path, x), (spec, box, default) in zip(flat, given, strict=True):
        name = leaf_path(path)
        spec = _leaf_spec(spec, box, default, name)
        if not _is_spec(spec):
            raise TypeError(f"data_parallel_grad: the spec of {name!r} is {spec!r}, not a "
                            "PartitionSpec")
        if len(spec) > len(x.shape):
            raise ValueError(f"data_parallel_grad: {name!r} {tuple(x.shape)} has a spec of "
                             f"{len(spec)} dimensions, {spec}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"data_parallel_grad: {name!r} is {x.dtype}, not a float array: "
                            "only float parameters have gradients to reduce")
        for a in (a for e in spec for a in _spec_axes(e)):
            if a not in mesh.axis_names:
                raise ValueError(
                    f"data_parallel_grad: the spec of {name!r}, {spec}, names axis {a!r}, "
                    f"which the mesh does not have (its axes: {tuple(mesh.axis_names)}); "
                    "logical axis names are resolved for nn.LogicallyPartitioned parameters "
                    "under nn.logical_axis_rules, or by nn.logical_to_mesh_sharding(specs, "
                    "mesh, rules)")
        dims = [d for d, e in enumerate(spec) if data_axis in _spec_axes(e)]
        dim = dims[0] if dims else None
        if dim is not None and _spec_axes(spec[dim]) != (data_axis,):
            raise ValueError(
                f"data_parallel_grad: {name!r} splits dimension {dim} over {spec[dim]!r}: the "
                f"reduce-scatter over {data_axis!r} writes whole slices of one dimension, so "
                f"{data_axis!r} must be that dimension's only axis (put the other axes on "
                "another dimension)")
        if dim is not None and x.shape[dim] % size:
            raise ValueError(
                f"data_parallel_grad: {name!r} {tuple(x.shape)} splits dimension {dim} "
                f"({x.shape[dim]}) over {data_axis!r} ({size}), which does not divide it: "
                "the codec's reduce-scatter cannot split it into equal shards")
        rest = PartitionSpec(*(None if d == dim else e for d, e in enumerate(spec)))
        specs.append(spec)
        data_dim.append(dim)
        model_specs.append(rest)
        paths.append(name)
        model_axes += [a for e in rest for a in _spec_axes(e) if a not in model_axes]
    return _Layout(specs, data_dim, model_specs, tuple(model_axes), paths)


# ---- sharding constraints inside the map -----------------------------------------------


_PATCH_LOCK = threading.Lock()
_PATCH: dict[str, Any] = {"depth": 0, "original": None}
_ACTIVE = threading.local()  # .axes: the data axes of the maps this thread is tracing


def _without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    def drop(entry):
        axes = _spec_axes(entry)
        if axis not in axes:
            return entry
        kept = tuple(a for a in axes if a != axis)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    return PartitionSpec(*(drop(e) for e in spec))


def _sharding_without(s: Any, axis: str) -> Any:
    if _is_spec(s) and any(axis in _spec_axes(e) for e in s):
        return _without_axis(s, axis)
    if isinstance(s, NamedSharding) and any(axis in _spec_axes(e) for e in s.spec):
        return NamedSharding(s.mesh, _without_axis(s.spec, axis), memory_kind=s.memory_kind)
    return s


def _constraint_inside_the_map(x: Any, shardings: Any) -> Any:
    """``jax.lax.with_sharding_constraint`` while :func:`data_parallel_grad` traces the loss
    in this thread: the data axis (manual there; the rows are already split over it) is
    dropped from every spec; the other axes are constrained as asked."""
    original = _PATCH["original"]
    axes = getattr(_ACTIVE, "axes", None)
    if axes:
        shardings = jax.tree.map(
            lambda s: _sharding_without(s, axes[-1]), shardings,
            is_leaf=lambda s: s is None or _is_spec(s) or isinstance(s, jax.sharding.Sharding))
    return original(x, shardings)


@contextlib.contextmanager
def _data_axis_manual(axis: str):
    """While the loss is traced inside the map: constraints drop ``axis`` (see
    :func:`_constraint_inside_the_map`), and a constraint that still names it (one gift_jax
    could not see) is one line naming gift_jax and the fix."""
    with _PATCH_LOCK:
        if _PATCH["depth"] == 0:
            _PATCH["original"] = jax.lax.with_sharding_constraint
            jax.lax.with_sharding_constraint = _constraint_inside_the_map
        _PATCH["depth"] += 1
    stack = _ACTIVE.__dict__.setdefault("axes", [])
    stack.append(axis)
    try:
        yield
    except ValueError as e:
        msg = str(e)
        manual = "Auto axes" in msg or "manual axes" in msg  # jax 0.10 … 0.12's wording
        if "with_sharding_constraint" not in msg or not manual:
            raise
        raise ValueError(
            f"data_parallel_grad: loss_fn constrains a sharding over {axis!r}, the data axis, "
            f"which is manual inside the map (its rows are already split over it), in a "
            "with_sharding_constraint gift_jax cannot rewrite (imported by name, `from jax.lax "
            "import with_sharding_constraint`): call it as jax.lax.with_sharding_constraint, or "
            f"leave {axis!r} out of that constraint (jax: {msg.splitlines()[0][:160]})"
        ) from None
    finally:
        stack.pop()
        with _PATCH_LOCK:
            _PATCH["depth"] -= 1
            if _PATCH["depth"] == 0:
                jax.lax.with_sharding_constraint = _PATCH["original"]


# ---- metrics -------------------------------------------------------------------------------


def _check_aux_reduce(aux_reduce: Any, weighted: bool) -> None:
    for how in jax.tree.leaves(aux_reduce):
        if how not in _AUX_REDUCTIONS:
            raise ValueError(f"data_parallel_grad: aux_reduce {how!r} is not one of "
                             f"{_AUX_REDUCTIONS}")
        if how == "weighted" and not weighted:
            raise ValueError("data_parallel_grad: aux_reduce 'weighted' weighs each replica's "
                             "metric by its loss_weight: pass loss_weight= (e.g. the number "
                             "of real tokens of the rows)")


def _reduce_aux(aux: Any, aux_reduce: Any, axis: str, weight: Any = None) -> Any:
    """``aux`` reduced over ``axis`` as ``aux_reduce`` names it; ``weight``: this replica's
    and the total loss weight, for ``"weighted"``."""
    if aux_reduce is None:
        raise ValueError(
            "data_parallel_grad: has_aux=True needs aux_reduce= naming how each metric is "
            "reduced over the replicas: 'sum' (token counts), 'mean', 'max' or 'min', one "
            "string for all or a dict like the aux")

    def one(how, sub):
        if how not in _AUX_REDUCTIONS:
            raise ValueError(f"data_parallel_grad: aux_reduce {how!r} is not one of "
                             f"{_AUX_REDUCTIONS}")
        if how == "weighted":
            w, total = weight
            return jax.tree.map(lambda x: jax.lax.psum(
                jnp.where(w > 0, x * w, 0.0), axis) / total, sub)
        return jax.tree.map(lambda x: _REDUCTIONS[how](x, axis), sub)

    try:
        return jax.tree.map(one, aux_reduce, aux, is_leaf=lambda x: isinstance(x, str))
    except ValueError as e:
        if "aux_reduce" in str(e):
            raise
        raise ValueError(f"data_parallel_grad: aux_reduce does not match the aux's structure "
                         f"(a string, or a prefix of the aux tree): {str(e).splitlines()[0]}"
                         ) from None


def _combine_micro(aux, aux_reduce, weights=None):
    """Metrics stacked over microbatches, combined on the replica as ``aux_reduce`` says
    (``"weighted"``: by the microbatches' ``weights``)."""
    local = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}

    def weighted(x, axis=0):
        w = weights.reshape((-1,) + (1,) * (x.ndim - 1))
        total = jnp.sum(weights)
        return jnp.where(total > 0, jnp.sum(x * w, axis) / jnp.where(total > 0, total, 1), 0.0)

    local["weighted"] = weighted

    def one(how, sub):
        return jax.tree.map(lambda x: local[how](x, axis=0), sub)

    return jax.tree.map(one, aux_reduce, aux, is_leaf=lambda x: isinstance(x, str))


# ---- the reduce-scatter of leaves split over the data axis ------------------------------


def _gather(x: jax.Array, dim: int, axis: str, scatter: Callable) -> jax.Array:
    """All-gather ``x`` over the data axis along ``dim`` (fp32, the forward's weights); its
    VJP is ``scatter``, the codec's reduce-scatter of the gradient into the shard."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    def fwd(x):
        return gather(x), None

    def bwd(_, g):
        return (scatter(g)[0],)

    gather.defvjp(fwd, bwd)
    return gather(x)


def _path_specs(layout: _Layout, params: Any) -> Callable[[Any], Any]:
    """``LocalShards.specs`` of trees like the parameters, or parts of them (``None`` in the
    place of the leaves left out): each leaf's spec over the model axes, by its key path."""
    keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    by_key = dict(zip(keys, layout.model_specs, strict=True))

    def specs(tree):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: by_key[jax.tree_util.keystr(p)], tree)

    return specs


def _scattering_allreduce(axis: str, codec: Any, *, mean: bool, backend: str,
                          options: dict, layout: _Layout, params: Any,
                          collectives: dict[int, Collective], in_backward: frozenset
                          ) -> AllReduceTransformation:
    """The all-reduce stage of a tree in which some leaves are split over the data axis
    (FSDP on ``axis``) and a stage (``wrap=``, error feedback, stochastic rounding) reduces
    it: the leaves not split over ``axis`` go through :func:`~gift_jax.allreduce` (each
    device's shard over the model axes), each leaf split over it is reduce-scattered in its
    codec into this device's shard (with the stage's error feedback: each replica's own
    quantization error of the whole leaf, leaf-shaped; with stochastic rounding: bits of
    their own), and the leaves of ``in_backward`` come already reduced (inside the backward
    pass) and pass through. The stage declares the scattered leaves
    (:class:`~gift_jax.comm.stage.ScatteredLeaves`), so that GIFT unwhitens their shards.
    Its state is an :class:`~gift_jax.comm.stage.AllReduceState` whose local residuals are a
    tree like the parameters (every leaf: the wrapping stage re-expresses them whole)."""
    dims = {i: d for i, d in enumerate(layout.data_dim) if d is not None}
    shards = (LocalShards(layout.model_axes, _path_specs(layout, params))
              if layout.model_axes else None)
    inner = allreduce(axis, codec, mean=mean, backend=backend, shards=shards, **options)
    n = len(layout.data_dim)
    has_whole = len(dims) < n
    shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(params)]

    def part(leaves, treedef):  # the leaves reduced whole, None in place of the others
        return treedef.unflatten([None if i in dims else x for i, x in enumerate(leaves)])

    def laid_out(i, residual):  # a replica's buffer split over the model axes like its leaf
        if not layout.model_axes:
            return residual
        return jax.lax.with_sharding_constraint(
            residual, PartitionSpec(None, *layout.model_specs[i]))

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        state = inner.init(part(leaves, treedef))
        if state.residuals is None:
            return state
        local, shard = state.residuals
        local = treedef.flatten_up_to(local)
        local = [laid_out(i, as_varying(jnp.zeros((1, *jnp.shape(leaves[i])), jnp.float32),
                                        axis)) if i in dims else local[i] for i in range(n)]
        return AllReduceState(state.key, (treedef.unflatten(local), shard))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree.flatten(updates)
        ef = state.residuals is not None
        local = treedef.flatten_up_to(state.residuals[0]) if ef else [None] * n
        whole_res = (part(local, treedef), state.residuals[1]) if ef else None
        next_key, sub = step_keys(state)
        if has_whole:
            reduced, whole = inner.update(part(leaves, treedef),
                                          AllReduceState(state.key, whole_res))
            reduced = treedef.flatten_up_to(reduced)
            new_local = treedef.flatten_up_to(whole.residuals[0]) if ef else [None] * n
        else:
            reduced, new_local = [None] * n, [None] * n
            whole = AllReduceState(next_key, whole_res)
        out = list(reduced)
        for i, d in dims.items():
            if i not in in_backward and tuple(jnp.shape(leaves[i])) != shapes[i]:
                raise ValueError(
                    f"data_parallel_grad: {layout.paths[i]!r} is split over {axis!r} and "
                    f"reaches the all-reduce with shape {tuple(jnp.shape(leaves[i]))}, not its "
                    f"parameter's {shapes[i]}: a stage that reshapes gradients (PLUMAGE's "
                    "projection) cannot reduce-scatter them into the parameter's shard; keep "
                    f"that leaf off {axis!r} or out of the stage")
            if i in in_backward:  # reduce-scattered inside the backward pass already
                out[i], new_local[i] = leaves[i], local[i]
                continue
            key = None if sub is None else jax.random.fold_in(sub, _SCATTER_SALT + i)
            out[i], err = reduce_scatter_along(leaves[i], d, collectives[i], mean, key,
                                        None if local[i] is None else local[i][0])
            new_local[i] = None if err is None else laid_out(i, err[None])
        residuals = (treedef.unflatten(new_local), whole.residuals[1]) if ef else None
        return treedef.unflatten(out), AllReduceState(whole.key, residuals)

    scattered = ScatteredLeaves(axis, {layout.paths[i]: d for i, d in dims.items()})
    return AllReduceTransformation(init_fn, update_fn, inner.spec, shards, None, scattered)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one call reduces: the layout, the stage, and the leaves split over the data axis
    whose gradients are reduce-scattered by the codec inside the backward pass."""

    layout: _Layout
    stage: Any
    in_backward: frozenset
    collectives: dict  # leaf index -> the Collective of a leaf split over the data axis


class DataParallelGrad:
    """What :func:`data_parallel_grad` returns: call it inside ``jax.jit`` as
    ``loss, grads, comm_state, aux = grad_fn(params, batch, comm_state)``.

    Attributes:
      mesh: the device mesh.
      data_axis: the mesh axis of data parallelism.
      stage: ``comm`` as given: a codec name (an :func:`~gift_jax.allreduce` is built from
        it for the parameters' layout) or the caller's own stage.
    """

    def __init__(self, loss_fn, mesh, data_axis, comm, param_specs, has_aux, aux_reduce,
                 batch_spec, mean, backend, accumulate_steps, wrap=None, stage_args=None,
                 allreduce_options=None, loss_weight=None, refresh_loss=None):
        self.mesh, self.data_axis = mesh, data_axis
        self._size = _check_mesh(mesh, data_axis)
        if isinstance(comm, optax.MultiSteps):
            raise TypeError(
                "data_parallel_grad: comm is an optax.MultiSteps; accumulate before the "
                "reduction with data_parallel_grad(..., accumulate_steps=k) and wrap only the "
                "optimizer in optax.MultiSteps if you need it (reduce once, then step)")
        if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
            raise ValueError(f"data_parallel_grad: accumulate_steps={accumulate_steps!r} must "
                             "be a positive int")
        self._options = dict(allreduce_options or {})
        for key in ("mean", "backend", "shards"):
            if key in self._options:
                raise ValueError(f"data_parallel_grad: allreduce_options sets {key!r}, which "
                                 "data_parallel_grad sets itself (pass it to data_parallel_grad)")
        if self._options and not isinstance(comm, (str, Codec)):
            raise TypeError("data_parallel_grad: allreduce_options configure the all-reduce "
                            "built from a codec name; pass comm as a codec name")
        self._stateful = any(self._options.get(k) for k in ("error_feedback",
                                                            "stochastic_rounding"))
        self._own = isinstance(comm, (str, Codec)) and wrap is None and not self._stateful
        self._wrap, self._stage_args = wrap, stage_args
        if wrap is not None and not isinstance(comm, (str, Codec)):
            raise TypeError("data_parallel_grad: wrap= wraps the all-reduce built from a codec "
                            "name; pass comm as a codec name (or your whole stage without wrap)")
        if isinstance(comm, (str, Codec)):
            self._codec = get_codec(comm)
        elif isinstance(comm, optax.GradientTransformation):
            self._codec = None
        else:
            raise TypeError(f"data_parallel_grad: comm={comm!r} must be a codec name or an "
                            "optax stage (gift_jax.allreduce, gift_jax.gift, ...)")
        if loss_weight is not None and not callable(loss_weight):
            raise TypeError(f"data_parallel_grad: loss_weight={loss_weight!r} must be a "
                            "callable batch → this replica's weight (e.g. its real tokens)")
        if loss_weight is not None and not mean:
            raise ValueError("data_parallel_grad: loss_weight= makes the loss and gradient the "
                             "weighted mean over every replica's rows; mean=False (a sum over "
                             "the replicas) cannot be weighted: leave mean=True")
        if refresh_loss is not None and not callable(refresh_loss):
            raise TypeError(f"data_parallel_grad: refresh_loss={refresh_loss!r} must be a "
                            "callable (params, batch) → (what loss_fn returns, statistics)")
        self.stage = comm
        self._loss_fn, self._param_specs = loss_fn, param_specs
        self._has_aux, self._aux_reduce = has_aux, aux_reduce
        self._batch_spec, self._mean, self._backend = batch_spec, mean, backend
        self._steps = accumulate_steps
        self._loss_weight, self._refresh_loss = loss_weight, refresh_loss
        if has_aux and aux_reduce is None:
            _reduce_aux(None, None, data_axis)  # the one-line error, at build time
        if has_aux:
            _check_aux_reduce(aux_reduce, loss_weight is not None)

    # ---- the layout and the stage ------------------------------------------------------

    def _plan(self, boxed: Any, params: Any) -> _Plan:
        layout = _layout(boxed, self._param_specs, self.mesh, self.data_axis, self._size)
        axis = self.data_axis
        split = {i: d for i, d in enumerate(layout.data_dim) if d is not None}
        stage = self.stage
        if not isinstance(stage, (str, Codec)):
            if split:
                name = layout.paths[next(iter(split))]
                raise ValueError(
                    f"data_parallel_grad: {name!r} is split over {axis!r}, and comm is a stage "
                    "built outside data_parallel_grad, which reduces whole leaves: pass comm as "
                    "a codec name, your stage around its all-reduce as wrap= (e.g. wrap=lambda "
                    "ar: gift_jax.gift(ar, ...)) and error feedback or stochastic rounding as "
                    "allreduce_options=")
            return _Plan(layout, stage, frozenset(), {})
        if split and self._options.get("intra_axis") is not None:
            name = layout.paths[next(iter(split))]
            raise ValueError(
                f"data_parallel_grad: {name!r} is split over {axis!r}, whose gradient is "
                "reduce-scattered over it alone: allreduce_options intra_axis (a hierarchical "
                f"reduction) cannot reduce it; keep the leaf off {axis!r} or drop intra_axis")
        options = dict(self._options)
        base = allreduce(axis, self._codec, mean=self._mean, backend=self._backend, **options)
        spec = base.spec
        codecs = resolve_codecs(params, spec.codec, spec.block_size, spec.policy)
        collectives = {i: spec.collective(codecs[i], axis) for i in split}
        if self._own:
            shards = None
            if layout.model_axes:
                shards = LocalShards(layout.model_axes, _indexed_specs(layout.model_specs))
            stage = allreduce(axis, self._codec, mean=self._mean, backend=self._backend,
                              shards=shards, **options)
            return _Plan(layout, stage, frozenset(split), collectives)
        if not split:
            shards = None
            if layout.model_axes:
                shards = LocalShards(layout.model_axes, _tree_specs(layout.model_specs))
            stage = allreduce(axis, self._codec, mean=self._mean, backend=self._backend,
                              shards=shards, **options)
            if self._wrap is not None:
                stage = self._wrap(stage)
            return _Plan(layout, stage, frozenset(), collectives)

        def build(in_backward):
            inner = _scattering_allreduce(
                axis, self._codec, mean=self._mean, backend=self._backend, options=options,
                layout=layout, params=params, collectives=collectives, in_backward=in_backward)
            return inner if self._wrap is None else self._wrap(inner)

        stage = build(frozenset())
        selected = getattr(stage, "selected_paths", None)
        if self._stateful or selected is None:
            return _Plan(layout, stage, frozenset(), collectives)
        # a stage that changes only some leaves (GIFT): the others, split over data, are
        # reduce-scattered by the codec inside the backward pass, as without a stage
        chosen = set(selected(params))
        in_backward = frozenset(i for i in split if layout.paths[i] not in chosen)
        if in_backward:
            stage = build(in_backward)
        return _Plan(layout, stage, in_backward, collectives)

    def init(self, params: Any) -> Any:
        """The communication state of the stage (``None`` for a codec name), placed on the
        mesh: keep it in the train state (e.g. a field of a flax ``TrainState`` subclass,
        which the trainer's checkpoints then save) and pass it to every call.

        Args:
          params: the parameters (arrays or their abstract shapes), boxed or not.

        Returns:
          The stage's state for the leaves it reduces, or ``None`` when ``comm`` was a codec
          name (a stateless reduction).
        """
        if self._own:
            return None
        boxed = params
        params, _ = _unboxed(boxed)
        stage = self._plan(boxed, params).stage
        probe = jax.eval_shape(jax.shard_map(
            stage.init, mesh=self.mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
            axis_names={self.data_axis}, check_vma=False), params)
        specs = partition_specs(probe, self.data_axis)
        return jax.jit(jax.shard_map(stage.init, mesh=self.mesh, in_specs=PartitionSpec(),
                                     out_specs=specs, axis_names={self.data_axis},
                                     check_vma=False))(params)

    # ---- the call ------------------------------------------------------------------------

    def __call__(self, params: Any, batch: Any, comm_state: Any = None, *,
                 refresh: bool = False):
        """The reduced gradient of ``loss_fn`` at ``params`` on ``batch``.

        Args:
          params: the parameters, laid out as ``param_specs`` says (flax boxes allowed).
          batch: a pytree of arrays whose leading dimension is split over the data axis
            (``batch_spec`` otherwise).
          comm_state: the stage's state (:meth:`init`), or ``None`` for a codec name.
          refresh: a refresh step: differentiate ``refresh_loss`` and pass its statistics to
            the stage as ``gift_stats=``. A Python bool compiles that variant alone; a traced
            bool (``state.step % k == 0`` inside the step) compiles both under one
            ``jax.lax.cond`` and runs one. Ignored without a stage.

        Returns:
          ``(loss, grads, comm_state, aux)``: the loss (the mean over the replicas of their
          losses, summed with ``mean=False``; with ``loss_weight``, their weighted mean), the
          reduced gradients in the parameters' shardings (boxed like ``params``), the new
          communication state and the auxiliary metrics reduced as ``aux_reduce`` names them
          (``None`` without ``has_aux``).

        Raises:
          ValueError: the loss is not a scalar, the parameters' layout cannot be reduced
            (one line naming the leaf), a stage without its state, or ``refresh=True``
            without ``refresh_loss``.
        """
        boxed = params
        params, rebox = _unboxed(boxed)
        plan = self._plan(boxed, params)
        layout, stage, in_backward = plan.layout, plan.stage, plan.in_backward
        axis, mesh, own = self.data_axis, self.mesh, self._own
        flat, treedef = jax.tree.flatten(params)
        in_param = [PartitionSpec(*([None] * d), axis) if d is not None else PartitionSpec()
                    for d in layout.data_dim]
        batch_spec = self._batch_spec
        if batch_spec is None:
            batch_spec = jax.tree.map(lambda _: PartitionSpec(axis), batch)
        if not own and comm_state is None:
            raise ValueError("data_parallel_grad: comm is a stage: pass its state, "
                             "comm_state = grad_fn.init(params), and keep the one returned")
        state_spec = None if own else partition_specs(comm_state, axis)
        static = refresh is None or isinstance(refresh, (bool, np.bool_))
        if not own and (not static or refresh) and self._refresh_loss is None:
            raise ValueError("data_parallel_grad: refresh= differentiates refresh_loss and "
                             "passes its statistics to the stage: build grad_fn with "
                             "refresh_loss= (e.g. capture_linen.with_input_stats of the loss)")
        steps, weight_fn, P = self._steps, self._loss_weight, self._size

        def grad_of(fn, has_aux, p, b, scale=None):
            shape = jax.eval_shape(fn, p, b)
            shape = shape[0] if has_aux else shape
            if getattr(shape, "shape", None) != ():
                raise ValueError(
                    f"data_parallel_grad: loss_fn returned {getattr(shape, 'shape', shape)}, "
                    "not a scalar (reduce it, e.g. with jnp.mean, before returning it)")
            if scale is not None:
                def fn(p, b, _fn=fn):
                    out = _fn(p, b)
                    return (out[0] * scale, out[1]) if has_aux else out * scale
            out, g = jax.value_and_grad(fn, has_aux=has_aux)(p, b)
            loss, aux = out if has_aux else (out, None)
            return loss, aux, g

        scatters = {i: functools.partial(reduce_scatter_along, dim=layout.data_dim[i],
                                         col=plan.collectives[i], mean=self._mean)
                    for i in in_backward}

        def weights_of(batch):
            w = jnp.asarray(weight_fn(batch), jnp.float32)
            if w.shape != ():
                raise ValueError(f"data_parallel_grad: loss_weight returned shape {w.shape}, "
                                 "not a scalar (this replica's rows' weight, e.g. its real "
                                 "tokens)")
            return w

        def local(flat_params, batch, state, refreshing):
            loss_fn, has_aux = self._loss_fn, self._has_aux
            if refreshing:  # the statistics ride beside the loss's own aux
                def loss_fn(p, b, _fn=self._refresh_loss, _aux=self._has_aux):
                    out, stats = _fn(p, b)
                    return (out[0], (out[1], stats)) if _aux else (out, (None, stats))
                has_aux = True
            split = [d is not None and i not in in_backward
                     for i, d in enumerate(layout.data_dim)]
            # leaves split over data that the stage reduces: gathered before differentiation
            # (their per-replica gradients are whole); the others' gather has the codec's
            # reduce-scatter as its VJP
            pre = [jax.lax.all_gather(x, axis, axis=d, tiled=True) if s else x
                   for x, d, s in zip(flat_params, layout.data_dim, split, strict=True)]
            weight = None
            if steps == 1:
                scale = None
                if weight_fn is not None:
                    w = weights_of(batch)
                    total = jax.lax.psum(w, axis)
                    scale, weight = P * w / total, (w, total)

                def on_leaves(leaves, b):
                    full = [_gather(x, layout.data_dim[i], axis, scatters[i])
                            if i in in_backward else x for i, x in enumerate(leaves)]
                    return loss_fn(rebox(full), b)

                loss, aux, g = grad_of(on_leaves, has_aux, pre, batch, scale)
                gl = list(g)
            else:  # accumulate in fp32 on each replica, reduce once
                full = [jax.lax.all_gather(x, axis, axis=d, tiled=True) if i in in_backward
                        else x for i, (x, d) in enumerate(zip(pre, layout.data_dim,
                                                               strict=True))]
                p = rebox(full)
                for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
                    if not x.shape or x.shape[0] % steps:
                        raise ValueError(
                            f"data_parallel_grad: batch leaf {leaf_path(path)!r} has "
                            f"{x.shape[0] if x.shape else 0} rows per replica, not divisible "
                            f"into accumulate_steps={steps} microbatches")
                micro = jax.tree.map(
                    lambda x: x.reshape(steps, x.shape[0] // steps, *x.shape[1:]), batch)
                micro_w = None
                if weight_fn is None:
                    loss, aux, g = jax.lax.map(lambda b: grad_of(loss_fn, has_aux, p, b),
                                               micro)
                    loss = jnp.mean(loss)
                    g = jax.tree.map(lambda x: jnp.mean(x, axis=0), g)
                else:
                    micro_w = jax.lax.map(weights_of, micro)
                    w = jnp.sum(micro_w)
                    total = jax.lax.psum(w, axis)
                    weight = (w, total)
                    loss, aux, g = jax.lax.map(lambda a: grad_of(loss_fn, has_aux, p, *a),
                                               (micro, P * micro_w / total))
                    loss = jnp.sum(loss)
                    g = jax.tree.map(lambda x: jnp.sum(x, axis=0), g)
                if refreshing:  # the statistics of equal microbatches: their mean
                    user, stats = aux
                    stats = jax.tree.map(lambda x: jnp.mean(x, axis=0), stats)
                    if self._has_aux:
                        user = _combine_micro(user, self._aux_reduce, micro_w)
                    aux = (user, stats)
                elif has_aux:
                    aux = _combine_micro(aux, self._aux_reduce, micro_w)
                gl = jax.tree.leaves(g)
                gl = [scatters[i](x)[0] if i in in_backward else x for i, x in enumerate(gl)]
            stats = None
            if refreshing:
                aux, stats = aux
            out = [x if i in in_backward else None for i, x in enumerate(gl)]
            if own:
                rest = {i: x for i, x in enumerate(gl) if layout.data_dim[i] is None}
                if rest:
                    reduced, _ = stage.update(rest, stage.init(rest), None)
                    out = [reduced[i] if o is None else o for i, o in enumerate(out)]
            else:
                extra = {} if self._stage_args is None else dict(self._stage_args(aux))
                if refreshing:
                    extra["gift_stats"] = stats
                reduced, state = stage.update(treedef.unflatten(gl), state,
                                              treedef.unflatten(flat_params), **extra)
                out = treedef.flatten_up_to(reduced)
            loss = (jax.lax.pmean if self._mean else jax.lax.psum)(loss, axis)
            aux = _reduce_aux(aux, self._aux_reduce, axis, weight) if self._has_aux else None
            return loss, out, state, aux

        def traced(flat_params, batch, state, pred):
            with _data_axis_manual(axis):
                if own or static:
                    return local(flat_params, batch, state, bool(refresh) and not own)
                # a traced choice: both variants compiled, one run (see data_parallel_grad)
                return jax.lax.cond(pred, lambda: local(flat_params, batch, state, True),
                                    lambda: local(flat_params, batch, state, False))

        pred = None if static else jnp.asarray(refresh, bool)
        run = jax.shard_map(
            traced, mesh=mesh, in_specs=(in_param, batch_spec, state_spec, PartitionSpec()),
            out_specs=(PartitionSpec(), in_param, state_spec, PartitionSpec()),
            axis_names={axis}, check_vma=False)
        loss, grads, new_state, aux = run(flat, batch, comm_state, pred)
        grads = [_place(g, NamedSharding(mesh, s))
                 for g, s in zip(grads, layout.specs, strict=True)]
        return loss, rebox(grads), new_state, aux


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` in ``sharding``: a constraint on an ``Auto`` mesh (GSPMD), a reshard where the
    mesh's axes are ``Explicit`` (sharding in types)."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and explicit in tuple(getattr(sharding.mesh, "axis_types", ())):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _tree_specs(model_specs: list) -> Callable[[Any], Any]:
    """``LocalShards.specs`` of trees like the parameters (a wrapped stage's)."""

    def specs(tree):
        return jax.tree.unflatten(jax.tree.structure(tree), model_specs)

    return specs


def _indexed_specs(model_specs: list) -> Callable[[Any], Any]:
    """``LocalShards.specs`` of the ``{index: leaf}`` dicts the codec-name stage reduces."""

    def specs(tree):
        return {k: model_specs[k] for k in tree} if isinstance(tree, dict) else tree

    return specs


def data_parallel_grad(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    *,
    data_axis: str = "data",
    comm: str | Codec | optax.GradientTransformation = "fp8_e4m3",
    param_specs: Any = None,
    has_aux: bool = False,
    aux_reduce: Any = None,
    batch_spec: Any = None,
    mean: bool = True,
    backend: str = "auto",
    accumulate_steps: int = 1,
    wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None,
    stage_args: Callable[[Any], dict[str, Any]] | None = None,
    allreduce_options: dict[str, Any] | None = None,
    loss_weight: Callable[[Any], Any] | None = None,
    refresh_loss: Callable[..., Any] | None = None,
) -> DataParallelGrad:
    """The quantized data-parallel gradient of ``loss_fn``, for a GSPMD step (a plain
    ``jax.jit``): ``loss, grads, comm_state, aux = grad_fn(params, batch, comm_state)``.

    Each replica of ``data_axis`` differentiates ``loss_fn(params, its rows)``; the gradients
    are reduced over ``data_axis`` by ``comm`` and returned in the parameters' shardings.
    Leaves split over ``data_axis`` itself (FSDP on the data axis) are gathered for the
    forward pass and their gradients reduce-scattered in the codec straight into the
    parameter's shard (inside the backward pass: a leaf's whole per-replica gradient lives
    only until its reduce-scatter); leaves split over other axes are reduced shard by shard
    (:class:`~gift_jax.comm.stage.LocalShards`). With a stage (``wrap=``, error feedback,
    stochastic rounding) the leaves split over ``data_axis`` that the stage changes (GIFT's
    selected layers; every leaf under error feedback or stochastic rounding) are
    differentiated whole on each replica and reduce-scattered by the stage after the
    backward pass: GIFT whitens the whole per-replica gradient and unwhitens each device's
    shard of the reduced one (``W·G[:, cols] = (W·G)[:, cols]``: a kernel split on its output
    dimension, or on a batch axis of a stack; one split on its input dimension is refused,
    naming it), error feedback keeps each replica's quantization error of the whole leaf.
    The leaves the stage leaves alone are reduce-scattered inside the backward as without it.

    What is averaged: by default each replica's ``loss_fn`` is the mean over its own rows and
    the result is the *mean of the per-replica means* (the global mean when every replica
    averages as many terms). For a loss normalized by a per-batch count (real tokens of
    padded rows) pass ``loss_weight``: the loss and gradient are then
    ``Σ_r w_r·loss_r / Σ_r w_r``, the global token mean, whatever the padding per replica.

    Keep the communication state in the trainer's own state (a field of a flax
    ``TrainState`` subclass, say ``comm_state``: ``state.apply_gradients(grads=grads,
    comm_state=comm_state)``), and its checkpoints (orbax) save and restore it bit for bit.

    Args:
      loss_fn: ``(params, batch) → scalar``, ``→ (scalar, aux)`` with ``has_aux``; called on
        each replica's rows (with ``params`` boxed as given, under the data axis's manual
        context: its sharding constraints drop the data axis).
      mesh: the device mesh.
      data_axis: the mesh axis of data parallelism (the batch's leading dimension).
      comm: a codec name (``"fp32"``, ``"bf16"``, ``"fp8_e4m3"``, ``"mxfp8"``, ``"nvfp4"`` …;
        stateless) or an optax stage whose ``update`` reduces per-device gradients over
        ``data_axis`` (:func:`~gift_jax.allreduce` with error feedback, :func:`~gift_jax.gift`,
        :func:`~gift_jax.plumage`): its state comes from :meth:`DataParallelGrad.init` and
        lives in the caller's train state. A stage reducing leaves split over other axes must
        be built with their ``shards=``; leaves split over ``data_axis`` need the stage built
        here (a codec name with ``wrap=`` / ``allreduce_options``).
      param_specs: the parameters' ``PartitionSpec`` s (or ``NamedSharding`` s), a pytree like
        the parameters (flax boxes replaced by their spec, as ``nn.get_sharding(params,
        mesh)``, ``nn.logical_to_mesh_sharding(...)`` and ``nn.get_partition_spec(params)``
        return them; a logical box's logical spec is resolved through the linen rules) or a
        callable ``params → specs``; ``None``: each flax box's own partitioning
        (``nn.LogicallyPartitioned`` names resolved through the box's rules or the
        ``nn.logical_axis_rules`` in context, as flax does), other leaves replicated.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      aux_reduce: with ``has_aux``: how each metric is reduced over the replicas, ``"sum"``,
        ``"mean"``, ``"max"``, ``"min"`` or, with ``loss_weight``, ``"weighted"`` (weighted
        like the loss): one string, or a tree prefix of ``aux`` (a dict).
      batch_spec: the batch's ``PartitionSpec`` s inside the map (default: the leading
        dimension of every leaf over ``data_axis``).
      mean: average the gradients (and the loss) over the replicas; ``False`` sums them.
      backend: the quantize kernels' backend (``"auto"``, ``"xla"``, ``"pallas"``).
      accumulate_steps: split each replica's rows into this many microbatches, accumulate
        their gradients in fp32 on the replica and reduce once (what ``optax.MultiSteps``
        around the reduction would do, without reducing every microbatch).
      wrap: with ``comm`` a codec name: a callable given the :func:`~gift_jax.allreduce` stage
        built for the parameters' layout (with its :class:`~gift_jax.comm.stage.LocalShards`
        when they are split over other axes, reduce-scattering the leaves split over
        ``data_axis``) that returns the stage to use, e.g.
        ``lambda ar: gift_jax.gift(ar, layers=["*/mlp/down"])``; its state comes from
        :meth:`DataParallelGrad.init`.
      stage_args: with a stateful stage: ``aux → dict`` of keyword arguments for the stage's
        ``update``, called on each replica's own ``aux`` (``None`` without ``has_aux``) inside
        the map. PLUMAGE's refresh: ``lambda _: {"plumage_refresh": True}`` (a static choice:
        one ``grad_fn`` per variant); GIFT's is ``refresh_loss`` (or ``lambda aux:
        {"gift_stats": aux}`` with a loss whose aux is the statistics). Ignored without a
        stage (a codec name alone), so a port can switch GIFT off by ``wrap=None``. A stage
        that is a whole optimizer (``gift_jax.plumage(..., communicate=...)``) returns its
        updates, which take the place of ``grads``.
      allreduce_options: with ``comm`` a codec name: further :func:`~gift_jax.allreduce`
        settings (``error_feedback``, ``stochastic_rounding``, ``block_size``, ``policy`` …;
        not ``mean``, ``backend`` or ``shards``, which this function sets). With error
        feedback or stochastic rounding the reduction has state (:meth:`DataParallelGrad.init`),
        which covers the leaves split over ``data_axis`` too (one scale per leaf, or per
        block).
      loss_weight: ``batch → scalar``, the weight of a replica's rows (e.g. ``lambda b:
        jnp.sum(b["targets"] != PAD)``, its real tokens), computed on each replica's (or
        microbatch's) rows: the loss and gradient become the weighted mean over the replicas,
        ``Σ_r w_r·loss_r / Σ_r w_r``, which for a loss averaged over its real tokens is the
        global token mean (each replica's gradient is scaled by ``P·w_r / Σ w`` before the
        reduction). ``loss_fn`` must stay finite on rows without weight (divide by
        ``jnp.maximum(tokens, 1)``). Needs ``mean=True``.
      refresh_loss: ``(params, batch) → (what loss_fn returns, statistics)``, the refresh
        variant of the loss (e.g. :func:`gift_jax.whitening.capture_linen.with_input_stats`
        of it, or the NNX :func:`~gift_jax.whitening.capture.with_input_stats`): called
        instead of ``loss_fn`` when ``grad_fn(..., refresh=True)``, its statistics passed to
        the stage as ``gift_stats=`` (each replica's own; GIFT averages them), its aux reduced
        as ``aux_reduce`` says like ``loss_fn``'s.

    Returns:
      A :class:`DataParallelGrad`.

    Raises:
      ValueError: the mesh has no ``data_axis`` or it has size 1, ``has_aux`` without
        ``aux_reduce``, an unknown ``aux_reduce``, ``accumulate_steps`` not positive,
        ``loss_weight`` with ``mean=False``; at trace time a loss that is not a scalar or a
        leaf whose layout the reduction cannot split (one line naming it).
      TypeError: ``comm`` is not a codec or a stage (``optax.MultiSteps`` included), or
        ``loss_weight`` / ``refresh_loss`` not callable.
    """
    return DataParallelGrad(loss_fn, mesh, data_axis, comm, param_specs, has_aux, aux_reduce,
                            batch_spec, mean, backend, accumulate_steps, wrap, stage_args,
                            allreduce_options, loss_weight, refresh_loss)


def reduce_gradients(
    per_device_grads: Any,
    mesh: jax.sharding.Mesh,
    *,
    data_axis: str = "data",
    codec: str | Codec = "fp8_e4m3",
    mean: bool = True,
    backend: str = "auto",
) -> Any:
    """The stateless quantized reduction of a gradient pytree, for GSPMD code: every leaf of
    ``per_device_grads`` stacks one gradient per replica on its leading axis (split over
    ``data_axis``: ``(P, *shape)``), and the result is their mean (or sum), replicated.

    Args:
      per_device_grads: a pytree of ``(P, *shape)`` float arrays, ``P`` = the size of
        ``data_axis``.
      mesh: the device mesh.
      data_axis: the mesh axis the leading dimension is split over.
      codec: the wire format.
      mean: average instead of summing.
      backend: the quantize kernels' backend.

    Returns:
      A pytree of ``shape``-shaped arrays, the reduced gradients, replicated over the mesh.

    Raises:
      ValueError: the mesh has no ``data_axis``, it has size 1, or a leaf's leading dimension
        is not the axis size.
    """
    size = _check_mesh(mesh, data_axis)
    for path, x in jax.tree_util.tree_flatten_with_path(per_device_grads)[0]:
        if not x.shape or x.shape[0] != size:
            raise ValueError(f"reduce_gradients: {leaf_path(path)!r} {tuple(x.shape)} must "
                             f"stack one gradient per replica on a leading axis of {size}")

    def local(tree):
        tree = jax.tree.map(lambda x: x[0], tree)
        return quantized_psum(tree, data_axis, codec=codec, mean=mean, backend=backend)

    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(data_axis),
                         out_specs=PartitionSpec(), axis_names={data_axis},
                         check_vma=False)(per_device_grads)


def gradient_shard_bytes(params: Any, param_specs: Any, mesh) -> int:
    """Bytes per device of the gradients when each is held as its parameter's shard (the
    ideal the FSDP reduction is measured against).

    Args:
      params: the parameters (arrays or abstract shapes).
      param_specs: their ``PartitionSpec`` s (a pytree like ``params``).
      mesh: the device mesh.

    Returns:
      The largest, over devices, of the bytes of the shards a device holds.
    """
    total = 0
    specs = jax.tree.structure(params).flatten_up_to(param_specs)
    for x, s in zip(jax.tree.leaves(params), specs, strict=True):
        shape = NamedSharding(mesh, s).shard_shape(x.shape)
        total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return total
