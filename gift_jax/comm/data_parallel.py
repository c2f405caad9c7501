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

Metrics returned as ``aux`` are reduced as the caller names them (``aux_reduce``): a sum stays
a sum (a token count is not averaged into 1/P of itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from gift_jax.comm.codecs import Codec, get_codec
from gift_jax.comm.collectives import quantized_psum, quantized_reduce_scatter
from gift_jax.comm.stage import (
    LocalShards,
    allreduce,
    partition_specs,
)
from gift_jax.utils.tree_paths import leaf_path

_REDUCTIONS = {
    "sum": jax.lax.psum,
    "mean": jax.lax.pmean,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
}


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _spec_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
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


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Each parameter leaf's place on the mesh, split into what the shard_map sees (the data
    axis) and what GSPMD keeps (the other axes)."""

    specs: list  # full PartitionSpec per leaf
    data_dim: list  # the dimension split over the data axis, or None
    model_specs: list  # the spec with the data axis removed (what LocalShards reduces on)
    model_axes: tuple[str, ...]  # mesh axes other than data that split some leaf


def _layout(params: Any, param_specs: Any, mesh, data_axis: str, size: int) -> _Layout:
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if param_specs is None:
        specs = [PartitionSpec()] * len(flat)
    else:
        if callable(param_specs) and not _is_spec(param_specs):
            param_specs = param_specs(params)
        try:
            specs = treedef.flatten_up_to(param_specs)
        except (ValueError, TypeError) as e:
            raise ValueError(f"data_parallel_grad: param_specs do not match the parameters' "
                             f"structure ({e})".splitlines()[0]) from None
        specs = [s.spec if isinstance(s, NamedSharding) else
                 (PartitionSpec() if s is None else s) for s in specs]
    data_dim, model_specs, model_axes = [], [], []
    for (path, x), spec in zip(flat, specs, strict=True):
        name = leaf_path(path)
        if not _is_spec(spec):
            raise TypeError(f"data_parallel_grad: the spec of {name!r} is {spec!r}, not a "
                            "PartitionSpec")
        if len(spec) > len(x.shape):
            raise ValueError(f"data_parallel_grad: {name!r} {tuple(x.shape)} has a spec of "
                             f"{len(spec)} dimensions, {spec}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"data_parallel_grad: {name!r} is {x.dtype}, not a float array: "
                            "only float parameters have gradients to reduce")
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
        data_dim.append(dim)
        model_specs.append(rest)
        model_axes += [a for e in rest for a in _spec_axes(e) if a not in model_axes]
    for a in model_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"data_parallel_grad: param_specs name axis {a!r}, which the mesh "
                             f"does not have (its axes: {tuple(mesh.axis_names)})")
    return _Layout(specs, data_dim, model_specs, tuple(model_axes))


def _reduce_aux(aux: Any, aux_reduce: Any, axis: str) -> Any:
    if aux_reduce is None:
        raise ValueError(
            "data_parallel_grad: has_aux=True needs aux_reduce= naming how each metric is "
            "reduced over the replicas: 'sum' (token counts), 'mean', 'max' or 'min', one "
            "string for all or a dict like the aux")

    def one(how, sub):
        if how not in _REDUCTIONS:
            raise ValueError(f"data_parallel_grad: aux_reduce {how!r} is not one of "
                             f"{tuple(_REDUCTIONS)}")
        return jax.tree.map(lambda x: _REDUCTIONS[how](x, axis), sub)

    try:
        return jax.tree.map(one, aux_reduce, aux, is_leaf=lambda x: isinstance(x, str))
    except ValueError as e:
        if "aux_reduce" in str(e):
            raise
        raise ValueError(f"data_parallel_grad: aux_reduce does not match the aux's structure "
                         f"(a string, or a prefix of the aux tree): {str(e).splitlines()[0]}"
                         ) from None


def _gather(x: jax.Array, dim: int, scatter: Callable) -> jax.Array:
    """All-gather ``x`` over the data axis along ``dim`` (fp32, the forward's weights); its
    VJP is ``scatter``, the codec's reduce-scatter of the gradient into the shard."""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.all_gather(x, scatter.keywords["axis"], axis=dim, tiled=True)

    def fwd(x):
        return gather(x), None

    def bwd(_, g):
        return (scatter(g, dim),)

    gather.defvjp(fwd, bwd)
    return gather(x)


def _scatter_leaf(g: jax.Array, dim: int, *, axis: str, codec: Codec, mean: bool,
                  backend: str) -> jax.Array:
    """Reduce-scatter ``g`` (this replica's whole gradient) over ``axis`` into this replica's
    slice of dimension ``dim``, in ``codec``; each slice is padded to whole codec rows so that
    the shard boundaries are the slices'."""
    P = jax.lax.axis_size(axis)
    moved = jnp.moveaxis(g, dim, 0)
    shard_shape = (moved.shape[0] // P, *moved.shape[1:])
    if codec.is_exact:
        out = jax.lax.psum_scatter(moved, axis, scatter_dimension=0, tiled=True)
    else:
        per = moved.reshape(P, -1).astype(jnp.float32)
        n = per.shape[1]
        padded = -(-n // codec.row_size) * codec.row_size
        per = jnp.pad(per, ((0, 0), (0, padded - n)))
        out = quantized_reduce_scatter(per, axis, codec=codec, backend=backend)
        out = out[:n].reshape(shard_shape)
    if mean:
        out = out / P
    return jnp.moveaxis(out.astype(g.dtype), 0, dim)


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
                 allreduce_options=None):
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
        stateful = any(self._options.get(k) for k in ("error_feedback", "stochastic_rounding"))
        self._own = isinstance(comm, (str, Codec)) and wrap is None and not stateful
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
        self.stage = comm
        self._loss_fn, self._param_specs = loss_fn, param_specs
        self._has_aux, self._aux_reduce = has_aux, aux_reduce
        self._batch_spec, self._mean, self._backend = batch_spec, mean, backend
        self._steps = accumulate_steps
        if has_aux and aux_reduce is None:
            _reduce_aux(None, None, data_axis)  # the one-line error, at build time

    # ---- the layout and the stage ------------------------------------------------------

    def _plan(self, params):
        layout = _layout(params, self._param_specs, self.mesh, self.data_axis, self._size)
        split = [d is not None for d in layout.data_dim]
        if any(split) and not self._own:
            name = next(n for n, s in zip(_paths(params), split, strict=True) if s)
            raise ValueError(
                f"data_parallel_grad: {name!r} is split over {self.data_axis!r}, whose "
                "gradient is reduce-scattered by the codec alone: pass comm as a codec name "
                "without a stage, wrap= or stateful allreduce_options")
        stage = self.stage
        if isinstance(stage, (str, Codec)):
            shards = None
            if layout.model_axes:
                specs_of = (_indexed_specs(layout.model_specs) if self._own else
                            _tree_specs(layout.model_specs))
                shards = LocalShards(layout.model_axes, specs_of)
            stage = allreduce(self.data_axis, self._codec, mean=self._mean,
                              backend=self._backend, shards=shards, **self._options)
            if self._wrap is not None:
                stage = self._wrap(stage)
        return layout, split, stage

    def init(self, params: Any) -> Any:
        """The communication state of the stage (``None`` for a codec name), placed on the
        mesh: keep it in the train state and pass it to every call.

        Args:
          params: the parameters (arrays or their abstract shapes).

        Returns:
          The stage's state for the leaves it reduces, or ``None`` when ``comm`` was a codec
          name (a stateless reduction).
        """
        if self._own:
            return None
        layout, split, stage = self._plan(params)
        rest = params
        probe = jax.eval_shape(jax.shard_map(
            stage.init, mesh=self.mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
            axis_names={self.data_axis}, check_vma=False), rest)
        specs = partition_specs(probe, self.data_axis)
        return jax.jit(jax.shard_map(stage.init, mesh=self.mesh, in_specs=PartitionSpec(),
                                     out_specs=specs, axis_names={self.data_axis},
                                     check_vma=False))(rest)

    # ---- the call ------------------------------------------------------------------------

    def __call__(self, params: Any, batch: Any, comm_state: Any = None):
        """The reduced gradient of ``loss_fn`` at ``params`` on ``batch``.

        Args:
          params: the parameters, laid out as ``param_specs`` says.
          batch: a pytree of arrays whose leading dimension is split over the data axis
            (``batch_spec`` otherwise).
          comm_state: the stage's state (:meth:`init`), or ``None`` for a codec name.

        Returns:
          ``(loss, grads, comm_state, aux)``: the loss averaged over the replicas (summed
          with ``mean=False``), the reduced gradients in the parameters' shardings, the new
          communication state and the auxiliary metrics reduced as ``aux_reduce`` names them
          (``None`` without ``has_aux``).

        Raises:
          ValueError: the loss is not a scalar, or the parameters' layout cannot be reduced
            (one line naming the leaf).
        """
        layout, split, stage = self._plan(params)
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
        steps, loss_fn, has_aux = self._steps, self._loss_fn, self._has_aux

        def grad_of(fn, p, b):
            shape = jax.eval_shape(fn, p, b)
            shape = shape[0] if has_aux else shape
            if getattr(shape, "shape", None) != ():
                raise ValueError(
                    f"data_parallel_grad: loss_fn returned {getattr(shape, 'shape', shape)}, "
                    "not a scalar (reduce it, e.g. with jnp.mean, before returning it)")
            out, g = jax.value_and_grad(fn, has_aux=has_aux)(p, b)
            loss, aux = out if has_aux else (out, None)
            return loss, aux, g

        scatter = functools.partial(_scatter_leaf, axis=axis, codec=self._codec,
                                    mean=self._mean, backend=self._backend)

        def local(flat_params, batch, state):
            if steps == 1:
                # the gradient of a leaf split over data leaves autodiff already reduced into
                # its shard: the gather's VJP is the codec's reduce-scatter, so each leaf's
                # whole per-replica gradient lives only until its reduce-scatter
                def on_shards(shards, b):
                    full = [x if d is None else _gather(x, d, scatter)
                            for x, d in zip(shards, layout.data_dim, strict=True)]
                    with _linen_rules_without(axis):
                        return loss_fn(treedef.unflatten(full), b)

                loss, aux, g = grad_of(on_shards, flat_params, batch)
                gl = list(g)
                p = None
            else:  # accumulate in fp32 on each replica, reduce once
                full = [x if d is None else jax.lax.all_gather(x, axis, axis=d, tiled=True)
                        for x, d in zip(flat_params, layout.data_dim, strict=True)]
                p = treedef.unflatten(full)
                for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
                    if not x.shape or x.shape[0] % steps:
                        raise ValueError(
                            f"data_parallel_grad: batch leaf {leaf_path(path)!r} has "
                            f"{x.shape[0] if x.shape else 0} rows per replica, not divisible "
                            f"into accumulate_steps={steps} microbatches")
                micro = jax.tree.map(
                    lambda x: x.reshape(steps, x.shape[0] // steps, *x.shape[1:]), batch)
                with _linen_rules_without(axis):
                    loss, aux, g = jax.lax.map(lambda b: grad_of(loss_fn, p, b), micro)
                loss = jnp.mean(loss)
                g = jax.tree.map(lambda x: jnp.mean(x, axis=0), g)
                if has_aux:
                    aux = _combine_micro(aux, self._aux_reduce)
                gl = [x if d is None else scatter(x, d) for x, d in
                      zip(treedef.flatten_up_to(g), layout.data_dim, strict=True)]
            out = [None if d is None else x for x, d in zip(gl, layout.data_dim, strict=True)]
            if own:
                rest = {i: x for i, (x, s) in enumerate(zip(gl, split, strict=True)) if not s}
                if rest:
                    reduced, _ = stage.update(rest, stage.init(rest), None)
                    out = [reduced[i] if o is None else o for i, o in enumerate(out)]
            else:
                if p is None:
                    p = treedef.unflatten(flat_params)
                extra = {} if self._stage_args is None else self._stage_args(aux)
                reduced, state = stage.update(treedef.unflatten(gl), state, p, **extra)
                out = treedef.flatten_up_to(reduced)
            loss = (jax.lax.pmean if self._mean else jax.lax.psum)(loss, axis)
            if has_aux:
                aux = _reduce_aux(aux, self._aux_reduce, axis)
            return loss, out, state, aux

        run = jax.shard_map(
            local, mesh=mesh, in_specs=(in_param, batch_spec, state_spec),
            out_specs=(PartitionSpec(), in_param, state_spec, PartitionSpec()),
            axis_names={axis}, check_vma=False)
        loss, grads, new_state, aux = run(flat, batch, comm_state)
        grads = [_place(g, NamedSharding(mesh, s))
                 for g, s in zip(grads, layout.specs, strict=True)]
        return loss, treedef.unflatten(grads), new_state, aux


def _linen_rules_without(axis: str):
    """Flax linen's logical-axis rules in context with ``axis`` taken out: inside the map
    the data axis is manual, and a ``with_logical_constraint`` of the activations' batch
    dimension onto it would fail (``with_sharding_constraint`` can only refer to Auto axes);
    the rows are already split over it. A no-op without flax or without rules."""
    try:
        import flax.linen as nn
        from flax.linen import spmd
    except ImportError:  # pragma: no cover - flax is a dependency
        return contextlib.nullcontext()
    rules = spmd.get_logical_axis_rules()
    if not rules:
        return contextlib.nullcontext()

    def drop(mesh_axes):
        if mesh_axes == axis:
            return None
        if isinstance(mesh_axes, (tuple, list)):
            kept = tuple(a for a in mesh_axes if a != axis)
            return kept or None
        return mesh_axes

    return nn.logical_axis_rules(tuple((name, drop(m)) for name, m in rules))


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


def _paths(tree) -> list[str]:
    return [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _combine_micro(aux, aux_reduce):
    """Metrics stacked over microbatches, combined on the replica as ``aux_reduce`` says."""
    local = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}

    def one(how, sub):
        return jax.tree.map(lambda x: local[how](x, axis=0), sub)

    return jax.tree.map(one, aux_reduce, aux, is_leaf=lambda x: isinstance(x, str))


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
) -> DataParallelGrad:
    """The quantized data-parallel gradient of ``loss_fn``, for a GSPMD step (a plain
    ``jax.jit``): ``loss, grads, comm_state, aux = grad_fn(params, batch, comm_state)``.

    Each replica of ``data_axis`` differentiates ``loss_fn(params, its rows)``; the gradients
    are reduced over ``data_axis`` by ``comm`` and returned in the parameters' shardings.
    Leaves split over ``data_axis`` itself (FSDP on the data axis) are gathered for the
    forward pass and their gradients reduce-scattered in the codec straight into the
    parameter's shard; leaves split over other axes are reduced shard by shard
    (:class:`~gift_jax.comm.stage.LocalShards`).

    Args:
      loss_fn: ``(params, batch) → scalar`` (the mean over the rows it is given), or
        ``→ (scalar, aux)`` with ``has_aux``.
      mesh: the device mesh.
      data_axis: the mesh axis of data parallelism (the batch's leading dimension).
      comm: a codec name (``"fp32"``, ``"bf16"``, ``"fp8_e4m3"``, ``"mxfp8"``, ``"nvfp4"`` …;
        stateless) or an optax stage whose ``update`` reduces per-device gradients over
        ``data_axis`` (:func:`~gift_jax.allreduce` with error feedback, :func:`~gift_jax.gift`,
        :func:`~gift_jax.plumage`): its state comes from :meth:`DataParallelGrad.init` and
        lives in the caller's train state. A stage reducing leaves split over other axes must
        be built with their ``shards=``.
      param_specs: the parameters' ``PartitionSpec`` s (or ``NamedSharding`` s), a pytree like
        the parameters or a callable ``params → specs``; ``None``: replicated.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      aux_reduce: with ``has_aux``: how each metric is reduced over the replicas, ``"sum"``,
        ``"mean"``, ``"max"`` or ``"min"``: one string, or a tree prefix of ``aux`` (a dict).
      batch_spec: the batch's ``PartitionSpec`` s inside the map (default: the leading
        dimension of every leaf over ``data_axis``).
      mean: average the gradients (and the loss) over the replicas; ``False`` sums them.
      backend: the quantize kernels' backend (``"auto"``, ``"xla"``, ``"pallas"``).
      accumulate_steps: split each replica's rows into this many microbatches, accumulate
        their gradients in fp32 on the replica and reduce once (what ``optax.MultiSteps``
        around the reduction would do, without reducing every microbatch).
      wrap: with ``comm`` a codec name: a callable given the :func:`~gift_jax.allreduce` stage
        built for the parameters' layout (with its :class:`~gift_jax.comm.stage.LocalShards`
        when they are split over other axes) that returns the stage to use, e.g.
        ``lambda ar: gift_jax.gift(ar, layers=["*/mlp/down"], axis_name="data")``; its state
        comes from :meth:`DataParallelGrad.init`.
      stage_args: with a stateful stage: ``aux → dict`` of keyword arguments for the stage's
        ``update``, called on each replica's own ``aux`` (``None`` without ``has_aux``) inside
        the map. GIFT's refresh: ``lambda aux: {"gift_stats": aux}``, the statistics of that
        replica's rows, which GIFT averages over its ``axis_name`` itself; PLUMAGE's:
        ``lambda _: {"plumage_refresh": True}`` (a static choice: one ``grad_fn`` per
        variant). Ignored without a stage (a codec name alone), so a port can switch GIFT off
        by ``wrap=None``. A stage that is a whole optimizer (``gift_jax.plumage(...,
        communicate=...)``) returns its updates, which take the place of ``grads``.
      allreduce_options: with ``comm`` a codec name: further :func:`~gift_jax.allreduce`
        settings (``error_feedback``, ``stochastic_rounding``, ``block_size``, ``policy`` …;
        not ``mean``, ``backend`` or ``shards``, which this function sets). With error
        feedback or stochastic rounding the reduction has state (:meth:`DataParallelGrad.init`).
        Leaves split over the data axis take the codec alone.

    Returns:
      A :class:`DataParallelGrad`.

    Raises:
      ValueError: the mesh has no ``data_axis`` or it has size 1, ``has_aux`` without
        ``aux_reduce``, ``accumulate_steps`` not positive; at trace time a loss that is not a
        scalar or a leaf whose layout the reduction cannot split (one line naming it).
      TypeError: ``comm`` is not a codec or a stage (``optax.MultiSteps`` included).
    """
    return DataParallelGrad(loss_fn, mesh, data_axis, comm, param_specs, has_aux, aux_reduce,
                            batch_spec, mean, backend, accumulate_steps, wrap, stage_args,
                            allreduce_options)


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
