"""Where every array of a run lives on the mesh: parameters, gradients, optimizer state, batch.

The mesh has up to three named axes (:mod:`.mesh`): ``data`` (replicas that communicate
through the quantized reduction), ``fsdp`` (parameters, gradients and optimizer state split
within a replica group, ZeRO-3 style; the batch is split over it too) and ``tensor``
(Megatron-style: attention heads and the MLP hidden dimension). The model's parameters carry
logical axis names (:data:`gift_jax.models.common.LOGICAL_AXES`); a rule table maps each
logical name to a mesh axis or to nothing (replicated), the maxtext/Flax convention:

=========== ============== ===========================================================
logical     default rule   dimension
=========== ============== ===========================================================
``vocab``   ``tensor``     vocabulary (embedding rows, head columns)
``embed``   ``fsdp``       d_model (the input side of q/k/v/gate/up, the output of o/down)
``heads``   ``tensor``     query heads × head_dim
``kv_heads`` ``tensor``    key/value heads × head_dim
``mlp``     ``tensor``     d_ff (SwiGLU hidden)
``norm``    replicated     norm gains and biases
``positions`` replicated   rows of a learned position table (GPT)
=========== ============== ===========================================================

Optimizer state follows its parameter (:func:`state_specs`): a state leaf under a parameter's
path is split like that parameter in every dimension it shares with it (trailing dimensions
aligned), so Adam/Muon moments are sharded exactly like their parameters and GIFT's factors
``(n, r)`` keep the split of ``n``; GIFT's statistics and PLUMAGE's projectors and projected
moments are also split over the model axes their parameter leaves unused (:func:`spread`),
never on a rank ``k``; scalars, counters and PRNG keys are replicated; error-feedback buffers
are per device over every axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gift_jax.comm.stage import LocalShards, partition_specs
from gift_jax.models import logical_axes, param_shapes
from gift_jax.training.config import ConfigError
from gift_jax.training.mesh import DEFAULT_RULES, MODEL_AXES, data_axes, model_axes
from gift_jax.utils.axes import axis_name_of


def _rule_axis(rules: Mapping[str, str], name: str) -> str | None:
    axis = rules.get(name, "")
    if axis not in ("", *MODEL_AXES):
        raise ConfigError(f"mesh.rules.{name}={axis!r} must be one of {['', *MODEL_AXES]} "
                          "('' = replicated)")
    return axis or None


def param_specs(model_config: Any, mesh_shape: Mapping[str, int],
                rules: Mapping[str, str] = DEFAULT_RULES) -> dict[str, P]:
    """``{path: PartitionSpec}`` of every parameter for a mesh of ``mesh_shape`` (axis → size).

    Axes of size 1 are dropped from the specs.

    Args:
      model_config: the model family's config dataclass.
      mesh_shape: ``{mesh axis: size}`` (an absent axis has size 1).
      rules: logical axis → ``'fsdp'``, ``'tensor'`` or ``''`` (replicated), ``mesh.rules``;
        a logical axis the rules do not name is replicated.

    Returns:
      ``{'/'-joined parameter path: PartitionSpec}``.

    Raises:
      ConfigError: one line naming the parameter, its shape and the axis when a sharded
        dimension is not divisible by its axis size, or when tensor parallelism would split an
        attention head; also for an unknown logical or mesh axis in ``rules``, or two
        dimensions of a parameter mapped to one mesh axis.
    """
    unknown = sorted(set(rules) - set(DEFAULT_RULES))
    if unknown:
        raise ConfigError(f"mesh.rules has unknown logical axes {unknown}; allowed: "
                          f"{sorted(DEFAULT_RULES)}")
    size = lambda axis: mesh_shape.get(axis, 1) if axis else 1
    for name, heads in (("heads", model_config.num_heads), ("kv_heads", model_config.kv_heads)):
        axis = _rule_axis(rules, name)
        if axis and heads % size(axis):
            field = "num_heads" if name == "heads" else "num_kv_heads"
            raise ConfigError(
                f"mesh.{axis}={size(axis)} must divide model.{field}={heads} (mesh.rules."
                f"{name}={axis!r} splits whole attention heads); choose mesh.{axis} among "
                f"{[d for d in range(1, heads + 1) if heads % d == 0]} or map {name} to ''")
    shapes = param_shapes(model_config, flat=True)
    specs = {}
    for path, names in logical_axes(model_config).items():
        shape = shapes[path].shape
        axes = []
        for dim, name in zip(shape, names, strict=True):
            axis = _rule_axis(rules, name)
            if axis is None or size(axis) == 1:
                axes.append(None)
                continue
            if axis in axes:
                raise ConfigError(f"mesh.rules map two dimensions of {path} {tuple(shape)} "
                                  f"({', '.join(names)}) to the mesh axis {axis!r}")
            if dim % size(axis):
                raise ConfigError(
                    f"parameter {path} {tuple(shape)}: its {name} dimension ({dim}) is not "
                    f"divisible by mesh.{axis}={size(axis)}; choose a mesh.{axis} that "
                    f"divides {dim} or set mesh.rules.{name}=''")
            axes.append(axis)
        specs[path] = P(*axes)
    return specs


def like_parameter(spec: P, param_shape: tuple[int, ...], shape: tuple[int, ...]) -> P:
    """The spec of an array that belongs to a parameter of ``param_shape`` split by ``spec``:
    each dimension keeps the axis of the parameter's dimension of the same size — the one in
    the same place counting from the right first (a moment is split like its parameter;
    ``(k, N)`` coordinates keep ``N``'s split), else any other not yet used (a ``(N, k)``
    projector of a parameter's second dimension keeps its split); the rest is replicated.

    So a projector's rank ``k`` is not split: splitting it over the parameter's other axis
    (to hold exactly 1/(fsdp·tensor) of the state) makes XLA's SPMD partitioner abort on
    PLUMAGE's step (jax 0.10–0.12, a failed check in spmd_partitioner_util.cc).

    Args:
      spec: the parameter's spec (may be shorter than its shape: the rest replicated).
      param_shape: the parameter's shape.
      shape: the shape of the array that belongs to the parameter.

    Returns:
      The array's spec, one entry per dimension of ``shape``.
    """
    entries = list(spec) + [None] * (len(param_shape) - len(spec))
    out: list = [None] * len(shape)
    used: set[int] = set()
    for i in range(1, min(len(shape), len(param_shape)) + 1):
        if shape[-i] == param_shape[-i]:
            out[-i] = entries[-i]
            used.add(len(param_shape) - i)
    for k, size in enumerate(shape):
        if out[k] is not None:
            continue
        for j, psize in enumerate(param_shape):
            axis = entries[j]
            if j not in used and psize == size and axis is not None and axis not in out:
                out[k] = axis
                used.add(j)
                break
    return P(*out)


def _tokens(path) -> tuple[str, ...]:
    """A key path as plain tokens; dict keys holding ``/``-joined parameter paths (GIFT's
    per-layer states) are split, so a parameter's path appears as a run of tokens."""
    out: list[str] = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            out.extend(str(key.key).split("/"))
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            out.append(key.name)
        else:
            out.append(str(key))
    return tuple(out)


#: GIFT's per-leaf states (``GiftState.whitened``) and, among their members, the K-FAC
#: statistics (``GiftLeafState.stats`` / ``out_stats``): read only on refresh steps, so they
#: are split over every model axis their dimensions divide (see :func:`spread`); the factors
#: and the routing follow the parameter.
GIFT_FIELDS = ("whitened",)
STATISTICS_MEMBERS = ("stats", "out_stats")

#: PLUMAGE's per-parameter states (``PlumageState.leaves``): projectors ``(batch, M, k)`` and
#: moments ``(batch, k, N)`` are split over the model axes their parameter's split leaves
#: unused as well (:func:`spread`), a projector never on its rank ``k`` (see
#: :func:`like_parameter`); on Llama-7B the replicated ``(11008, 1024)`` MLP projectors alone
#: were 4.0 GiB per chip.
LOWRANK_FIELDS = ("leaves",)
#: The rank dimension of a projected PLUMAGE leaf's state fields (``LeafState``), never split.
RANK_DIMENSION = {"projector": -1, "mu": -2, "nu": -2, "probs": -1, "mu_mass": -1,
                  "nu_mass": -1}


def spread(spec: P, shape: tuple[int, ...], mesh_shape: Mapping[str, int],
           exclude: tuple[int, ...] = ()) -> P:
    """``spec`` with every model axis it leaves unused assigned to a dimension it divides:
    the last unsplit one (so an ``(n, n)`` statistic of a layer whose ``n`` is on ``tensor``
    is split over ``fsdp`` as well), else the last split one whose size the product of its
    axes divides (``('tensor', 'fsdp')``). Dimensions keep the axes they had; those in
    ``exclude`` (e.g. a projector's rank) take none.

    Args:
      spec: the array's spec so far (may be shorter than ``shape``).
      shape: the array's shape.
      mesh_shape: ``{mesh axis: size}``; model axes of size 1 (or absent) are not assigned.
      exclude: dimensions that take no new axis (negative ones count from the end).

    Returns:
      The spec, one entry per dimension: ``None``, an axis name or a tuple of them.
    """
    out = [(e,) if isinstance(e, str) else tuple(e or ())
           for e in list(spec) + [None] * (len(shape) - len(spec))]
    excluded = {d % len(shape) for d in exclude}
    dims = [k for k in range(len(shape) - 1, -1, -1) if k not in excluded]
    size = lambda names: math.prod(mesh_shape.get(a, 1) for a in names)
    for axis in MODEL_AXES:
        if mesh_shape.get(axis, 1) == 1 or any(axis in e for e in out):
            continue
        fits = [k for k in dims if shape[k] % size((*out[k], axis)) == 0]
        for k in sorted(fits, key=lambda k: bool(out[k]))[:1]:  # unsplit first, stable
            out[k] = (*out[k], axis)
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in out))


