"""PLUMAGE / GaLore / FLORA as Optax gradient transformations with low-rank Adam moments.

One step, per projected leaf (oriented ``(batch, M, N)``, projector ``P`` ``(batch, M, k)``):

    refresh (every τ steps, or when the host says so):   SVD of the (reduced) gradient → P, D
    resample (every κ steps, PLUMAGE/FLORA only):         new S from the stored SVD → P, D
    on any change of P (if realign):                      M ← B M, V ← (B∘B) V, B = P₂ᵀ P₁
                        (B from unit-norm columns: the same for orthonormal PLUMAGE/GaLore
                        projectors, an orthogonal-projection transfer for FLORA)
                        and per-row bias-correction masses  w ← clip((B∘B) w, 0, 1)
    coordinates:        R = D⁻¹ Pᵀ G   ("before", default)   or   R = Pᵀ G   ("after")
    [communicate R across replicas]
    Adam in k×N space with per-row bias correction:       X = m̂ / (√v̂ + ε)
    back-projection:    U = scale · P X   ("before")      or   U = scale · P D⁻¹ X ("after")

Leaves that are not projected (1-D params, masked-out embeddings/heads, leaves whose rank is
at least their smaller side) get plain Adam on the full gradient.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gift_jax.batching import map_matrices_grouped
from gift_jax.comm_stage import allreduce_axis, reset_error_feedback
from gift_jax.gift import GiftState
from gift_jax.gift import leaf_path as _path_of
from gift_jax.lowrank import estimator
from gift_jax.lowrank.layout import LeafLayout, resolve_layouts

__all__ = [
    "AdaptiveRefresh",
    "PlumageState",
    "find_plumage_state",
    "plumage",
    "refresh_due",
    "scale_by_plumage",
]

STRATEGIES = ("plumage", "galore", "flora")
SCALING_POSITIONS = ("before_moments", "after_moments")


class AdaptiveRefresh(NamedTuple):
    """Adapt the refresh interval τ from the principal angles between consecutive subspaces.

    At every refresh after the first, the overlap ``ω = ‖U₂ᵀ P₁‖²_F / k`` between the old
    projector ``P₁`` and the new *dominant* rank-``k`` subspace ``U₂`` (the top-``k`` left
    singular vectors of the new gradient) is averaged over projected leaves. ``ω`` is the mean
    squared cosine of the principal angles (1: the subspace did not move; 0: orthogonal). Then

        ω ≥ high → τ ← min(2τ, max_every)      (the subspace is stable: refresh less often)
        ω < low  → τ ← max(τ // 2, min_every)  (the subspace moves: refresh more often)

    Attributes:
      min_every: smallest allowed interval (≥ 1).
      max_every: largest allowed interval (≥ min_every).
      low: overlap below which τ halves.
      high: overlap at or above which τ doubles.
    """

    min_every: int
    max_every: int
    low: float = 0.5
    high: float = 0.9


class PlumageState(NamedTuple):
    """State of :func:`scale_by_plumage`.

    Per-leaf fields are pytrees with the structure of params; ``k`` is the leaf's rank,
    ``(batch, M, N)`` its oriented matrix view (``M`` the projected side). Dense leaves hold
    full-shape moments and empty ``(0,)`` placeholders elsewhere.
    """

    count: jax.Array  # shape=(), int32: update steps taken
    key: jax.Array  # shape=(2,), uint32: sampling PRNG key (same on every replica)
    mu: Any  # per leaf, float32: (batch, k, N) projected | param shape (dense)
    nu: Any  # per leaf, float32: same shapes as mu
    mu_mass: Any  # per leaf, float32: (batch, k) per-row bias-correction mass of mu | (0,)
    nu_mass: Any  # per leaf, float32: (batch, k) per-row bias-correction mass of nu | (0,)
    projector: Any  # per leaf, float32: (batch, M, k) P | (0,)
    probs: Any  # per leaf, float32: (batch, k) p_S, the diagonal of D (ones: galore/flora) | (0,)
    basis: Any  # per leaf, float32: (batch, M, N) stored U if resample_every is set | (0,)
    spectrum: Any  # per leaf, float32: (batch, N) σ if resample_every is set | (0,)
    refresh_interval: jax.Array  # shape=(), int32: current τ (adapted by AdaptiveRefresh)
    last_refresh: jax.Array  # shape=(), int32: `count` at the last refresh attempt
    refreshes: jax.Array  # shape=(), int32: refresh attempts (including skipped leaves)
    skipped_refreshes: jax.Array  # shape=(), int32: leaf refreshes skipped (non-finite grad)
    comm_state: Any  # communicate's state for projected trees: (k, N) float32 coordinates,
    # (batch, k, N) for leaves with batch axes, dense leaves as is (EmptyState if none)
    refresh_comm_state: Any  # communicate's state for full-shaped trees (refresh steps)


class _Carry(NamedTuple):
    """The part of the state a refresh or resample may change (one lax.cond operand)."""

    key: jax.Array
    mu: Any
    nu: Any
    mu_mass: Any
    nu_mass: Any
    projector: Any
    probs: Any
    basis: Any
    spectrum: Any
    refresh_interval: jax.Array
    refreshes: jax.Array
    skipped_refreshes: jax.Array


_EMPTY = functools.partial(jnp.zeros, (0,), jnp.float32)
_is_layout = lambda x: x is None or isinstance(x, LeafLayout)


def _leaf_keys(key: jax.Array, index: int, batch: int) -> jax.Array:
    """Per-leaf, per-batch-element keys: folded by leaf index only (never by device)."""
    return jax.random.split(jax.random.fold_in(key, index), batch)


def _left_singular(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(U, σ) of the thin SVD of one (m, n) matrix."""
    u, sigma, _ = jnp.linalg.svd(g, full_matrices=False)
    return u, sigma


def _unit_columns(p: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(p, axis=-2, keepdims=True)
    return p / jnp.where(norm > 0, norm, 1.0)


# ------------------------------------------------------------- communication helpers


def _gift_states(comm_state: Any) -> list[GiftState]:
    found = jax.tree.leaves(comm_state, is_leaf=lambda x: isinstance(x, GiftState))
    return [s for s in found if isinstance(s, GiftState)]


def _gift_paths(comm_state: Any) -> tuple[str, ...]:
    """Param paths of the layers a GIFT stage inside ``communicate`` whitens (static)."""
    return tuple(sorted({p for s in _gift_states(comm_state) for p in s.stats}))


def _by_path(tree: Any, layouts: Any) -> dict[str, tuple[Any, LeafLayout | None]]:
    """``{param path: (leaf, layout)}`` with GIFT's path convention."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    lays = treedef.flatten_up_to(layouts)
    return {_path_of(p): (x, lay) for (p, x), lay in zip(flat, lays, strict=True)}


def _check_gift_layers(paths: tuple[str, ...], by_path: dict) -> None:
    """GIFT (input-side whitening with ``projected_dim=k``) can only act on leaves whose
    PLUMAGE-projected side is the input side: a (k × out) coordinate block ``R = MᵀG``."""
    for path in paths:
        x, lay = by_path[path]
        shape = tuple(jnp.shape(x))
        if lay is None:
            raise ValueError(
                f"scale_by_plumage: GIFT layer {path!r} (shape {shape}) is not projected by "
                "PLUMAGE (masked out, not a matrix, or rank >= its smaller side), so it is "
                "communicated full-width; remove it from GIFT's layers"
            )
        if lay.side != "reduction":
            raise ValueError(
                f"scale_by_plumage: PLUMAGE projects the output side of GIFT layer {path!r} "
                f"(shape {shape}, in < out); GIFT whitens the input side, so only layers whose "
                "input side is the projected (larger) one can be whitened (e.g. down_proj)"
            )
        if lay.batched:
            raise ValueError(
                f"scale_by_plumage: GIFT layer {path!r} (shape {shape}) has batch axes; "
                "PLUMAGE + GIFT supports plain (in × out) kernels only"
            )


def _size_gift_stats(comm_state: Any, by_path: dict) -> Any:
    """GIFT's EMA of ``A = E[xxᵀ]`` lives in the layer's own input coordinates (``n × n``,
    the projection ``M`` is applied when the factor is built), but ``communicate.init`` only
    sees the ``(k, N)`` coordinates, so its statistics come out ``k × k``: resize them."""

    def fix(node):
        if not isinstance(node, GiftState):
            return node
        stats = {}
        for path, a in node.stats.items():
            n = by_path[path][1].m
            stats[path] = jnp.zeros((a.shape[0], n, n), a.dtype)
        return node._replace(stats=stats)

    return jax.tree.map(fix, comm_state, is_leaf=lambda x: isinstance(x, GiftState))


def _validate(
    rank, refresh_every, resample_every, strategy, scaling, b1, b2, adaptive, communicate
):
    if isinstance(rank, bool) or (isinstance(rank, int) and rank < 1):
        raise ValueError(f"rank must be an int >= 1 (or a per-leaf tree/callable), got {rank!r}")
    if not isinstance(refresh_every, int) or isinstance(refresh_every, bool) or refresh_every < 1:
        raise ValueError(f"refresh_every must be an int >= 1, got {refresh_every!r}")
    bad_kappa = not isinstance(resample_every, int) or isinstance(resample_every, bool)
    if resample_every is not None and (bad_kappa or resample_every < 1):
        raise ValueError(f"resample_every must be None or an int >= 1, got {resample_every!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if resample_every is not None and strategy == "galore":
        raise ValueError(
            "resample_every applies to strategy 'plumage' or 'flora'; GaLore's top-k "
            "projector is deterministic, got strategy='galore'"
        )
    if scaling not in SCALING_POSITIONS:
        raise ValueError(f"unbiased_scaling must be one of {SCALING_POSITIONS}, got {scaling!r}")
    for name, b in (("b1", b1), ("b2", b2)):
        if isinstance(b, (int, float)) and not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b!r}")
    if adaptive is not None:
        if not isinstance(adaptive, AdaptiveRefresh):
            raise TypeError(
                f"adaptive_refresh must be an AdaptiveRefresh or None, got {adaptive!r}"
            )
        if strategy == "flora":
            raise ValueError(
                "adaptive_refresh needs an SVD subspace; it is not defined for strategy='flora'"
            )
        if not 1 <= adaptive.min_every <= refresh_every <= adaptive.max_every:
            raise ValueError(
                "adaptive_refresh must satisfy 1 <= min_every <= refresh_every <= max_every, got "
                f"min_every={adaptive.min_every}, refresh_every={refresh_every}, "
                f"max_every={adaptive.max_every}"
            )
        if not 0.0 <= adaptive.low <= adaptive.high <= 1.0:
            raise ValueError(
                f"adaptive_refresh needs 0 <= low <= high <= 1, got {adaptive.low}, {adaptive.high}"
            )
    if communicate is not None and not isinstance(communicate, optax.GradientTransformation):
        raise TypeError(
            f"communicate must be an optax.GradientTransformation or None, got {communicate!r}"
        )


def scale_by_plumage(
    rank: int | Any = 128,
    refresh_every: int = 200,
    *,
    strategy: str = "plumage",
    resample_every: int | None = None,
    realign: bool = True,
    unbiased_scaling: str = "before_moments",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    scale: float = 1.0,
    seed: int = 0,
    weight_dimension_numbers: Any = None,
    mask: Any = None,
    adaptive_refresh: AdaptiveRefresh | None = None,
    communicate: optax.GradientTransformation | None = None,
    axis_name: Any = None,
    communicate_refresh: optax.GradientTransformation | None = None,
    distribute_refresh: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Low-rank projected Adam (PLUMAGE, GaLore or FLORA projector); no learning rate.

    PLUMAGE (arXiv 2505.18313) keeps Adam's moments in a rank-``k`` subspace like GaLore, but
    samples the subspace so that the projected gradient is an *unbiased* minimum-variance
    estimate of the full gradient, ``E[P D⁻¹ Pᵀ G] = G``, and carries the moments across
    subspace changes (``M ← B M``, ``V ← (B∘B) V``, ``B = P₂ᵀ P₁``).

    Where ``D⁻¹`` enters (``unbiased_scaling``):
      * ``"before_moments"`` (default): the moments track ``R = D⁻¹ Pᵀ G``, the coordinates of
        the unbiased estimate ``Ĝ = P R``; ``m`` is then an unbiased estimate of the projected
        momentum of ``G`` and both moments live in one consistent coordinate system, so the
        realignment ``B`` (which mixes rows sampled with different ``p``) is meaningful. Within
        one subspace Adam's per-coordinate normalisation cancels the row scaling (except for
        ``ε``), so the step size stays bounded even for rarely-sampled directions.
      * ``"after_moments"``: the moments track the plain projection ``Pᵀ G`` (GaLore's
        quantity, no amplified variance in ``v``) and the normalised step is scaled by
        ``D⁻¹``: a Horvitz–Thompson correction of the *step*, which makes the expected update
        over the draw of ``S`` cover every direction, at the price of ``1/p``-times larger steps
        along rarely-sampled directions.

    Refresh scheduling: by default (``plumage_refresh`` not passed to ``update``) a refresh
    happens under ``lax.cond`` when ``count − last_refresh ≥ τ`` (so at counts 0, τ, 2τ, …
    like ``optax.contrib.galore``). Passing ``plumage_refresh=True/False`` (a Python bool) to
    ``update`` makes the choice static: the ``False`` variant contains no SVD and no full-size
    collective, so a trainer compiles a refresh variant and an ordinary variant; use
    :func:`refresh_due` on the state to decide on the host. Resampling (``resample_every``)
    always runs under ``lax.cond`` since it needs no gradient and no collective.

    Communication (``communicate``, e.g. a quantized all-reduce stage inside ``shard_map``):
    on ordinary steps only the projected float32 coordinates, shape ``(k, N)`` (``(batch, k,
    N)`` for leaves with batch axes; ``N`` is the unprojected side, see ``LeafLayout.side``),
    and the full gradients of dense leaves go through ``communicate.update``; on refresh
    steps the *full* gradient tree goes through ``communicate`` (with a second state slot,
    ``refresh_comm_state``, initialised from param-shaped zeros, because a stateful stage
    such as error feedback needs state shaped like its input), the SVD is taken of the
    reduced gradient so every replica computes the identical projector, and the reduced
    gradient is projected locally (no second collective). FLORA's projector does not
    depend on the gradient, but its refresh steps still reduce the full tree so that every
    strategy has the same step structure.
    ``communicate`` requires the static ``plumage_refresh`` (collectives of different shapes
    cannot share one ``lax.cond``). Extra keyword args other than ``plumage_refresh`` (and
    ``gift_stats``, see below) are passed to ``communicate.update``. ``communicate_refresh``
    (default: ``communicate``) reduces the full gradient on refresh steps instead.

    Error feedback across projection changes: the error-feedback buffers of the projected
    communication (every :class:`gift_jax.AllReduceState` in ``comm_state``) hold the
    unsent part ``e`` of ``R₁ = D₁⁻¹P₁ᵀG`` in the old coordinates; carried into ``R₂`` it
    would apply ``P₂D₂e`` instead of ``P₁D₁e``. They are therefore zeroed on every refresh
    step (statically) and on every κ-resample (``jnp.where`` on the ``lax.cond`` flag), so
    at most one step's quantization error of the communicated ``(k, N)`` tree (and of the
    dense leaves sharing its buckets) is dropped per projection change; between changes
    error feedback works as usual. Not flushed into the full gradient of the refresh step:
    ``e`` would map to ``P₁D₁e`` (``P₁e`` for ``"after_moments"``) only for the replica's own
    leaf-shaped residual; the shard owner's re-quantization residual is packed per bucket
    (rows of several leaves, one shard per replica), and inside GIFT both are in whitened
    coordinates ``W·R``. A refresh resets even when a leaf's refresh was skipped for a
    non-finite gradient (such a step is normally skipped as a whole by the trainer).

    GIFT composition: ``communicate`` may contain ``gift_jax.gift(inner, layers,
    projected_dim=k)``, which whitens a coordinate block ``R = MᵀG`` (``M = P·D⁻¹``, ``n × k``,
    or ``M = P`` for ``"after_moments"``) with the factor of ``MᵀAM``, ``A = E[xxᵀ]`` of the
    layer input. Its layers must be projected by PLUMAGE on their input side (Flax kernels
    are ``(in, out)``: ``down_proj``'s ``d_ff`` side, not ``up_proj``'s) as plain 2-D
    kernels (``ValueError`` naming the layer otherwise), and ``communicate_refresh`` must be
    given (a GIFT stage with ``projected_dim`` cannot reduce full-width gradients). Refresh
    steps then need ``gift_stats={path: A}`` (local means, as
    :func:`gift_jax.capture.with_input_stats` returns) and ``params``; after the new
    projection is installed, ``communicate`` is called once on zero coordinates with
    ``gift_stats`` and ``gift_projection={path: M}`` so that GIFT rebuilds its factors for the
    new ``M``; with the residuals just zeroed this sends exact zeros (one ``(k, N)``
    collective plus GIFT's statistics ``pmean``) and its output is discarded. κ-resampling
    changes ``M`` without new statistics: the whitening stays exact (``W⁻¹W = I``) but uses
    the previous ``M``'s factor until the next refresh.

    Args:
      rank: projection rank ``k``; an int, or a pytree of ints / callable (per-leaf rank).
        A leaf whose smaller side is ``<= k`` is kept dense (the projection would be exact).
      refresh_every: SVD refresh interval τ (steps).
      strategy: ``"plumage"`` (sampled singular vectors, ``D = diag(p_S)``), ``"galore"``
        (top-``k`` singular vectors, ``D = I``) or ``"flora"`` (Gaussian ``N(0, 1/k)``
        projection redrawn at each refresh, ``D = I``).
      resample_every: if set, redraw ``S`` every κ steps from the stored SVD without
        recomputing it (PLUMAGE; stores ``U``, an ``M×N`` array per leaf) or redraw the
        Gaussian (FLORA). ``None``: only at refreshes.
      realign: realign moments on every projection change (``False``: keep them as they are,
        like GaLore; per-row bias correction then uses the global step count).
      unbiased_scaling: ``"before_moments"`` or ``"after_moments"`` (see above).
      b1, b2, eps, eps_root: Adam hyperparameters (as ``optax.scale_by_adam``).
      scale: GaLore's ``α``, multiplies the updates of projected leaves only.
      seed: seed of the sampling key kept in state (identical on all replicas).
      weight_dimension_numbers: how leaves are viewed as matrices, see
        :func:`gift_jax.lowrank.layout.resolve_layouts`.
      mask: pytree of bools or callable: which leaves to project (e.g.
        :func:`mask_excluding` ``("embed", "head")``).
      adaptive_refresh: optional :class:`AdaptiveRefresh` rule for τ.
      communicate: optional cross-replica reduction stage (see above).
      axis_name: the data-parallel axis (or tuple) of ``communicate``.  On refresh steps
        with ``communicate`` the reduced gradient is identical on every replica, so the
        per-layer SVDs are spread over this axis (each replica decomposes ~1/R of the
        layers, the factors are all-gathered: :func:`gift_jax.batching.map_matrices_grouped`)
        instead of every replica computing every SVD.  ``None``: the axis of the refresh
        stage when it is a :func:`gift_jax.allreduce` stage, else no spreading.
      distribute_refresh: ``False`` turns the spreading off (every replica computes every
        SVD; for measuring the difference).
      communicate_refresh: the stage that reduces the full gradient on refresh steps
        (default ``communicate``); required when ``communicate`` contains a GIFT stage.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`PlumageState`.
    """
    _validate(
        rank,
        refresh_every,
        resample_every,
        strategy,
        unbiased_scaling,
        b1,
        b2,
        adaptive_refresh,
        communicate,
    )
    comm = None if communicate is None else optax.with_extra_args_support(communicate)
    if communicate_refresh is not None:
        if communicate is None:
            raise ValueError("communicate_refresh needs communicate (the projected stage)")
        if not isinstance(communicate_refresh, optax.GradientTransformation):
            raise TypeError(
                "communicate_refresh must be an optax.GradientTransformation or None, got "
                f"{communicate_refresh!r}"
            )
    full_stage = communicate if communicate_refresh is None else communicate_refresh
    comm_refresh = None if comm is None else optax.with_extra_args_support(full_stage)
    if axis_name is None and communicate is not None:
        axis_name = allreduce_axis(full_stage)
    if not distribute_refresh:
        axis_name = None
    keep_basis = resample_every is not None and strategy == "plumage"
    scale_before = unbiased_scaling == "before_moments"

    def layouts_of(tree):
        return resolve_layouts(tree, rank, weight_dimension_numbers, mask)

    def _flat(tree, layouts):
        leaves, treedef = jax.tree.flatten(tree)
        return leaves, treedef.flatten_up_to(layouts), treedef

    # -------------------------------------------------------------------- communication
    def _init_projected_comm(coords, params, layouts):
        """``communicate``'s state for the ``(k, N)`` coordinate tree (GIFT checked/sized)."""
        comm_state = comm.init(coords)
        paths = _gift_paths(comm_state)
        if not paths:
            return comm_state
        if communicate_refresh is None:
            raise ValueError(
                "scale_by_plumage: communicate contains a GIFT stage (projected_dim=k), which "
                "cannot reduce the full-width gradients of refresh steps; pass "
                "communicate_refresh= (e.g. the plain all-reduce chain)"
            )
        by_path = _by_path(params, layouts)
        _check_gift_layers(paths, by_path)
        return _size_gift_stats(comm_state, by_path)

    def _zero_coords(updates, layouts):
        """Zeros shaped like the tree ``communicate`` sees: ``(k, N)`` coordinates, dense
        leaves as they are."""
        leaves, lays, treedef = _flat(updates, layouts)
        return jax.tree.unflatten(treedef, [
            jnp.zeros_like(x) if lay is None else jnp.zeros(lay.coord_shape, jnp.float32)
            for x, lay in zip(leaves, lays, strict=True)
        ])

    def _pop_gift_stats(comm_state, plumage_refresh, params, extra_args):
        """``gift_stats`` for a GIFT stage in ``communicate``: required (with ``params``) on
        refresh steps (its factor ``MᵀAM`` must follow the new ``M``), refused otherwise."""
        if comm is None or not _gift_paths(comm_state):
            return None
        stats = extra_args.pop("gift_stats", None)
        if plumage_refresh and stats is None:
            raise ValueError(
                "scale_by_plumage: communicate contains a GIFT stage; refresh steps "
                "(plumage_refresh=True) need gift_stats={path: E[xxᵀ]} of its layers"
            )
        if not plumage_refresh and stats is not None:
            raise ValueError(
                "scale_by_plumage: gift_stats is only accepted on refresh steps "
                "(plumage_refresh=True), when the projection and GIFT's factors change"
            )
        if plumage_refresh and params is None:
            raise ValueError(
                "scale_by_plumage: a GIFT stage in communicate needs params in update() on "
                "refresh steps (its statistics are in the params' coordinates)"
            )
        return stats

    def _gift_projection(paths, carry: _Carry) -> dict[str, jax.Array]:
        """``{path: M}`` with ``R = MᵀG``: ``M = P·D⁻¹`` (``"before_moments"``) or ``P``,
        ``(n, k)`` per GIFT layer (plain 2-D kernels, projected on their input side)."""
        proj = {_path_of(p): x for p, x in jax.tree_util.tree_flatten_with_path(
            carry.projector)[0]}
        probs = {_path_of(p): x for p, x in jax.tree_util.tree_flatten_with_path(
            carry.probs)[0]}
        out = {}
        for path in paths:
            m = proj[path] / probs[path][:, None, :] if scale_before else proj[path]
            out[path] = m[0]
        return out

    def _refresh_gift(comm_state, carry, coords_like, params, gift_stats, extra_args):
        """Rebuild GIFT's factors for the new projection: one call of ``communicate`` on
        zero coordinates with ``gift_stats`` and ``gift_projection`` (output discarded;
        with zeroed residuals it sends exact zeros)."""
        paths = _gift_paths(comm_state)
        zeros = jax.tree.map(jnp.zeros_like, coords_like)
        _, comm_state = comm.update(
            zeros, comm_state, params, gift_stats=gift_stats,
            gift_projection=_gift_projection(paths, carry), **extra_args,
        )
        return comm_state

    # ----------------------------------------------------------------------------- init
    def init_fn(params):
        if not jax.tree.leaves(params):  # e.g. optax.tree.map_params' placeholder
            empty = optax.EmptyState() if comm is None else comm.init(params)
            z = jnp.zeros([], jnp.int32)
            return PlumageState(
                count=z,
                key=jax.random.PRNGKey(seed),
                mu=params,
                nu=params,
                mu_mass=params,
                nu_mass=params,
                projector=params,
                probs=params,
                basis=params,
                spectrum=params,
                refresh_interval=jnp.asarray(refresh_every, jnp.int32),
                last_refresh=z,
                refreshes=z,
                skipped_refreshes=z,
                comm_state=empty,
                refresh_comm_state=empty if comm is None else comm_refresh.init(params),
            )
        layouts = layouts_of(params)
        leaves, lays, treedef = _flat(params, layouts)
        mu, mass, proj, probs, basis, spec, comm_shaped = [], [], [], [], [], [], []
        for x, lay in zip(leaves, lays, strict=True):
            if lay is None:
                mu.append(jnp.zeros(x.shape, jnp.float32))
                mass.append(_EMPTY())
                proj.append(_EMPTY())
                probs.append(_EMPTY())
                basis.append(_EMPTY())
                spec.append(_EMPTY())
                comm_shaped.append(jnp.zeros(x.shape, x.dtype))
                continue
            b, m, n, k = lay.batch, lay.m, lay.n, lay.rank
            mu.append(jnp.zeros(lay.moment_shape, jnp.float32))
            mass.append(jnp.zeros((b, k), jnp.float32))
            # Before the first refresh: coordinate axes (a sane orthonormal P, D = I).
            proj.append(jnp.broadcast_to(jnp.eye(m, k, dtype=jnp.float32), (b, m, k)))
            probs.append(jnp.ones((b, k), jnp.float32))
            if keep_basis:
                basis.append(jnp.broadcast_to(jnp.eye(m, n, dtype=jnp.float32), (b, m, n)))
                spec.append(jnp.zeros((b, n), jnp.float32))
            else:
                basis.append(_EMPTY())
                spec.append(_EMPTY())
            comm_shaped.append(jnp.zeros(lay.coord_shape, jnp.float32))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        z = jnp.zeros([], jnp.int32)
        if comm is None:
            comm_state = refresh_comm_state = optax.EmptyState()
        else:
            comm_state = _init_projected_comm(unflat(comm_shaped), params, layouts)
            refresh_comm_state = comm_refresh.init(jax.tree.map(jnp.zeros_like, params))
        return PlumageState(
            count=z,
            key=jax.random.PRNGKey(seed),
            mu=unflat(mu),
            nu=unflat([jnp.zeros_like(x) for x in mu]),
            mu_mass=unflat(mass),
            nu_mass=unflat([jnp.zeros_like(x) for x in mass]),
            projector=unflat(proj),
            probs=unflat(probs),
            basis=unflat(basis),
            spectrum=unflat(spec),
            refresh_interval=jnp.asarray(refresh_every, jnp.int32),
            last_refresh=z,
            refreshes=z,
            skipped_refreshes=z,
            comm_state=comm_state,
            refresh_comm_state=refresh_comm_state,
        )

    # ------------------------------------------------------------------ projection changes
    def _change_projection(lay, carry_leaf, new_proj, new_probs, accept):
        """Install (new_proj, new_probs) where ``accept`` (per batch element), realigning."""
        mu, nu, mm, nm, old_proj, old_probs = carry_leaf
        sel = lambda a, new, old: jnp.where(a.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        proj = sel(accept, new_proj, old_proj)
        probs = sel(accept, new_probs, old_probs)
        if realign:
            # B = P₂ᵀ P₁ on unit-norm columns: identical for the orthonormal PLUMAGE/GaLore
            # projectors; for FLORA's Gaussian P it transfers the orthogonal projection of the
            # moment (P₂ᵀ P₁ itself has norm ~ M/k and blows moments up when resampled often).
            b = jnp.einsum("bmi,bmj->bij", _unit_columns(proj), _unit_columns(old_proj))
            mu2, nu2 = jax.vmap(estimator.realign_moments)(b, mu, nu)
            mm2 = jax.vmap(estimator.transfer_bias_mass)(b, mm)
            nm2 = jax.vmap(estimator.transfer_bias_mass)(b, nm)
            mu, nu = sel(accept, mu2, mu), sel(accept, nu2, nu)
            mm, nm = sel(accept, mm2, mm), sel(accept, nm2, nm)
        return mu, nu, mm, nm, proj, probs

    def _new_projector(key, lay, u, sigma):
        keys = _leaf_keys(key, 0, lay.batch)
        if strategy == "plumage":
            fn = functools.partial(estimator.plumage_projector, k=lay.rank)
            return jax.vmap(fn)(keys, u, sigma)
        if strategy == "galore":
            return jax.vmap(functools.partial(estimator.galore_projector, k=lay.rank))(u)
        fn = functools.partial(estimator.flora_projector, m=lay.m, k=lay.rank)
        return jax.vmap(fn)(keys)

    def _refresh(grads, carry: _Carry, layouts, axis=None) -> _Carry:
        """New projections from ``grads``; the SVDs are spread over ``axis`` when given (the
        reduced gradient is then identical on every replica; see gift_jax.batching)."""
        key, sub = jax.random.split(carry.key)
        leaves, lays, treedef = _flat(grads, layouts)
        fields = [treedef.flatten_up_to(f) for f in carry[1:9]]
        outs = [list(f) for f in fields]
        skipped = carry.skipped_refreshes
        overlaps = []
        mats, svds = {}, {}
        if strategy != "flora":
            for i, (g, lay) in enumerate(zip(leaves, lays, strict=True)):
                if lay is not None:
                    gm = lay.to_matrix(g).astype(jnp.float32)
                    accept = jnp.all(jnp.isfinite(gm), axis=(1, 2))
                    mats[i] = (jnp.where(accept[:, None, None], gm, 0.0), accept)
            svds = map_matrices_grouped(
                _left_singular, {i: (gm,) for i, (gm, _) in mats.items()}, axis)
        for i, lay in enumerate(lays):
            if lay is None:
                continue
            mu, nu, mm, nm, proj, probs, basis, spec = (f[i] for f in fields)
            leaf_key = jax.random.fold_in(sub, i)
            if strategy == "flora":
                accept = jnp.ones((lay.batch,), bool)
                new_proj, new_probs = _new_projector(leaf_key, lay, None, None)
            else:
                accept = mats[i][1]
                u, sigma = svds[i]
                new_proj, new_probs = _new_projector(leaf_key, lay, u, sigma)
                if adaptive_refresh is not None:
                    top = u[..., : lay.rank]
                    ov = jax.vmap(estimator.projector_overlap)(top, proj)
                    w = accept.astype(jnp.float32)
                    overlaps.append((jnp.sum(ov * w), jnp.sum(w)))
                if keep_basis:
                    outs[6][i] = jnp.where(accept[:, None, None], u, basis)
                    outs[7][i] = jnp.where(accept[:, None], sigma, spec)
            skipped = skipped + jnp.sum(~accept).astype(jnp.int32)
            old = (mu, nu, mm, nm, proj, probs)
            res = _change_projection(lay, old, new_proj, new_probs, accept)
            for j in range(6):
                outs[j][i] = res[j]
        interval = carry.refresh_interval
        if adaptive_refresh is not None and overlaps:
            total = sum(o for o, _ in overlaps)
            weight = sum(w for _, w in overlaps)
            omega = total / jnp.maximum(weight, 1.0)
            a = adaptive_refresh
            grown = jnp.minimum(2 * interval, a.max_every)
            shrunk = jnp.maximum(interval // 2, a.min_every)
            adapted = jnp.where(omega >= a.high, grown, jnp.where(omega < a.low, shrunk, interval))
            interval = jnp.where((carry.refreshes > 0) & (weight > 0), adapted, interval)
            interval = interval.astype(jnp.int32)
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        return _Carry(
            key,
            *(unflat(o) for o in outs),
            refresh_interval=interval,
            refreshes=carry.refreshes + 1,
            skipped_refreshes=skipped,
        )

    def _resample(carry: _Carry, layouts) -> _Carry:
        key, sub = jax.random.split(carry.key)
        treedef = jax.tree.structure(layouts, is_leaf=_is_layout)
        lays = treedef.flatten_up_to(layouts)
        fields = [treedef.flatten_up_to(f) for f in carry[1:9]]
        outs = [list(f) for f in fields]
        for i, lay in enumerate(lays):
            if lay is None:
                continue
            mu, nu, mm, nm, proj, probs, basis, spec = (f[i] for f in fields)
            new_proj, new_probs = _new_projector(jax.random.fold_in(sub, i), lay, basis, spec)
            accept = jnp.ones((lay.batch,), bool)
            old = (mu, nu, mm, nm, proj, probs)
            res = _change_projection(lay, old, new_proj, new_probs, accept)
            for j in range(6):
                outs[j][i] = res[j]
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        changed = dict(zip(_Carry._fields[1:9], map(unflat, outs), strict=True))
        return carry._replace(key=key, **changed)

    # ----------------------------------------------------------------------------- update
    def update_fn(updates, state: PlumageState, params=None, **extra_args):
        plumage_refresh = extra_args.pop("plumage_refresh", None)
        if plumage_refresh is not None and not isinstance(plumage_refresh, bool):
            raise TypeError(
                "plumage_refresh must be a Python bool (static at trace time) or absent, got "
                f"{type(plumage_refresh).__name__}; compile one variant per value"
            )
        if comm is not None and plumage_refresh is None:
            raise ValueError(
                "scale_by_plumage(communicate=...) needs the static keyword "
                "plumage_refresh=True/False in update(): collectives of different shapes "
                "cannot live in lax.cond branches (use refresh_due(state) on the host)"
            )
        gift_stats = _pop_gift_stats(state.comm_state, plumage_refresh, params, extra_args)
        layouts = layouts_of(updates)
        count = state.count
        carry = _Carry(
            state.key,
            state.mu,
            state.nu,
            state.mu_mass,
            state.nu_mass,
            state.projector,
            state.probs,
            state.basis,
            state.spectrum,
            state.refresh_interval,
            state.refreshes,
            state.skipped_refreshes,
        )
        grads = updates
        comm_state, refresh_comm_state = state.comm_state, state.refresh_comm_state
        reduced = False
        if plumage_refresh is None:
            refreshed = (count - state.last_refresh >= state.refresh_interval) | (
                state.refreshes == 0
            )
            carry = jax.lax.cond(
                refreshed, lambda c: _refresh(grads, c, layouts), lambda c: c, carry
            )
        elif plumage_refresh:
            refreshed = True
            if comm is not None:
                grads, refresh_comm_state = comm_refresh.update(
                    grads, refresh_comm_state, **extra_args
                )
                reduced = True
            carry = _refresh(grads, carry, layouts, axis_name if comm is not None else None)
            if comm is not None:  # new projection: old-coordinate residuals are meaningless
                comm_state = reset_error_feedback(comm_state)
            if gift_stats is not None:
                coords_like = _zero_coords(updates, layouts)
                comm_state = _refresh_gift(
                    comm_state, carry, coords_like, params, gift_stats, extra_args
                )
        else:
            refreshed = False
        last_refresh = jnp.where(refreshed, count, state.last_refresh).astype(jnp.int32)

        if resample_every is not None:
            due = (count % resample_every == 0) & jnp.logical_not(refreshed)
            carry = jax.lax.cond(due, lambda c: _resample(c, layouts), lambda c: c, carry)
            if comm is not None:
                comm_state = reset_error_feedback(comm_state, due)

        leaves, lays, treedef = _flat(grads, layouts)
        proj = treedef.flatten_up_to(carry.projector)
        probs = treedef.flatten_up_to(carry.probs)

        def coords(g, lay, p, d):
            if lay is None:
                return g
            r = jnp.einsum("bmk,bmn->bkn", p, lay.to_matrix(g).astype(jnp.float32))
            return r / d[..., None] if scale_before else r

        coord = [coords(*a) for a in zip(leaves, lays, proj, probs, strict=True)]
        if comm is not None and not reduced:
            to_comm = [r if lay is None else r.reshape(lay.coord_shape) for r, lay in zip(
                coord, lays, strict=True)]
            coord_tree, comm_state = comm.update(
                jax.tree.unflatten(treedef, to_comm), comm_state, **extra_args
            )
            coord = [r if lay is None else r.reshape(lay.moment_shape) for r, lay in zip(
                treedef.flatten_up_to(coord_tree), lays, strict=True)]

        count_inc = optax.safe_int32_increment(count)
        bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** count_inc
        bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count_inc
        mus, nus, mms, nms, outs = [], [], [], [], []
        flat = lambda t: treedef.flatten_up_to(t)
        for g, r, lay, mu, nu, mm, nm, p, d in zip(
            leaves,
            coord,
            lays,
            flat(carry.mu),
            flat(carry.nu),
            flat(carry.mu_mass),
            flat(carry.nu_mass),
            proj,
            probs,
            strict=True,
        ):
            r = r.astype(jnp.float32)
            mu = (1 - b1) * r + b1 * mu
            nu = (1 - b2) * jnp.square(r) + b2 * nu
            if lay is None:
                x = (mu / bc1) / (jnp.sqrt(nu / bc2 + eps_root) + eps)
                out = x
            else:
                mm = (1 - b1) + b1 * mm
                nm = (1 - b2) + b2 * nm
                c1 = mm[..., None] if realign else bc1
                c2 = nm[..., None] if realign else bc2
                x = (mu / c1) / (jnp.sqrt(nu / c2 + eps_root) + eps)
                if not scale_before:
                    x = x / d[..., None]
                out = lay.from_matrix(scale * jnp.einsum("bmk,bkn->bmn", p, x))
            mus.append(mu)
            nus.append(nu)
            mms.append(mm)
            nms.append(nm)
            outs.append(out.astype(g.dtype))
        unflat = lambda xs: jax.tree.unflatten(treedef, xs)
        new_state = PlumageState(
            count=count_inc,
            key=carry.key,
            mu=unflat(mus),
            nu=unflat(nus),
            mu_mass=unflat(mms),
            nu_mass=unflat(nms),
            projector=carry.projector,
            probs=carry.probs,
            basis=carry.basis,
            spectrum=carry.spectrum,
            refresh_interval=carry.refresh_interval,
            last_refresh=last_refresh,
            refreshes=carry.refreshes,
            skipped_refreshes=carry.skipped_refreshes,
            comm_state=comm_state,
            refresh_comm_state=refresh_comm_state,
        )
        return unflat(outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def plumage(
    learning_rate: optax.ScalarOrSchedule,
    rank: int | Any = 128,
    refresh_every: int = 200,
    weight_decay: float = 0.0,
    *,
    weight_decay_mask: Any = None,
    strategy: str = "plumage",
    resample_every: int | None = None,
    realign: bool = True,
    unbiased_scaling: str = "before_moments",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    scale: float = 1.0,
    seed: int = 0,
    weight_dimension_numbers: Any = None,
    mask: Any = None,
    adaptive_refresh: AdaptiveRefresh | None = None,
    communicate: optax.GradientTransformation | None = None,
    axis_name: Any = None,
    communicate_refresh: optax.GradientTransformation | None = None,
    distribute_refresh: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """PLUMAGE-Adam(W): :func:`scale_by_plumage` → decoupled weight decay → learning rate.

    Weight decay is applied in the full parameter space (as ``optax.contrib.galore``). Works
    with ``optax.inject_hyperparams(plumage, static_args=("rank", "refresh_every", ...))``:
    the integer settings (``rank``, ``refresh_every``, ``resample_every``) fix shapes and
    schedules and must be static; ``learning_rate``, ``weight_decay``, ``b1``, ``b2``,
    ``eps`` and ``scale`` may be injected. With bf16 params pass
    ``hyperparam_dtype=jnp.float32`` to ``inject_hyperparams``: ``b2 = 0.999`` rounds to 1.0
    in bf16, which would zero Adam's second moment (true of ``optax.adam`` as well).

    Args:
      learning_rate: float or ``optax`` schedule.
      rank: projection rank (int or per-leaf tree/callable).
      refresh_every: SVD refresh interval τ.
      weight_decay: decoupled weight decay coefficient.
      weight_decay_mask: optax mask (tree or callable) for weight decay.
      strategy, resample_every, realign, unbiased_scaling, b1, b2, eps, eps_root, scale, seed,
      weight_dimension_numbers, mask, adaptive_refresh, communicate, communicate_refresh,
      axis_name, distribute_refresh: see :func:`scale_by_plumage`.
    """
    return optax.chain(
        scale_by_plumage(
            rank,
            refresh_every,
            strategy=strategy,
            resample_every=resample_every,
            realign=realign,
            unbiased_scaling=unbiased_scaling,
            b1=b1,
            b2=b2,
            eps=eps,
            eps_root=eps_root,
            scale=scale,
            seed=seed,
            weight_dimension_numbers=weight_dimension_numbers,
            mask=mask,
            adaptive_refresh=adaptive_refresh,
            communicate=communicate,
            axis_name=axis_name,
            communicate_refresh=communicate_refresh,
            distribute_refresh=distribute_refresh,
        ),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def find_plumage_state(opt_state: Any) -> PlumageState:
    """The (first) :class:`PlumageState` inside a possibly nested optimizer state."""
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, PlumageState))
        if isinstance(s, PlumageState)
    ]
    if not found:
        raise ValueError("no PlumageState found in the optimizer state")
    return found[0]


def refresh_due(opt_state: Any) -> jax.Array:
    """Whether the next update should refresh (host-side scheduling for ``plumage_refresh``).

    True before the first refresh and once ``count − last_refresh ≥ refresh_interval`` (the
    interval the :class:`AdaptiveRefresh` rule maintains, if any). Returns a bool array; call
    ``bool(...)`` on the host.
    """
    s = find_plumage_state(opt_state)
    return (s.count - s.last_refresh >= s.refresh_interval) | (s.refreshes == 0)

