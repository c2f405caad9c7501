"""PLUMAGE / GaLore / FLORA as Optax gradient transformations with low-rank Adam moments.

One step, per projected leaf (oriented ``(batch, M, N)``, projector ``P`` ``(batch, M, k)``)::

    refresh (every τ steps, or when the host says so):   SVD of the (reduced) gradient → P, D
    resample (every κ steps, PLUMAGE/FLORA only):         new S from the stored SVD → P, D
    on any change of P (if realign):                      M ← B M, V ← (B∘B) V, B = P₂ᵀ P₁
                                                          w ← clip((B∘B) w, 0, 1)
    coordinates:        R = D⁻¹ Pᵀ G   ("before", default)   or   R = Pᵀ G   ("after")
    [communicate R across replicas]
    Adam in k×N space with per-row bias correction:       X = m̂ / (√v̂ + ε)
    back-projection:    U = scale · P X   ("before")      or   U = scale · P D⁻¹ X ("after")

Leaves that are not projected (1-D params, masked-out embeddings/heads, leaves whose rank is
at least their smaller side) get plain Adam on the full gradient. PLUMAGE: arXiv 2505.18313;
design notes: docs/ARCHITECTURE.md, "PLUMAGE transform".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gift_jax.comm.overlap import AroundAllReduce, Frame
from gift_jax.comm.stage import allreduce_axis, reset_error_feedback
from gift_jax.lowrank import estimator
from gift_jax.lowrank.views import LeafLayout, resolve_layouts
from gift_jax.utils.axes import cond, require_per_device
from gift_jax.utils.linalg import map_matrices_grouped
from gift_jax.utils.tree_paths import leaf_path

__all__ = [
    "AdaptiveRefresh",
    "LeafState",
    "PlumageState",
    "PlumageTransformation",
    "ProjectionAroundAllReduce",
    "find_plumage_state",
    "plumage",
    "refresh_due",
    "scale_by_plumage",
]

STRATEGIES = ("plumage", "galore", "flora")
SCALING_POSITIONS = ("before_moments", "after_moments")


class AdaptiveRefresh(NamedTuple):
    """Adapt the refresh interval τ from the overlap of consecutive subspaces (see
    :func:`adapt_interval`): ``ω ≥ high`` doubles τ (up to ``max_every``), ``ω < low`` halves
    it (down to ``min_every``)."""

    min_every: int  # smallest allowed interval (>= 1)
    max_every: int  # largest allowed interval (>= min_every)
    low: float = 0.5  # overlap below which τ halves
    high: float = 0.9  # overlap at or above which τ doubles


class LeafState(NamedTuple):
    """Per-leaf state. ``(batch, M, N)``: the leaf's oriented matrix view (``M`` the projected
    side), ``k`` its rank. A dense leaf keeps full-shape moments and ``(0,)`` placeholders."""

    projector: jax.Array  # f32 (batch, M, k): P | (0,)
    probs: jax.Array  # f32 (batch, k): p_S, the diagonal of D (ones: galore/flora) | (0,)
    basis: jax.Array  # f32 (batch, M, N): stored U, PLUMAGE with resample_every | (0,)
    spectrum: jax.Array  # f32 (batch, N): stored σ, PLUMAGE with resample_every | (0,)
    mu: jax.Array  # f32 (batch, k, N): first moment of R | param shape (dense)
    nu: jax.Array  # f32 same shape as mu: second moment
    mu_mass: jax.Array  # f32 (batch, k): per-row bias-correction mass 1 − β₁ᵗ of mu | (0,)
    nu_mass: jax.Array  # f32 (batch, k): the same for nu | (0,)


class PlumageState(NamedTuple):
    """State of :func:`scale_by_plumage`: one :class:`LeafState` per parameter (``leaves``, with
    the structure of params) and the schedule's counters."""

    count: jax.Array  # () int32: update steps taken
    key: jax.Array  # (2,) uint32: sampling PRNG key (same on every replica)
    leaves: Any  # params-structured tree of LeafState
    refresh_interval: jax.Array  # () int32: current τ (adapted by AdaptiveRefresh)
    last_refresh: jax.Array  # () int32: `count` at the last refresh attempt
    refreshes: jax.Array  # () int32: refresh attempts (including skipped leaves)
    skipped_refreshes: jax.Array  # () int32: leaf refreshes skipped (non-finite gradient)
    comm_state: Any  # communicate's state for the projected tree: (k, N) f32 coordinates,
    # (batch, k, N) for leaves with batch axes, dense leaves as is (EmptyState if none)
    refresh_comm_state: Any  # communicate_refresh's state for the full tree (refresh steps)