class ParamLayout:
    """The parameters' shapes and specs, and the specs of anything that lives under a
    parameter's path (gradients, coordinates, optimizer state)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], specs: Mapping[str, P],
                 mesh_shape: Mapping[str, int] | None = None):
        """Args:
          shapes: ``{parameter path: shape}``.
          specs: ``{parameter path: PartitionSpec}`` (the parameters the layout knows).
          mesh_shape: ``{mesh axis: size}`` that :func:`spread` assigns axes from, or ``None``
            (nothing is spread).
        """
        self._by_tokens = {tuple(path.split("/")): (tuple(shapes[path]), specs[path])
                           for path in specs}
        self._longest = max((len(t) for t in self._by_tokens), default=0)
        self._mesh_shape = dict(mesh_shape or {})

    @classmethod
    def of(cls, model_config: Any, mesh_shape: Mapping[str, int],
           rules: Mapping[str, str] = DEFAULT_RULES) -> ParamLayout:
        """The layout of ``model_config``'s parameters on a mesh of ``mesh_shape``.

        Args:
          model_config, mesh_shape, rules: as :func:`param_specs`.

        Returns:
          The :class:`ParamLayout`.

        Raises:
          ConfigError: as :func:`param_specs`.
        """
        shapes = {p: s.shape for p, s in param_shapes(model_config, flat=True).items()}
        return cls(shapes, param_specs(model_config, mesh_shape, rules), mesh_shape)

    def spec_at(self, path, shape: tuple[int, ...]) -> P | None:
        """The spec of an array of ``shape`` at key ``path``: :func:`like_parameter` of the
        last parameter path in it, or ``None`` when no parameter's path is in it. GIFT's
        statistics (:data:`STATISTICS_MEMBERS` of a :data:`GIFT_FIELDS` leaf) and PLUMAGE's
        per-parameter states (:data:`LOWRANK_FIELDS`) are :func:`spread` over the model axes
        as well: replicated over ``fsdp`` they were 15.5 GB (GIFT) and 4.3 GB (PLUMAGE) per chip on
        Llama-7B.

        Args:
          path: the array's key path in its tree (``jax.tree_util`` keys; dict keys may hold
            '/'-joined parameter paths, as GIFT's per-layer states).
          shape: the array's shape.

        Returns:
          The spec, or ``None``.
        """
        tokens = _tokens(path)
        for end in range(len(tokens), 0, -1):
            for start in range(max(0, end - self._longest), end):
                hit = self._by_tokens.get(tokens[start:end])
                if hit is not None:
                    spec = like_parameter(hit[1], hit[0], tuple(shape))
                    field = tokens[start - 1] if start else None
                    name = tokens[end] if end < len(tokens) else ""
                    if field in GIFT_FIELDS and name in STATISTICS_MEMBERS:
                        spec = spread(spec, tuple(shape), self._mesh_shape)
                    elif field in LOWRANK_FIELDS and tuple(shape) != hit[0]:
                        rank = (RANK_DIMENSION[name],) if name in RANK_DIMENSION else ()
                        spec = spread(spec, tuple(shape), self._mesh_shape, rank)
                    return spec
        return None

    def block_specs(self, stacked: bool, block_key: str = "layers") -> dict[str, P]:
        """The spec of each leaf of one block of the model's stack.

        Args:
          stacked: the blocks are scanned (their leaves stacked over a leading layer axis,
            ``block_key/…``), else unrolled (``block_key/<i>/…``, alike in every block).
          block_key: the top-level key of the block stack.

        Returns:
          ``{path inside a block: spec}`` (a stacked leaf's layer axis dropped).
        """
        out: dict[str, P] = {}
        for tokens, (_, spec) in self._by_tokens.items():
            if tokens[0] != block_key or len(tokens) < 2 + (not stacked):
                continue
            inner = tokens[1:] if stacked else tokens[2:]
            out.setdefault("/".join(inner), P(*list(spec)[1:]) if stacked else spec)
        return out

    def specs(self, tree: Any) -> Any:
        """Specs of a tree of arrays (replicated where no parameter path applies).

        Args:
          tree: a pytree of arrays (or ``jax.ShapeDtypeStruct``).

        Returns:
          A tree of ``PartitionSpec`` of the same structure.
        """
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.spec_at(path, x.shape) or P(), tree)

    def local_shards(self, mesh: Mesh) -> LocalShards | None:
        """The all-reduce's :class:`~gift_jax.comm.stage.LocalShards` on ``mesh`` (``None``
        without model axes of size > 1). Manual over every model axis of the mesh, size 1
        included: a Pallas kernel must see no axis left to GSPMD.

        Args:
          mesh: the run's mesh.

        Returns:
          The :class:`~gift_jax.comm.stage.LocalShards` (this layout's :meth:`specs`), or
          ``None``.
        """
        if not model_axes(mesh):
            return None
        return LocalShards(tuple(a for a in MODEL_AXES if a in mesh.axis_names), self.specs)


def activation_axes(mesh: Mesh, rules: Mapping[str, str] = DEFAULT_RULES
                    ) -> tuple[tuple[str, str], ...]:
    """The model's activation constraints on a sharded mesh
    (:attr:`~gift_jax.models.LlamaConfig.activation_axes`): rows over ``fsdp``, heads / MLP
    hidden / vocabulary over the axes their weights use, the residual stream's ``d_model``
    whole. So every FSDP-split weight is gathered for its matmul and the activations stay
    split by rows (ZeRO-3), and tensor-parallel matmuls reduce over ``tensor`` only
    (Megatron); without them GSPMD may split the contraction over ``fsdp`` and all-reduce
    activations instead (on the 1B model, ~10× the bytes).

    Args:
      mesh: the run's mesh.
      rules: logical axis → mesh axis (``mesh.rules``).

    Returns:
      ``((logical name, mesh axis), ...)``: ``("batch", "fsdp")`` when ``fsdp`` splits the
      model, then each of ``heads``, ``kv_heads``, ``mlp``, ``vocab`` whose rule names a model
      axis of the mesh other than ``fsdp``; ``()`` on a data-parallel mesh.
    """
    axes = model_axes(mesh)
    out = [("batch", "fsdp")] if "fsdp" in axes else []
    out += [(name, rules[name]) for name in ("heads", "kv_heads", "mlp", "vocab")
            if rules.get(name) in axes and rules.get(name) != "fsdp"]
    return tuple(out)


def restrict(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with only the mesh axes in ``axes`` kept (for ``shard_map``'s specs, which
    name only its manual axes).

    Args:
      spec: a whole-mesh spec.
      axes: the mesh axes to keep.

    Returns:
      The restricted spec (an entry left without axes becomes ``None``).
    """

    def keep(entry):
        if entry is None:
            return None
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def state_specs(opt_state: Any, layout: ParamLayout, mesh: Mesh) -> Any:
    """Whole-mesh ``PartitionSpec`` tree of an (abstract) optimizer state: error-feedback
    buffers per device (:func:`gift_jax.partition_specs`), every leaf under a parameter's
    path split like it (:meth:`ParamLayout.spec_at`), the rest replicated.

    Args:
      opt_state: the optimizer state (abstract arrays suffice).
      layout: the parameters' layout.
      mesh: the run's mesh.

    Returns:
      A tree of ``PartitionSpec`` of the same structure.
    """
    axes = data_axes(mesh)
    axis = axis_name_of(axes)
    per_device = partition_specs(opt_state, axis, layout.local_shards(mesh))

    def spec(path, x, device_spec):
        if device_spec != P():
            return device_spec
        return layout.spec_at(path, x.shape) or P()

    return jax.tree_util.tree_map_with_path(spec, opt_state, per_device)


def shardings(specs: Any, mesh: Mesh) -> Any:
    """``NamedSharding`` tree of a ``PartitionSpec`` tree.

    Args:
      specs: a tree of ``PartitionSpec``.
      mesh: the mesh they name axes of.

    Returns:
      The tree of ``NamedSharding(mesh, spec)``.
    """
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda s: isinstance(s, P))


def manual_specs(specs: Any, mesh: Mesh) -> Any:
    """The ``shard_map`` specs (data axes only) of a whole-mesh spec tree.

    Args:
      specs: a tree of whole-mesh ``PartitionSpec``.
      mesh: the run's mesh (its data axes are kept).

    Returns:
      The tree of specs restricted to the data axes (:func:`restrict`).
    """
    axes = data_axes(mesh)
    return jax.tree.map(lambda s: restrict(s, axes), specs, is_leaf=lambda s: isinstance(s, P))


def shard_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays held by one device (the largest per-device total).

    Args:
      tree: a pytree of placed ``jax.Array``.

    Returns:
      The largest total over this process's devices (its addressable shards); 0 for an
      empty tree.
    """
    per_device: dict[Any, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            n = math.prod(shard.data.shape) * x.dtype.itemsize
            per_device[shard.device] = per_device.get(shard.device, 0) + n
    return max(per_device.values(), default=0)