# -------------------------------------------------------------------------------- settings


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
    """The static settings of one :func:`scale_by_plumage`, validated once (:meth:`build`)."""

    rank: Any
    refresh_every: int
    strategy: str
    resample_every: int | None
    realign: bool
    scale_before: bool  # unbiased_scaling == "before_moments"
    b1: Any
    b2: Any
    eps: Any
    eps_root: Any
    scale: Any
    seed: int
    weight_dimension_numbers: Any
    mask: Any
    adaptive: AdaptiveRefresh | None
    comm: Any  # communicate (with extra-args support) or None
    comm_refresh: Any  # the full-tree stage of refresh steps, or None
    separate_refresh_stage: bool  # communicate_refresh was given
    axis_name: Any  # axis to spread refresh SVDs over (None: local)
    comm_axis: Any  # axis the refresh steps' stage reduces over (None: unknown or local)

    @property
    def keep_basis(self) -> bool:
        return self.resample_every is not None and self.strategy == "plumage"

    def layouts(self, tree: Any) -> Any:
        """The per-leaf layouts of a params-structured tree under these settings.

        Args:
          tree: params, updates or gradients (arrays or shape-dtype structs; only shapes are
            read), with the structure of params.

        Returns:
          :func:`~gift_jax.lowrank.views.resolve_layouts` of ``tree``: a :class:`LeafLayout`
          per projected leaf, ``None`` per dense one.
        """
        return resolve_layouts(tree, self.rank, self.weight_dimension_numbers, self.mask)

    @classmethod
    def build(cls, rank, refresh_every, *, strategy, resample_every, realign, unbiased_scaling,
              b1, b2, eps, eps_root, scale, seed, weight_dimension_numbers, mask,
              adaptive_refresh, communicate, axis_name, communicate_refresh,
              distribute_refresh) -> Settings:
        """Validates the arguments of :func:`scale_by_plumage` and stores them.

        Args:
          rank: as :func:`scale_by_plumage`; checked here only when an int (a per-leaf tree or
            callable is checked leaf by leaf in :func:`~gift_jax.lowrank.views.resolve_layouts`).
          refresh_every: SVD refresh interval τ, an int ``>= 1``.
          strategy, resample_every, realign, scale, seed, weight_dimension_numbers, mask: as
            :func:`scale_by_plumage`, stored as given.
          unbiased_scaling: ``"before_moments"`` or ``"after_moments"``, stored as
            ``scale_before``.
          b1, b2, eps, eps_root: Adam hyperparameters; ``b1``, ``b2`` checked to lie in
            ``[0, 1)`` when they are numbers (not when injected arrays).
          adaptive_refresh: an :class:`AdaptiveRefresh` or ``None``, stored as ``adaptive``.
          communicate: the projected tree's reduction stage or ``None``; stored (``comm``)
            wrapped by ``optax.with_extra_args_support``.
          axis_name: the axis to spread refresh SVDs over; ``None``: the reduced axis of the
            refresh stage when it is an :func:`~gift_jax.comm.stage.allreduce`, else local.
          communicate_refresh: the full tree's stage of refresh steps; ``None``:
            ``communicate``. Stored (``comm_refresh``) wrapped like it.
          distribute_refresh: ``False`` stores ``axis_name=None`` (every replica computes every
            SVD).

        Returns:
          The frozen :class:`Settings`.

        Raises:
          ValueError: an int ``rank < 1`` (or a bool), ``refresh_every`` or ``resample_every``
            not an int ``>= 1``, an unknown ``strategy`` or ``unbiased_scaling``,
            ``resample_every`` with ``"galore"``, ``b1``/``b2`` outside ``[0, 1)``,
            ``adaptive_refresh`` with ``"flora"`` or with bounds that do not satisfy
            ``1 <= min_every <= refresh_every <= max_every`` and ``0 <= low <= high <= 1``, or
            ``communicate_refresh`` without ``communicate``.
          TypeError: ``adaptive_refresh`` not an :class:`AdaptiveRefresh`, or ``communicate`` /
            ``communicate_refresh`` not an ``optax.GradientTransformation``.
        """
        if isinstance(rank, bool) or (isinstance(rank, int) and rank < 1):
            raise ValueError(
                f"rank must be an int >= 1 (or a per-leaf tree/callable), got {rank!r}")
        if not _is_int(refresh_every) or refresh_every < 1:
            raise ValueError(f"refresh_every must be an int >= 1, got {refresh_every!r}")
        if resample_every is not None and (not _is_int(resample_every) or resample_every < 1):
            raise ValueError(f"resample_every must be None or an int >= 1, got {resample_every!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if resample_every is not None and strategy == "galore":
            raise ValueError(
                "resample_every applies to strategy 'plumage' or 'flora'; GaLore's top-k "
                "projector is deterministic, got strategy='galore'"
            )
        if unbiased_scaling not in SCALING_POSITIONS:
            raise ValueError(
                f"unbiased_scaling must be one of {SCALING_POSITIONS}, got {unbiased_scaling!r}")
        for name, b in (("b1", b1), ("b2", b2)):
            if isinstance(b, (int, float)) and not 0.0 <= b < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {b!r}")
        a = adaptive_refresh
        if a is not None:
            if not isinstance(a, AdaptiveRefresh):
                raise TypeError(f"adaptive_refresh must be an AdaptiveRefresh or None, got {a!r}")
            if strategy == "flora":
                raise ValueError(
                    "adaptive_refresh needs an SVD subspace; it is not defined for strategy='flora'"
                )
            if not 1 <= a.min_every <= refresh_every <= a.max_every:
                raise ValueError(
                    "adaptive_refresh must satisfy 1 <= min_every <= refresh_every <= max_every, "
                    f"got min_every={a.min_every}, refresh_every={refresh_every}, "
                    f"max_every={a.max_every}"
                )
            if not 0.0 <= a.low <= a.high <= 1.0:
                raise ValueError(
                    f"adaptive_refresh needs 0 <= low <= high <= 1, got {a.low}, {a.high}")
        if communicate is not None and not isinstance(communicate, optax.GradientTransformation):
            raise TypeError(
                f"communicate must be an optax.GradientTransformation or None, got {communicate!r}"
            )
        if communicate_refresh is not None:
            if communicate is None:
                raise ValueError("communicate_refresh needs communicate (the projected stage)")
            if not isinstance(communicate_refresh, optax.GradientTransformation):
                raise TypeError(
                    "communicate_refresh must be an optax.GradientTransformation or None, got "
                    f"{communicate_refresh!r}"
                )
        full_stage = communicate if communicate_refresh is None else communicate_refresh
        comm_axis = None if communicate is None else allreduce_axis(full_stage)
        if axis_name is None:
            axis_name = comm_axis
        wrap = lambda t: None if communicate is None else optax.with_extra_args_support(t)
        return cls(
            rank=rank, refresh_every=refresh_every, strategy=strategy,
            resample_every=resample_every, realign=realign,
            scale_before=unbiased_scaling == "before_moments", b1=b1, b2=b2, eps=eps,
            eps_root=eps_root, scale=scale, seed=seed,
            weight_dimension_numbers=weight_dimension_numbers, mask=mask, adaptive=a,
            comm=wrap(communicate), comm_refresh=wrap(full_stage),
            separate_refresh_stage=communicate_refresh is not None,
            axis_name=axis_name if distribute_refresh else None, comm_axis=comm_axis,
        )


# -------------------------------------------------------------------- per-leaf math (pure)


def _unit_columns(p: jax.Array) -> jax.Array:
    norm = jnp.linalg.norm(p, axis=-2, keepdims=True)
    return p / jnp.where(norm > 0, norm, 1.0)


def _select(accept: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """Per batch element: ``new`` where ``accept`` (shape ``(batch,)``), else ``old``."""
    return jnp.where(accept.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)


def init_leaf(x: jax.Array, lay: LeafLayout | None, keep_basis: bool) -> LeafState:
    """Zero moments; before the first refresh ``P`` spans the first ``k`` coordinate axes and
    ``D = I``.

    Args:
      x: the parameter leaf (an array or shape-dtype struct; only its shape is read).
      lay: its layout; ``None``: a dense leaf (full-shape fp32 moments, ``(0,)`` placeholders).
      keep_basis: store the SVD (``Settings.keep_basis``: PLUMAGE with ``resample_every``),
        initially ``basis = eye(M, N)`` and ``spectrum = 0``; ``False``: ``(0,)`` placeholders.

    Returns:
      The leaf's initial :class:`LeafState`.
    """
    empty = functools.partial(jnp.zeros, (0,), jnp.float32)  # distinct buffers (donation)
    if lay is None:
        zeros = functools.partial(jnp.zeros, x.shape, jnp.float32)
        return LeafState(empty(), empty(), empty(), empty(), zeros(), zeros(), empty(), empty())
    b, m, n, k = lay.batch, lay.m, lay.n, lay.rank
    moments = functools.partial(jnp.zeros, lay.moment_shape, jnp.float32)
    mass = functools.partial(jnp.zeros, (b, k), jnp.float32)
    basis, spectrum = empty(), empty()
    if keep_basis:
        basis = jnp.broadcast_to(jnp.eye(m, n, dtype=jnp.float32), (b, m, n))
        spectrum = jnp.zeros((b, n), jnp.float32)
    return LeafState(
        projector=jnp.broadcast_to(jnp.eye(m, k, dtype=jnp.float32), (b, m, k)),
        probs=jnp.ones((b, k), jnp.float32), basis=basis, spectrum=spectrum,
        mu=moments(), nu=moments(), mu_mass=mass(), nu_mass=mass(),
    )


def draw_projector(strategy: str, key: jax.Array, lay: LeafLayout, u: jax.Array | None,
                   sigma: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(P, p)`` per batch element from the left singular vectors ``u`` and values ``sigma``.

    PLUMAGE: minimum-variance inclusion probabilities ``p`` (KKT solution of ``min Σσᵢ²/pᵢ``,
    ``Σp = k``), a systematic sample ``S`` of exactly ``k`` directions, ``P = U[:, S]``,
    ``D = diag(p_S)`` (:func:`estimator.plumage_projector`). GaLore: ``U[:, :k]``, ``D = I``.
    FLORA: a fresh Gaussian ``N(0, 1/k)`` matrix, ``D = I`` (``u``, ``sigma`` unused).

    Args:
      strategy: ``"plumage"``, ``"galore"`` or ``"flora"``.
      key: the leaf's PRNG key, split into one key per batch element.
      lay: the leaf's layout (batch size, ``M`` and rank ``k``).
      u: left singular vectors per batch element, ``(batch, M, N)``; ``None`` for FLORA.
      sigma: their singular values, ``(batch, N)``, descending; ``None`` for FLORA (GaLore
        does not read it).

    Returns:
      ``(P, p)``: projectors ``(batch, M, k)`` and probabilities ``(batch, k)``, fp32 (``p``
      ones for GaLore and FLORA).
    """
    keys = jax.random.split(jax.random.fold_in(key, 0), lay.batch)
    if strategy == "plumage":
        fn = functools.partial(estimator.plumage_projector, k=lay.rank)
        return jax.vmap(fn)(keys, u, sigma)
    if strategy == "galore":
        return jax.vmap(functools.partial(estimator.galore_projector, k=lay.rank))(u)
    fn = functools.partial(estimator.flora_projector, m=lay.m, k=lay.rank)
    return jax.vmap(fn)(keys)


def change_projection(leaf: LeafState, proj: jax.Array, probs: jax.Array, accept: jax.Array,
                      realign: bool) -> LeafState:
    """Install ``(proj, probs)`` where ``accept`` (per batch element), realigning the moments.

    With ``B = P̃₂ᵀ P̃₁`` (unit-norm columns: equal to ``P₂ᵀP₁`` for orthonormal PLUMAGE/GaLore
    projectors, the orthogonal-projection transfer for FLORA's Gaussian ones):
    ``M ← B M``, ``V ← (B∘B) V`` (PLUMAGE, arXiv 2505.18313) and the per-row bias-correction
    masses ``w ← clip((B∘B) w, 0, 1)``. ``realign=False`` keeps the moments (GaLore).

    Args:
      leaf: the leaf's state before the change.
      proj: the new projectors ``P₂``, ``(batch, M, k)``.
      probs: their probabilities ``p_S``, ``(batch, k)`` (ones for GaLore and FLORA).
      accept: ``(batch,)`` bool: the batch elements that take the new projection; the others
        keep their projector, probabilities, moments and masses.
      realign: realign the moments and masses (``Settings.realign``); ``False``: only ``P``
        and ``D`` change.

    Returns:
      The updated :class:`LeafState`.
    """
    proj = _select(accept, proj, leaf.projector)
    probs = _select(accept, probs, leaf.probs)
    mu, nu, mm, nm = leaf.mu, leaf.nu, leaf.mu_mass, leaf.nu_mass
    if realign:
        b = jnp.einsum("bmi,bmj->bij", _unit_columns(proj), _unit_columns(leaf.projector))
        mu2, nu2 = jax.vmap(estimator.realign_moments)(b, mu, nu)
        mm2 = jax.vmap(estimator.transfer_bias_mass)(b, mm)
        nm2 = jax.vmap(estimator.transfer_bias_mass)(b, nm)
        mu, nu = _select(accept, mu2, mu), _select(accept, nu2, nu)
        mm, nm = _select(accept, mm2, mm), _select(accept, nm2, nm)
    return leaf._replace(projector=proj, probs=probs, mu=mu, nu=nu, mu_mass=mm, nu_mass=nm)


def adapt_interval(rule: AdaptiveRefresh, interval: jax.Array, refreshes: jax.Array,
                   overlaps: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """τ from the mean subspace overlap ``ω = Σ ‖U₂ᵀP₁‖²_F/k / #accepted`` of this refresh.

    ``ω`` is the mean squared cosine of the principal angles between the old projector ``P₁``
    and the new dominant rank-``k`` subspace ``U₂`` (1: unchanged, 0: orthogonal). ``ω ≥ high``
    → ``τ ← min(2τ, max_every)``; ``ω < low`` → ``τ ← max(τ // 2, min_every)``; unchanged at the
    first refresh or when no leaf was accepted.

    Args:
      rule: the :class:`AdaptiveRefresh` bounds and thresholds.
      interval: the current τ, ``()`` int32.
      refreshes: refreshes before this one, ``()`` int32 (0: the first refresh, τ unchanged).
      overlaps: per projected leaf, ``(Σ overlap, #accepted)`` over its accepted batch
        elements, fp32 scalars.

    Returns:
      The new τ, ``()`` int32.
    """
    total = sum(o for o, _ in overlaps)
    weight = sum(w for _, w in overlaps)
    omega = total / jnp.maximum(weight, 1.0)
    grown = jnp.minimum(2 * interval, rule.max_every)
    shrunk = jnp.maximum(interval // 2, rule.min_every)
    adapted = jnp.where(omega >= rule.high, grown, jnp.where(omega < rule.low, shrunk, interval))
    return jnp.where((refreshes > 0) & (weight > 0), adapted, interval).astype(jnp.int32)


def _left_singular(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(U, σ) of the thin SVD of one (m, n) matrix."""
    u, sigma, _ = jnp.linalg.svd(g, full_matrices=False)
    return u, sigma


def refresh(s: Settings, state: PlumageState, grads: Any, layouts: Any,
            axis: Any = None) -> PlumageState:
    """New projections from ``grads``: SVD ``G = U diag(σ) Vᵀ`` per projected matrix (spread
    over ``axis`` when given, see :func:`gift_jax.utils.linalg.map_matrices_grouped`), then
    :func:`draw_projector` and :func:`change_projection`. A batch element whose gradient is
    not finite keeps its projection (counted in ``skipped_refreshes``); τ follows
    :func:`adapt_interval` if ``s.adaptive``.

    Args:
      s: the transformation's settings.
      state: the state before the refresh (the caller sets its communication states aside).
      grads: the gradients, with the structure of params: reduced across replicas when
        ``communicate`` is set, local otherwise (FLORA reads only their structure).
      layouts: :meth:`Settings.layouts` of ``grads``.
      axis: the bound mesh axis (or tuple) to spread the SVDs over; ``None``: every SVD here.

    Returns:
      The state with a new key and projections, τ (``refresh_interval``), ``refreshes + 1``
      and ``skipped_refreshes``; ``count`` and ``last_refresh`` are left to the caller.
    """
    key, sub = jax.random.split(state.key)
    flat, treedef = jax.tree.flatten(grads)
    lays = treedef.flatten_up_to(layouts)
    leaves = treedef.flatten_up_to(state.leaves)
    mats, svds = {}, {}
    if s.strategy != "flora":
        for i, (g, lay) in enumerate(zip(flat, lays, strict=True)):
            if lay is not None:
                gm = lay.to_matrix(g).astype(jnp.float32)
                accept = jnp.all(jnp.isfinite(gm), axis=(1, 2))
                mats[i] = (jnp.where(accept[:, None, None], gm, 0.0), accept)
        svds = map_matrices_grouped(_left_singular, {i: (gm,) for i, (gm, _) in mats.items()},
                                    axis)
    skipped, overlaps = state.skipped_refreshes, []
    for i, lay in enumerate(lays):
        if lay is None:
            continue
        leaf = leaves[i]
        if s.strategy == "flora":
            accept, u, sigma = jnp.ones((lay.batch,), bool), None, None
        else:
            accept, (u, sigma) = mats[i][1], svds[i]
        proj, probs = draw_projector(s.strategy, jax.random.fold_in(sub, i), lay, u, sigma)
        if s.adaptive is not None and s.strategy != "flora":
            ov = jax.vmap(estimator.projector_overlap)(u[..., : lay.rank], leaf.projector)
            w = accept.astype(jnp.float32)
            overlaps.append((jnp.sum(ov * w), jnp.sum(w)))
        if s.keep_basis:
            leaf = leaf._replace(basis=jnp.where(accept[:, None, None], u, leaf.basis),
                                 spectrum=jnp.where(accept[:, None], sigma, leaf.spectrum))
        skipped = skipped + jnp.sum(~accept).astype(jnp.int32)
        leaves[i] = change_projection(leaf, proj, probs, accept, s.realign)
    interval = state.refresh_interval
    if s.adaptive is not None and overlaps:
        interval = adapt_interval(s.adaptive, interval, state.refreshes, overlaps)
    return state._replace(key=key, leaves=jax.tree.unflatten(treedef, leaves),
                          refresh_interval=interval, refreshes=state.refreshes + 1,
                          skipped_refreshes=skipped)


def resample(s: Settings, state: PlumageState, layouts: Any) -> PlumageState:
    """Redraw ``S`` (PLUMAGE, from the stored ``U``, ``σ``) or the Gaussian (FLORA) without a
    new SVD (every κ = ``resample_every`` steps), then :func:`change_projection`.

    Args:
      s: the transformation's settings.
      state: the state before the redraw (its stored ``basis`` and ``spectrum`` for PLUMAGE).
      layouts: :meth:`Settings.layouts` of the parameters.

    Returns:
      The state with a new key and every projected leaf's projection redrawn.
    """
    key, sub = jax.random.split(state.key)
    treedef = jax.tree.structure(layouts, is_leaf=lambda x: x is None or isinstance(
        x, LeafLayout))
    lays, leaves = treedef.flatten_up_to(layouts), treedef.flatten_up_to(state.leaves)
    for i, (lay, leaf) in enumerate(zip(lays, leaves, strict=True)):
        if lay is not None:
            proj, probs = draw_projector(s.strategy, jax.random.fold_in(sub, i), lay,
                                         leaf.basis, leaf.spectrum)
            leaves[i] = change_projection(leaf, proj, probs, jnp.ones((lay.batch,), bool),
                                          s.realign)
    return state._replace(key=key, leaves=jax.tree.unflatten(treedef, leaves))


def coordinates(s: Settings, g: jax.Array, lay: LeafLayout | None, leaf: LeafState) -> jax.Array:
    """``R = D⁻¹PᵀG`` ("before_moments") or ``PᵀG``, ``(batch, k, N)``; dense leaves: ``G``.

    Args:
      s: the transformation's settings (``scale_before`` picks the variant).
      g: one leaf's gradient, in the leaf's shape.
      lay: the leaf's layout; ``None``: dense.
      leaf: the leaf's state (its ``projector`` and ``probs``).

    Returns:
      The fp32 coordinates ``(batch, k, N)``, or ``g`` unchanged for a dense leaf.
    """
    if lay is None:
        return g
    return _project(s, g, lay, leaf.projector, leaf.probs)


def _project(s: Settings, g: jax.Array, lay: LeafLayout, projector: jax.Array,
             probs: jax.Array) -> jax.Array:
    r = jnp.einsum("bmk,bmn->bkn", projector, lay.to_matrix(g).astype(jnp.float32))
    return r / probs[..., None] if s.scale_before else r


def adam_step(s: Settings, r: jax.Array, lay: LeafLayout | None, leaf: LeafState,
              bc1: jax.Array, bc2: jax.Array) -> tuple[jax.Array, LeafState]:
    """Adam on the (reduced) coordinates ``r``, back-projected: ``(update, new leaf state)``.

    Projected leaves use per-row bias correction (the masses ``w``, which
    :func:`change_projection` carries across projection changes) when ``realign``, else the
    global ``1 − βᵗ`` (``bc1``, ``bc2``); the step ``X = m̂ / (√(v̂ + ε_root) + ε)`` becomes
    ``scale · P X`` ("before_moments") or ``scale · P D⁻¹ X``.

    Args:
      s: the transformation's settings (Adam hyperparameters, ``realign``, ``scale_before``,
        ``scale``).
      r: the leaf's coordinates ``(batch, k, N)`` (:func:`coordinates`, reduced when
        ``communicate`` is set), or a dense leaf's gradient.
      lay: the leaf's layout; ``None``: dense (plain Adam, no ``scale``).
      leaf: the leaf's state before the step.
      bc1, bc2: the global bias corrections ``1 − β₁ᵗ``, ``1 − β₂ᵗ`` at this step's count
        ``t`` (1 on the first step).

    Returns:
      ``(update, leaf)``: the fp32 update in the leaf's shape and the :class:`LeafState` with
      the new moments (and masses).
    """
    b1, b2, eps, eps_root = s.b1, s.b2, s.eps, s.eps_root
    r = r.astype(jnp.float32)
    mu = (1 - b1) * r + b1 * leaf.mu
    nu = (1 - b2) * jnp.square(r) + b2 * leaf.nu
    if lay is None:
        x = (mu / bc1) / (jnp.sqrt(nu / bc2 + eps_root) + eps)
        return x, leaf._replace(mu=mu, nu=nu)
    mm = (1 - b1) + b1 * leaf.mu_mass
    nm = (1 - b2) + b2 * leaf.nu_mass
    c1 = mm[..., None] if s.realign else bc1
    c2 = nm[..., None] if s.realign else bc2
    x = (mu / c1) / (jnp.sqrt(nu / c2 + eps_root) + eps)
    if not s.scale_before:
        x = x / leaf.probs[..., None]
    out = lay.from_matrix(s.scale * jnp.einsum("bmk,bkn->bmn", leaf.projector, x))
    return out, leaf._replace(mu=mu, nu=nu, mu_mass=mm, nu_mass=nm)


# --------------------------------------------------- communication (and a whitening stage)


def _communicate(s: Settings, coords: list, lays: list, treedef: Any, comm_state: Any,
                 extra_args: dict) -> tuple[list, Any]:
    """Reduce the coordinates (``lay.coord_shape``) and dense leaves through ``communicate``."""
    shaped = [r if lay is None else r.reshape(lay.coord_shape)
              for r, lay in zip(coords, lays, strict=True)]
    reduced, comm_state = s.comm.update(jax.tree.unflatten(treedef, shaped), comm_state,
                                        **extra_args)
    return [r if lay is None else r.reshape(lay.moment_shape)
            for r, lay in zip(treedef.flatten_up_to(reduced), lays, strict=True)], comm_state


def _has_projection_hook(x: Any) -> bool:
    return hasattr(x, "with_input_widths") and hasattr(x, "layers")


def _whitened_layers(comm_state: Any) -> tuple[str, ...]:
    """Paths of the layers that a stage inside ``communicate`` (GIFT) whitens (static)."""
    nodes = jax.tree.leaves(comm_state, is_leaf=_has_projection_hook)
    return tuple(sorted({p for x in nodes if _has_projection_hook(x) for p in x.layers}))


def _check_whitened_layers(paths: tuple[str, ...], by_path: dict) -> None:
    """GIFT (input-side whitening of ``R = MᵀG``) can only act on leaves whose PLUMAGE-projected
    side is the input side, as plain 2-D kernels."""
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


def _init_comm(s: Settings, params: Any, layouts: Any) -> tuple[Any, Any]:
    """``(comm_state, refresh_comm_state)``: the projected stage initialised on the
    coordinate-shaped tree (whitening stages told their layers' real input widths), the
    refresh stage on the full tree."""
    if s.comm is None:
        return optax.EmptyState(), optax.EmptyState()
    flat, treedef = jax.tree.flatten(params)
    lays = treedef.flatten_up_to(layouts)
    coords = jax.tree.unflatten(treedef, [
        jnp.zeros(x.shape, x.dtype) if lay is None else jnp.zeros(lay.coord_shape, jnp.float32)
        for x, lay in zip(flat, lays, strict=True)])
    comm_state = s.comm.init(coords)
    paths = _whitened_layers(comm_state)
    if paths:
        if not s.separate_refresh_stage:
            raise ValueError(
                "scale_by_plumage: communicate contains a GIFT stage (it whitens the projected "
                "coordinates), which cannot reduce the full-width gradients of refresh steps; "
                "pass communicate_refresh= (e.g. the plain all-reduce chain)"
            )
        by_path = {leaf_path(p): (x, lay) for (p, x), lay in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], lays, strict=True)}
        _check_whitened_layers(paths, by_path)
        widths = {path: by_path[path][1].m for path in paths}
        comm_state = jax.tree.map(
            lambda x: x.with_input_widths({p: widths[p] for p in x.layers})
            if _has_projection_hook(x) else x, comm_state, is_leaf=_has_projection_hook)
    return comm_state, s.comm_refresh.init(jax.tree.map(jnp.zeros_like, params))


def _pop_gift_stats(s: Settings, comm_state: Any, refresh_now: bool | None,
                    extra_args: dict) -> Any:
    """``gift_stats`` for a whitening stage in ``communicate``: required on refresh steps (its
    factor ``MᵀAM`` must follow the new ``M``), refused otherwise."""
    if s.comm is None or not _whitened_layers(comm_state):
        return None
    stats = extra_args.pop("gift_stats", None)
    if refresh_now and stats is None:
        raise ValueError(
            "scale_by_plumage: communicate contains a GIFT stage; refresh steps "
            "(plumage_refresh=True) need gift_stats={path: E[xxᵀ]} of its layers"
        )
    if not refresh_now and stats is not None:
        raise ValueError(
            "scale_by_plumage: gift_stats is only accepted on refresh steps "
            "(plumage_refresh=True), when the projection and GIFT's factors change"
        )
    return stats


def _refresh_whitening(s: Settings, comm_state: Any, state: PlumageState, updates: Any,
                       layouts: Any, params: Any, gift_stats: Any, extra_args: dict) -> Any:
    """Rebuild the whitening factors for the new projection: one call of ``communicate`` on
    zero coordinates with ``gift_stats`` and ``gift_projection={path: M}``, ``M = P·D⁻¹``
    ("before_moments") or ``P`` (``(n, k)``); the output is discarded (with the residuals just
    zeroed it sends exact zeros).  ``gift_route_updates``: this replica's coordinates of
    ``updates`` (its local gradient) in the new projection, for a routing GIFT to measure its
    transports on (``gift(route_frame=...)``)."""
    by_path = {leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        state.leaves, is_leaf=lambda x: isinstance(x, LeafState))[0]}
    projection = {}
    for path in _whitened_layers(comm_state):
        leaf = by_path[path]
        m = leaf.projector / leaf.probs[:, None, :] if s.scale_before else leaf.projector
        projection[path] = m[0]
    flat, treedef = jax.tree.flatten(updates)
    lays = treedef.flatten_up_to(layouts)
    zeros = jax.tree.unflatten(treedef, [
        jnp.zeros_like(x) if lay is None else jnp.zeros(lay.coord_shape, jnp.float32)
        for x, lay in zip(flat, lays, strict=True)])
    local = jax.tree.unflatten(treedef, [
        x if lay is None else coordinates(s, x, lay, leaf).reshape(lay.coord_shape)
        for x, lay, leaf in zip(flat, lays, treedef.flatten_up_to(state.leaves), strict=True)])
    _, comm_state = s.comm.update(zeros, comm_state, params, gift_stats=gift_stats,
                                  gift_projection=projection, gift_route_updates=local,
                                  **extra_args)
    return comm_state


# ------------------------------------------------------ reducing inside the backward pass


def frame_in_backward(s: Settings, reduce_stage: optax.GradientTransformation, params: Any,
                      state: PlumageState) -> AroundAllReduce:
    """An ordinary step's projection as a frame around the all-reduce, for reducing inside
    the backward pass (:func:`gift_jax.comm.overlap.loss_and_reduced_grads`): each group's
    hook projects its projected leaves' mean gradient to their coordinates ``R = D⁻¹PᵀG``
    (:func:`coordinates`, with the projections before the step), reduces them with the
    group's other (dense) leaves, and returns them as those leaves' gradients, in
    ``communicate``'s coordinate shapes. ``update`` then takes them with
    ``reduced_in_backward=`` (the all-reduce's new state) — the ordinary step, bit for bit.

    Args:
      s: the transformation's settings.
      reduce_stage: the grouped :func:`gift_jax.allreduce` first in ``communicate``, wrapped
        by :func:`gift_jax.comm.overlap.reducible_in_backward`.
      params: the per-device parameters.
      state: the :class:`PlumageState` before the step.

    Returns:
      The :class:`~gift_jax.comm.overlap.AroundAllReduce` (its ``finish`` is the identity:
      the all-reduce's new state is what ``update`` takes).

    Raises:
      ValueError: ``resample_every`` is set (a step may redraw the projection before its
        coordinates are taken), or ``communicate`` whitens the coordinates (GIFT).
    """
    if s.resample_every is not None:
        raise ValueError("scale_by_plumage: resample_every redraws projections inside the "
                         "update, after the backward pass; reduce after it")
    if _whitened_layers(state.comm_state):
        raise ValueError("scale_by_plumage: a GIFT stage in communicate whitens the "
                         "coordinates after the backward pass; reduce after it")
    treedef = jax.tree.structure(params)
    lays = treedef.flatten_up_to(s.layouts(params))
    leaves = treedef.flatten_up_to(state.leaves)

    def enter(i, g, data, one_layer):
        lay = lays[i].layer_slice() if one_layer else lays[i]
        return _project(s, g, lay, *data).reshape(lay.coord_shape)

    data = {i: (leaf.projector, leaf.probs)
            for i, (lay, leaf) in enumerate(zip(lays, leaves, strict=True)) if lay is not None}
    inner = optax.tree.get(state.comm_state, "AllReduceState")
    return AroundAllReduce(reduce_stage, inner, Frame(enter, None, data), lambda new: new)


@dataclasses.dataclass(frozen=True)
class ProjectionAroundAllReduce:
    """PLUMAGE's projection around its all-reduce, as the in-backward reduction reads it
    (:func:`gift_jax.comm.overlap.loss_and_reduced_grads` with the step's
    :class:`PlumageState`).

    Attributes:
      settings: the PLUMAGE transformation's settings.
      reduce_stage: its grouped all-reduce (first in ``communicate``).
    """

    settings: Settings
    reduce_stage: optax.GradientTransformation

    def frame_in_backward(self, params: Any, state: PlumageState) -> AroundAllReduce:
        """:func:`frame_in_backward` of these settings and stage.

        Args:
          params: the per-device parameters.
          state: the :class:`PlumageState` before the step.

        Returns:
          The :class:`~gift_jax.comm.overlap.AroundAllReduce` of an ordinary step.
        """
        return frame_in_backward(self.settings, self.reduce_stage, params, state)


class PlumageTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`scale_by_plumage` and :func:`plumage` return: optax's ``(init, update)``
    pair, with the PLUMAGE stage's :class:`Settings` (the in-backward reduction reads them,
    :meth:`around`)."""

    settings: Settings

    def __new__(cls, init, update, settings: Settings):
        self = super().__new__(cls, init, update)
        self.settings = settings
        return self

    def around(self, reduce_stage: optax.GradientTransformation) -> ProjectionAroundAllReduce:
        """This transformation's projection around ``reduce_stage``, its grouped all-reduce.

        Args:
          reduce_stage: the :func:`gift_jax.allreduce` (``groups`` set) first in
            ``communicate``.

        Returns:
          The :class:`ProjectionAroundAllReduce`.
        """
        return ProjectionAroundAllReduce(self.settings, reduce_stage)


# ------------------------------------------------------------------------ the transformation


def _static_refresh(s: Settings, extra_args: dict) -> bool | None:
    refresh_now = extra_args.pop("plumage_refresh", None)
    if refresh_now is not None and not isinstance(refresh_now, bool):
        raise TypeError(
            "plumage_refresh must be a Python bool (static at trace time) or absent, got "
            f"{type(refresh_now).__name__}; compile one variant per value"
        )
    if s.comm is not None and refresh_now is None:
        raise ValueError(
            "scale_by_plumage(communicate=...) needs the static keyword "
            "plumage_refresh=True/False in update(): collectives of different shapes "
            "cannot live in lax.cond branches (use refresh_due(state) on the host)"
        )
    return refresh_now


def _check_reduced_in_backward(s: Settings, refresh_now: bool | None, params: Any) -> None:
    """``update(..., reduced_in_backward=...)`` takes coordinates reduced in the backward pass
    (:func:`frame_in_backward`): only on ordinary steps, with ``communicate`` and ``params``."""
    if s.comm is None or refresh_now is not False or params is None:
        raise ValueError(
            "scale_by_plumage: reduced_in_backward= (coordinates reduced inside the backward "
            "pass) needs communicate=, plumage_refresh=False (refresh steps reduce the full "
            "gradient after the backward) and params")


def _is_due(state: PlumageState) -> jax.Array:
    return (state.count - state.last_refresh >= state.refresh_interval) | (state.refreshes == 0)


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
    samples it so that ``P D⁻¹ Pᵀ G`` is an unbiased minimum-variance estimate of ``G``, and
    carries the moments across subspace changes. Design notes (where ``D⁻¹`` enters, refresh
    scheduling, communication, error feedback, GIFT composition): docs/ARCHITECTURE.md,
    "PLUMAGE transform".

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
        like GaLore; bias correction then uses the global step count).
      unbiased_scaling: ``"before_moments"`` (moments of ``R = D⁻¹PᵀG``) or
        ``"after_moments"`` (moments of ``PᵀG``, the step scaled by ``D⁻¹``).
      b1, b2, eps, eps_root: Adam hyperparameters (as ``optax.scale_by_adam``).
      scale: GaLore's ``α``, multiplies the updates of projected leaves only.
      seed: seed of the sampling key kept in state (identical on all replicas).
      weight_dimension_numbers: how leaves are viewed as matrices, see
        :func:`gift_jax.lowrank.views.resolve_layouts`.
      mask: pytree of bools or callable: which leaves to project (e.g.
        :func:`mask_excluding` ``("embed/*", "lm_head/*")`` keeps a Llama's embedding and
        output head dense).
      adaptive_refresh: optional :class:`AdaptiveRefresh` rule for τ.
      communicate: optional cross-replica reduction stage for the ``(k, N)`` coordinates and
        dense leaves (inside ``shard_map``); needs the static ``plumage_refresh=True/False``
        keyword in ``update`` (decide with :func:`refresh_due`). Other extra keyword args
        (except ``gift_stats``) are passed to it. On an ordinary step whose coordinates
        were reduced inside the backward pass (:meth:`PlumageTransformation.around`,
        :func:`gift_jax.comm.overlap.loss_and_reduced_grads`), ``update`` takes them as
        ``updates`` (in ``communicate``'s shapes) with ``reduced_in_backward=`` the
        all-reduce's new state and ``params``.
      axis_name: the data-parallel axis (or tuple) over which refresh SVDs are spread;
        ``None``: that of the refresh stage when it is a :func:`gift_jax.allreduce`.
      communicate_refresh: the stage that reduces the full gradient on refresh steps
        (default ``communicate``); required when ``communicate`` contains a GIFT stage.
      distribute_refresh: ``False``: every replica computes every SVD.

    Returns:
      A :class:`PlumageTransformation` whose state is a :class:`PlumageState`.

    Raises:
      ValueError: an invalid setting (see :meth:`Settings.build`).
      TypeError: ``adaptive_refresh``, ``communicate`` or ``communicate_refresh`` of the wrong
        type.
    """
    s = Settings.build(
        rank, refresh_every, strategy=strategy, resample_every=resample_every, realign=realign,
        unbiased_scaling=unbiased_scaling, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
        scale=scale, seed=seed, weight_dimension_numbers=weight_dimension_numbers, mask=mask,
        adaptive_refresh=adaptive_refresh, communicate=communicate, axis_name=axis_name,
        communicate_refresh=communicate_refresh, distribute_refresh=distribute_refresh,
    )

    def init_fn(params):
        counters = dict(count=jnp.zeros([], jnp.int32), key=jax.random.PRNGKey(s.seed),
                        refresh_interval=jnp.asarray(s.refresh_every, jnp.int32),
                        last_refresh=jnp.zeros([], jnp.int32),
                        refreshes=jnp.zeros([], jnp.int32),
                        skipped_refreshes=jnp.zeros([], jnp.int32))
        if not jax.tree.leaves(params):  # e.g. optax.tree.map_params' placeholder
            empty = optax.EmptyState() if s.comm is None else s.comm.init(params)
            refresh_comm = empty if s.comm is None else s.comm_refresh.init(params)
            return PlumageState(leaves=params, comm_state=empty,
                                refresh_comm_state=refresh_comm, **counters)
        layouts = s.layouts(params)
        flat, treedef = jax.tree.flatten(params)
        leaves = [init_leaf(x, lay, s.keep_basis)
                  for x, lay in zip(flat, treedef.flatten_up_to(layouts), strict=True)]
        comm_state, refresh_comm_state = _init_comm(s, params, layouts)
        return PlumageState(leaves=jax.tree.unflatten(treedef, leaves), comm_state=comm_state,
                            refresh_comm_state=refresh_comm_state, **counters)

    def update_fn(updates, state: PlumageState, params=None, **extra_args):
        given = extra_args.get("reduced_in_backward") is not None  # updates: coordinates
        if s.comm is not None and not given:
            require_per_device(updates, s.comm_axis, "gift_jax.plumage")
        refresh_now = _static_refresh(s, extra_args)
        if given:
            _check_reduced_in_backward(s, refresh_now, params)
        gift_stats = _pop_gift_stats(s, state.comm_state, refresh_now, extra_args)
        layouts = s.layouts(params if given else updates)
        comm_state, refresh_comm_state = state.comm_state, state.refresh_comm_state
        core = state._replace(comm_state=None, refresh_comm_state=None)  # lax.cond operand
        grads, reduced, refreshed = updates, False, bool(refresh_now)
        if refresh_now is None:
            refreshed = _is_due(state)
            core = cond(refreshed, lambda c: refresh(s, c, grads, layouts),
                                lambda c: c, core)
        elif refresh_now:
            if s.comm is not None:  # SVDs of the reduced gradient: the same P on every replica
                grads, refresh_comm_state = s.comm_refresh.update(grads, refresh_comm_state,
                                                                  **extra_args)
                reduced = True
            core = refresh(s, core, grads, layouts, s.axis_name if s.comm is not None else None)
            if s.comm is not None:  # new projection: old-coordinate residuals are meaningless
                comm_state = reset_error_feedback(comm_state)
            if gift_stats is not None:
                comm_state = _refresh_whitening(s, comm_state, core, updates, layouts, params,
                                                gift_stats, extra_args)
        last_refresh = jnp.where(refreshed, state.count, state.last_refresh).astype(jnp.int32)
        if s.resample_every is not None:
            due = (state.count % s.resample_every == 0) & jnp.logical_not(refreshed)
            core = cond(due, lambda c: resample(s, c, layouts), lambda c: c, core)
            if s.comm is not None:
                comm_state = reset_error_feedback(comm_state, due)

        flat, treedef = jax.tree.flatten(grads)
        lays = treedef.flatten_up_to(layouts)
        leaves = treedef.flatten_up_to(core.leaves)
        coords = flat if given else [coordinates(s, *a)
                                     for a in zip(flat, lays, leaves, strict=True)]
        if s.comm is not None and not reduced:
            coords, comm_state = _communicate(s, coords, lays, treedef, comm_state, extra_args)
        count = optax.safe_int32_increment(state.count)
        bc1 = 1.0 - jnp.asarray(s.b1, jnp.float32) ** count
        bc2 = 1.0 - jnp.asarray(s.b2, jnp.float32) ** count
        steps = [adam_step(s, *a, bc1, bc2) for a in zip(coords, lays, leaves, strict=True)]
        dtypes = [jnp.result_type(x) for x in jax.tree.leaves(params if given else grads)]
        out = [u.astype(d) for (u, _), d in zip(steps, dtypes, strict=True)]
        new_leaves = jax.tree.unflatten(treedef, [leaf for _, leaf in steps])
        return jax.tree.unflatten(treedef, out), core._replace(
            count=count, leaves=new_leaves, last_refresh=last_refresh, comm_state=comm_state,
            refresh_comm_state=refresh_comm_state)

    return PlumageTransformation(init_fn, update_fn, s)


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
      strategy: see :func:`scale_by_plumage`, as for ``resample_every``, ``realign``,
        ``unbiased_scaling``, ``b1``, ``b2``, ``eps``, ``eps_root``, ``scale``, ``seed``,
        ``weight_dimension_numbers``, ``mask``, ``adaptive_refresh``, ``communicate``,
        ``communicate_refresh``, ``axis_name`` and ``distribute_refresh``.

    Returns:
      A :class:`PlumageTransformation`: the chain :func:`scale_by_plumage`,
      ``optax.add_decayed_weights``, ``optax.scale_by_learning_rate`` (its state holds the
      :class:`PlumageState`, see :func:`find_plumage_state`).

    Raises:
      ValueError, TypeError: as :func:`scale_by_plumage`.
    """
    core = scale_by_plumage(
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
    )
    chain = optax.chain(core, optax.add_decayed_weights(weight_decay, weight_decay_mask),
                        optax.scale_by_learning_rate(learning_rate))
    return PlumageTransformation(chain.init, chain.update, core.settings)


def find_plumage_state(opt_state: Any) -> PlumageState:
    """The :class:`PlumageState` inside a possibly nested optimizer state, found by type
    (``optax.tree.get``), not by position.

    Args:
      opt_state: an optimizer state that holds one :class:`PlumageState` anywhere.

    Returns:
      That state.

    Raises:
      ValueError: there is none, or more than one (a chain with two PLUMAGE stages must pick
        its state itself).
    """
    try:
        state = optax.tree.get(opt_state, PlumageState.__name__)
    except KeyError as e:
        raise ValueError(f"more than one PlumageState in the optimizer state: {e}") from e
    if state is None:
        raise ValueError("no PlumageState found in the optimizer state")
    return state


def refresh_due(opt_state: Any) -> jax.Array:
    """Whether the next update should refresh (host-side scheduling for ``plumage_refresh``).

    True before the first refresh and once ``count − last_refresh ≥ refresh_interval`` (the
    interval the :class:`AdaptiveRefresh` rule maintains, if any). Returns a bool array; call
    ``bool(...)`` on the host.

    Args:
      opt_state: an optimizer state holding one :class:`PlumageState`.

    Returns:
      A scalar bool array.
    """
    return _is_due(find_plumage_state(opt_state))

