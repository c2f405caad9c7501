"""The GIFT stage (arXiv 2607.07494): whiten → any all-reduce stage → unwhiten.

``gift(inner, ...)`` wraps an all-reduce stage ``inner`` (an optax transformation whose update
reduces a pytree across data-parallel replicas inside ``jax.shard_map``) so that the gradients of
the selected linear layers are communicated in near-isotropic coordinates::

    G ──► W·G ──► inner (e.g. FP8 all-reduce) ──► W⁻¹·(Σ W·G) = Σ G   (exact in exact arithmetic)

W is a whitener of the input-side K-FAC factor A = E[x xᵀ] (see :mod:`gift_jax.whitening`);
every stage before the collective is linear, so "whiten locally, reduce, unwhiten" equals
reducing, and only the rounding error of ``inner`` changes frame.  Leaves that are not selected
pass through ``inner`` untouched (the Euclidean frame).

Layer selection.  Param paths are the '/'-joined keys of the pytree (``jax.tree_util.keystr``
with ``simple=True``), with a trailing ``/value`` (the pytree key of a Flax NNX ``Variable``)
dropped, e.g. ``layers/3/mlp/down_proj/kernel``.  A pattern selects a leaf when
``fnmatch.fnmatchcase(path, pattern)`` or ``fnmatchcase(path, pattern + "/kernel")`` holds: a
pattern names either the module (then its ``kernel`` is selected, never its bias) or the leaf
itself.  ``*`` also matches ``/``.  A pattern that selects nothing is an
:class:`~gift_jax.utils.tree_paths.UnmatchedPatternError` (a ``ValueError``).

Dimension numbers.  A selected 2-D leaf is (in × out).  Other leaves need
:class:`GiftDimensionNumbers` (``dimension_numbers={pattern: dims}``; same matching rule):
attention kernels (embed, heads, head_dim) use ``reduction_axis=0, output_axis=(1, 2)``; an
output projection (heads, head_dim, embed) uses ``reduction_axis=(0, 1), output_axis=2``; layers
stacked by ``nnx.scan`` (L, in, out) use ``reduction_axis=1, output_axis=2``.  Axes named in
neither are batch axes, each with its own factor (the convention of optax.contrib.muon).

Refresh semantics.  The stage refreshes exactly on the calls that pass statistics,
``update(g, state, params, gift_stats=stats)``: a static fact at trace time, so the trainer
compiles a refresh variant and an ordinary variant, and the ordinary one does no statistics work
(no ``lax.cond``, no counter that could drift under ``optax.MultiSteps``).  ``stats`` maps each
selected leaf path to its *local* (per-device) mean second moment, shape ``batch + (n, n)``
(what :func:`gift_jax.whitening.capture.with_input_stats` returns); the stage averages it over
``axis_name`` (``None`` = single device), folds it into an EMA (see below), and rebuilds the
factors (spread over the replicas and all-gathered unless ``distribute_refresh=False``), which
are therefore identical on every replica; this step is already whitened with the new factors.
``update(g, state, params, gift_stats=stats, gift_refresh=False)`` only folds the statistics
(no eigendecomposition; the factors stay): a third variant, for statistics gathered more often
than the factors are rebuilt.

The EMA of the statistics (``ema_scheme``).  ``"bias_corrected"`` (the default): a per-*step*
exponential moving average with half-life ``stats_half_life`` steps, corrected for its start
(Adam's bias correction): a fold after ``Δ`` steps (the state counts them, ``stats_count``)
has decay ``β = 2^(−Δ/h)``, the running weight ``w ← β·w + (1 − β)`` (``stats_weight``), and
``A ← A + (1 − β)/w · (Ā − A)``: the EMA is the normalised average of every folded statistic,
weighted by the steps it stands for and their age, so the first fold takes ``Ā`` exactly and
a constant statistic stays exact.  How often statistics are folded is the caller's choice
(every step, every few steps, or on refreshes only); the refresh is only the factorisation's
clock.  ``"artifact"``: the public artifact's rule, ``A ← ema·A + (1 − ema)·Ā`` per fold with
the first statistic taken as is (over 60k steps harmless; over a few hundred steps with folds
on refreshes every 50 steps the step-0 statistic keeps ``0.95³ ≈ 0.86`` of the weight after
200 steps); its state has no ``stats_weight``/``stats_count``.

Robustness: a layer whose reduced statistic is non-finite keeps its previous EMA and gets the
identity factor until the next refresh; a factor that comes out non-finite is rebuilt with
100× damping, then replaced by the identity (:func:`gift_jax.whitening.make_factor`); both
are counted in the state.  When to refresh is the host's decision (e.g. :func:`refresh_due`
every K steps; the artifact's K is 50): the stage refreshes exactly when it is given
``gift_stats`` (without ``gift_refresh=False``), and counts steps since the last refresh.
Before the first refresh the factor is the identity, i.e. the stage is a pass-through to
``inner``.

Projected factor (PLUMAGE composition).  When a PLUMAGE stage before GIFT sends
R = Mᵀ·G (k × out, M = P·D⁻¹ of shape n × k) instead of G, the effective layer input is Mᵀx and
the factor to whiten R with is MᵀAM.  Nothing about k is passed to :func:`gift`: ``init`` sees
only the (k × out) coordinates, so the factors are k-wide, and the projecting stage tells the
state the layers' real input widths n through :meth:`GiftState.with_input_widths` (found by duck
typing, no import), which sizes the statistics n × n.  A layer whose statistics are wider than
its updates is therefore projected (a static fact of the shapes), and its refreshes take
``gift_projection={path: M}`` (shape ``batch + (n, k)``, identical on every replica) together
with ``gift_stats``; the EMA keeps A (n×n) in the layer's own coordinates and the projection is
applied when the factor is built, so refresh GIFT whenever the projection changes.

Error feedback in ``inner`` then lives in whitened coordinates (its buffers hold W·G residuals).
A refresh changes W, so the stage hands ``inner``'s state the change of frame ``W₂W₁⁻¹`` of the
whitened leaves through :func:`gift_jax.comm.stage.reframe_error_feedback`: each replica's
residual becomes ``e ← W₂W₁⁻¹e`` and the shard owners' re-quantization residuals of the
whitened rows are zeroed (they cannot be mapped locally); GIFT never sees the buffers' layout.

Routing (``route_frame`` other than ``"off"``).  Whitening is not better in every frame: under
fp32 accumulation it lowers the whitened-frame and Muon-update round-trip errors but raises the
Euclidean and Adam-update ones, and FP8 ring accumulation changes the balance again.  On each
refresh, after the new factors are built, the selected leaves of this step are reduced three
ways: by the inner all-reduce's transport as they are (``Ĝ_E``) and whitened (``Ĝ_W =
W⁻¹·AR(W·G)``; :func:`gift_jax.comm.stage.transport_only`: the stage's codec, scaling,
accumulation and shards, without error feedback; the whole tree as the step packs it where a
per-tensor scale depends on the packing), and exactly (fp32 ``pmean``, ``Ḡ``).  Per
matrix ``[‖φ(Ĝ_E) − φ(Ḡ)‖², ‖φ(Ĝ_W) − φ(Ḡ)‖², ‖φ(Ḡ)‖²]`` (φ: :func:`frame_map`) decides:
the matrix is sent whitened iff its whitened error is strictly smaller
(``GiftLeafState.use_whitening``; every input is a reduced value, so identical on every
replica),
until the next refresh.  The measurement costs two quantized all-reduces (of the selected
leaves, or of the whole tree where the packing sets their scales) and one fp32 all-reduce of
the selected leaves on refresh steps only.  The transport is a traced
``jnp.where`` between ``W·G`` and ``G`` (and ``W⁻¹·Ĝ`` and ``Ĝ``): a decision is data, never
a recompilation.  The residual
frame of a matrix is ``F = W`` or ``I`` by its route, and the refresh reframes error feedback
by ``F₂F₁⁻¹``.  With ``route_frame="off"`` the state has no routing leaves and the stage is the
paper's GIFT, bit for bit.  A refresh may pass ``gift_route_updates=`` (a pytree like
``updates``) to measure the routing on other gradients than the ones it transports: PLUMAGE
refreshes GIFT on zero coordinates and passes the step's coordinates in the new projection.

FSDP on the data axis.  An inner all-reduce may reduce-scatter some leaves into each
device's shard (:class:`~gift_jax.comm.stage.ScatteredLeaves`, as
:func:`gift_jax.data_parallel_grad` builds it for parameters split over its data axis).  GIFT
whitens the whole per-replica gradient of such a leaf and unwhitens the device's shard of the
reduced one, which the math allows on the output side (``W·G[:, cols] = (W·G)[:, cols]``: a
flax ``(in, out)`` kernel split on its second axis) and on a batch axis (each layer of a stack
with its own factor, sliced to the shard's layers); a selected leaf split on an input
(reduction) axis, on an output axis with ``two_sided=True``, or any selected split leaf with
routing on, is refused in one line naming it (:func:`check_scattered`).

Staleness (``track_coverage=True``).  Every step stores :func:`input_coverage`, the fraction of
each selected layer's input energy its factor's rank-r basis captures: on a refresh from the
step's reduced ``A`` with the new factor (the reference), on ordinary steps from the sums over a
token sample of the inputs that the caller passes as ``gift_coverage={path: lead + (2,)}``
(:func:`gift_jax.whitening.capture.with_input_coverage` with :func:`coverage_bases` of the
state), ``pmean``'d, so identical on every replica.  The host's :func:`refresh_due_adaptive`
reads the ratio.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gift_jax import whitening as wh
from gift_jax.comm.overlap import AroundAllReduce, Frame
from gift_jax.comm.stage import (
    ScatteredLeaves,
    allreduce_axis,
    allreduce_scattered,
    allreduce_spec,
    reframe_error_feedback,
    transport_only,
)
from gift_jax.utils.axes import axis_size, pmean, require_per_device
from gift_jax.utils.linalg import map_matrices_grouped
from gift_jax.utils.matrices import MatrixDimensionNumbers, MatrixView
from gift_jax.utils.tree_paths import leaf_path, matches, require_matches

__all__ = [
    "EMA_SCHEMES",
    "ROUTE_FRAMES",
    "GiftDimensionNumbers",
    "GiftLeafState",
    "GiftState",
    "GiftTransformation",
    "Settings",
    "gift",
    "coverage_basis",
    "coverage_bases",
    "coverage_ratio",
    "fold_statistics",
    "former_state_path",
    "input_coverage",
    "refresh_due",
    "refresh_due_adaptive",
    "select_layers",
    "validate_adaptive_refresh",
]


#: Which axes of a kernel are its input side (whitened: ``reduction_axis``) and its output side
#: (``output_axis``); other axes are batch axes, each index with its own statistics and factor.
#: The matrix view shared with PLUMAGE (:mod:`gift_jax.utils.matrices`, optax's convention).
GiftDimensionNumbers = MatrixDimensionNumbers

#: Values of ``gift(route_frame=...)``: ``"off"`` always whitens (the paper's GIFT); the others
#: route each layer through the transport (whitened or Euclidean) whose measured round-trip
#: error is smaller in that frame (see :func:`frame_errors`).
ROUTE_FRAMES = ("off", "euclidean", "whitened", "adam", "muon")

#: Values of ``gift(ema_scheme=...)`` (module docstring, "The EMA of the statistics"):
#: ``"bias_corrected"`` (a per-step EMA of half-life ``stats_half_life`` steps, normalised by
#: the weight folded so far) or ``"artifact"`` (the public artifact's per-fold EMA ``ema``,
#: the first statistic taken as is).
EMA_SCHEMES = ("bias_corrected", "artifact")


class GiftLeafState(NamedTuple):
    """State of one whitened leaf.  B = product of its batch axes (1 for a plain 2-D kernel);
    a member the stage's settings do not use is ``None`` (no arrays)."""

    stats: jax.Array  # (B, n, n) f32: EMA of A = E[x xᵀ] (reduced)
    factor: Any  # the factor pytree, every leaf with a leading (B,) axis
    out_stats: jax.Array | None = None  # (B, m, m) f32: EMA of E[δ δᵀ] (two_sided)
    basis: jax.Array | None = None  # (B, n, r) f32: top eigvecs (eig_method="subspace")
    use_whitening: jax.Array | None = None  # (B,) bool: whitened transport in use (routing)
    route_error: jax.Array | None = None  # (2, B) f32: [Euclidean, whitened] error (routing)
    coverage: jax.Array | None = None  # (B,) f32: input coverage, last step (track_coverage)
    coverage_ref: jax.Array | None = None  # (B,) f32: the same on the last refresh
    stats_weight: jax.Array | None = None  # (B,) f32: weight folded so far (bias_corrected)


#: The members of :class:`GiftLeafState`.
LEAF_MEMBERS = GiftLeafState._fields

#: A flat state path (``'.'``-joined, as :mod:`gift_jax.training.checkpoint` names arrays)
#: inside a :class:`GiftLeafState`: ``<prefix>whitened.<leaf path>.<member><rest>``.
_LEAF_PATH = re.compile(r"^(?P<prefix>(?:.*\.)?)whitened\.(?P<leaf>.+?)\.(?P<member>"
                        + "|".join(LEAF_MEMBERS) + r")(?P<rest>(?:\..*)?)$")


def former_state_path(path: str) -> str | None:
    """Where the array at a flat ``GiftState`` path lived in the state layout before it was one
    :class:`GiftLeafState` per leaf (gift_jax until December 2026: one dict per member,
    ``<prefix>stats.<leaf path>``, ``<prefix>factors.<leaf path>.<field>``, ...), so that
    checkpoints of that layout restore; ``None`` for a path outside a leaf's state.

    Args:
      path: a ``'.'``-joined path (``'/'`` in dict keys also read as ``'.'``).

    Returns:
      The former path, or ``None``.
    """
    m = _LEAF_PATH.match(path)
    if m is None:
        return None
    member = "factors" if m["member"] == "factor" else m["member"]
    return f"{m['prefix']}{member}.{m['leaf']}{m['rest']}"


class GiftState(NamedTuple):
    """State of :func:`gift`: counters, one :class:`GiftLeafState` per whitened leaf, and the
    wrapped all-reduce stage's state."""

    count: jax.Array  # () int32: steps since the last refresh (0 on a refresh step)
    refreshes: jax.Array  # () int32: refreshes so far (0: factors are the identity)
    damped_fallbacks: jax.Array  # () int32: factors rebuilt with larger damping, cumulative
    identity_fallbacks: jax.Array  # () int32: factors replaced by the identity, cumulative
    whitened: dict[str, GiftLeafState]  # leaf path -> its state
    inner_state: Any  # state of the wrapped all-reduce stage
    stats_count: jax.Array | None = None  # () int32: steps since the last fold (bias_corrected)

    def member(self, name: str) -> dict[str, Any]:
        """``{leaf path: that leaf's member name}`` over the leaves where it is not ``None``
        (e.g. ``member("factor")``: every factor; ``member("use_whitening")``: ``{}`` when
        the stage does not route).

        Args:
          name: a field of :class:`GiftLeafState` (one of :data:`LEAF_MEMBERS`).

        Returns:
          A new dict ``{leaf path: value}``, empty when no leaf has that member.
        """
        return {path: getattr(leaf, name) for path, leaf in self.whitened.items()
                if getattr(leaf, name) is not None}

    def with_members(self, **members: Mapping[str, Any]) -> GiftState:
        """This state with, for each ``name=mapping``, member ``name`` of the leaves in
        ``mapping`` replaced by its values.

        Args:
          **members: ``name={leaf path: new value}`` per :class:`GiftLeafState` field; the
            leaves a mapping does not name keep that member.

        Returns:
          A new :class:`GiftState` (``self`` is unchanged).
        """
        whitened = dict(self.whitened)
        for name, values in members.items():
            for path, value in values.items():
                whitened[path] = whitened[path]._replace(**{name: value})
        return self._replace(whitened=whitened)

    # Projection hook.  A stage before GIFT that sends projected coordinates R = MᵀG (PLUMAGE)
    # finds every GiftState in its communication state by these two members (no import of
    # this module) and tells it the layers' real input widths once, right after ``init``.
    @property
    def layers(self) -> tuple[str, ...]:
        """Paths of the whitened layers (static)."""
        return tuple(sorted(self.whitened))

    def with_input_widths(self, widths: Mapping[str, int]) -> GiftState:
        """This state for coordinates ``R = MᵀG`` of layers whose input width is ``widths[path]``.

        ``init`` saw only the ``(k, out)`` coordinates, so it sized the statistics ``k × k``;
        the EMA of ``A = E[xxᵀ]`` lives in the layer's own input coordinates (``n × n``; the
        projection ``M`` is applied when the factor is built, see ``gift_projection``).  The
        factors keep the coordinates' width ``k``: a layer is projected exactly when its
        statistics are wider than its updates.

        Args:
          widths: ``{leaf path: n}``, the real input width of every whitened layer (keys =
            :attr:`layers`).

        Returns:
          This state with each layer's ``stats`` replaced by zeros ``(B, n, n)``.

        Raises:
          ValueError: a ``two_sided`` stage's state, or ``widths`` keys other than the whitened
            layers.
        """
        if self.member("out_stats"):
            raise ValueError("gift: two_sided whitening cannot take projected coordinates "
                             "(its output-side factor needs the full-width gradient)")
        if set(widths) != set(self.whitened):
            raise ValueError(f"gift: input widths given for {sorted(widths)}, but the stage "
                             f"whitens {sorted(self.whitened)}")
        stats = {path: jnp.zeros((a.shape[0], widths[path], widths[path]), a.dtype)
                 for path, a in self.member("stats").items()}
        return self.with_members(stats=stats)


def refresh_due(step: int, refresh_every: int) -> bool:
    """Host-side schedule: refresh (pass ``gift_stats``) on steps 0, K, 2K, ...

    Args:
      step: the 0-based step about to run.
      refresh_every: the refresh period ``K``.

    Returns:
      Whether ``step`` is a refresh step.
    """
    return step % refresh_every == 0


def frame_map(g: jax.Array, frame: str, factor: Any, adam_eps: float = 1e-8) -> jax.Array:
    """φ(G) of one matrix in the optimizer's frame (fp32).

    The frames of GIFT's round-trip tables (arXiv 2607.07494, Tables I/II;
    :mod:`gift_jax.whitening.fidelity`): ``"euclidean"`` φ(G) = G; ``"whitened"`` φ(G) = W_A G
    (``factor``: the layer's whitener); ``"adam"`` φ(G) = G/(|G| + ε), one Adam step from fresh
    moments (:func:`~gift_jax.whitening.fidelity.adam_normalise`); ``"muon"`` φ(G) = the
    Newton–Schulz polar factor Muon applies (:func:`~gift_jax.whitening.fidelity.
    newton_schulz`).

    Args:
      g: one matrix (any float dtype; computed in fp32).
      frame: ``"euclidean"``, ``"whitened"``, ``"adam"`` or ``"muon"``.
      factor: the layer's whitener (read by ``"whitened"`` only).
      adam_eps: ε of the ``"adam"`` frame.

    Returns:
      φ(G), fp32, of ``g``'s shape.

    Raises:
      ValueError: an unknown ``frame``.
    """
    from gift_jax.whitening import fidelity

    g = jnp.asarray(g, jnp.float32)
    if frame == "whitened":
        return wh.whiten(factor, g)
    if frame == "adam":
        return fidelity.adam_normalise(g, adam_eps)
    if frame == "muon":
        return fidelity.newton_schulz(g)
    if frame != "euclidean":
        raise ValueError(f"frame must be one of {ROUTE_FRAMES[1:]}, got {frame!r}")
    return g


def frame_errors(approx: jax.Array, ref: jax.Array, frame: str, factor: Any,
                 adam_eps: float = 1e-8) -> jax.Array:
    """``[‖φ(Ĝ) − φ(G)‖², ‖φ(G)‖²]`` (shape (2,), fp32) of one matrix (:func:`frame_map`).

    Squared norms (not the ratio) so that replicas can average them before comparing: the
    pooled relative error is √(Σ err² / Σ ref²).

    Args:
      approx: the transported matrix Ĝ.
      ref: the exact matrix G.
      frame, factor, adam_eps: as :func:`frame_map`.

    Returns:
      ``[‖φ(Ĝ) − φ(G)‖², ‖φ(G)‖²]``, shape (2,), fp32.
    """
    a, r = frame_map(approx, frame, factor, adam_eps), frame_map(ref, frame, factor, adam_eps)
    return jnp.stack([jnp.sum((a - r) ** 2), jnp.sum(r**2)])


def whitened_fraction(state: GiftState) -> jax.Array | None:
    """Fraction of the selected matrices sent through the whitened transport (``None`` when
    the stage does not route, ``route_frame="off"``).

    Args:
      state: a :class:`GiftState`.

    Returns:
      A () fp32 fraction, or ``None`` without routing.
    """
    use = state.member("use_whitening")
    if not use:
        return None
    flags = jnp.concatenate([jnp.ravel(u) for u in use.values()])
    return jnp.mean(flags.astype(jnp.float32))


def coverage_basis(factor: Any) -> tuple[jax.Array, jax.Array] | None:
    """The rank-r basis ``B`` (n × r) and input scale ``S`` (n,) in which a factor keeps its
    top directions, or ``None`` for factors that keep every direction (dense, diagonal,
    block).  ``U, 1`` for :class:`~gift_jax.whitening.LowRankIsotropicFactor`;
    ``Q, D^{-1/2}`` for :class:`~gift_jax.whitening.LowRankDiagFactor` (its basis lives in the
    diagonally rescaled frame); the input side of a :class:`~gift_jax.whitening.KroneckerFactor`.
    Works on stacked factors too (leading axes kept).

    Args:
      factor: a factor pytree (:mod:`gift_jax.whitening.factors`), possibly stacked.

    Returns:
      ``(B, S)`` or ``None``.
    """
    if isinstance(factor, wh.KroneckerFactor):
        factor = factor.left
    if isinstance(factor, wh.LowRankDiagFactor):
        return factor.q, factor.d_inv_sqrt
    if isinstance(factor, wh.LowRankIsotropicFactor):
        return factor.u, jnp.ones(factor.u.shape[:-1], jnp.float32)
    return None


def input_coverage(factor: Any, a: jax.Array) -> jax.Array:
    """Fraction of the input energy in a factor's rank-r basis, ``tr(BᵀSASB) / tr(SAS)`` for
    the input second moment ``A = E[xxᵀ]`` (n × n) — the staleness signal of adaptive refresh
    (:func:`refresh_due_adaptive`), = ``E‖BᵀSx‖² / E‖Sx‖²``.  1 for factors without a basis.

    On ordinary steps the stage gets the same ratio from a token sample of the layer inputs
    (:func:`gift_jax.whitening.capture.with_input_coverage`, O(n·r) per sampled token); on a
    refresh it is computed from the step's reduced ``A`` with the new factor: the reference.
    Why inputs and not the reduced gradient ``Ĝ = Σ_t x_t δ_tᵀ`` (free on every step): ``Ĝ``'s
    input-side energy is weighted by the step's backpropagated errors and jumps from step to
    step; on the tiny model (docs/gift_results.md, refresh schedules, 3 seeds) the excess
    whitened-frame error of a factor refreshed every 10 steps correlates −0.87 … −0.93 with
    the input coverage ratio and −0.47 … −0.68 with the gradient's.

    Args:
      factor: one layer's factor (no batch axis).
      a: the layer's input second moment ``A`` (n × n).

    Returns:
      The coverage, a () fp32 in [0, 1].
    """
    bs = coverage_basis(factor)
    if bs is None:
        return jnp.ones((), jnp.float32)
    basis, scale = bs
    sas = scale[:, None] * jnp.asarray(a, jnp.float32) * scale[None, :]
    top = jnp.sum(basis * jnp.matmul(sas, basis, precision="highest"))
    return top / jnp.maximum(jnp.trace(sas), 1e-30)


def coverage_bases(state: GiftState) -> dict[str, tuple[jax.Array, jax.Array]]:
    """``{kernel path: (B (b, n, r), S (b, n))}`` of the selected layers whose factors have a
    basis (:func:`coverage_basis`): what :func:`gift_jax.whitening.capture.with_input_coverage`
    needs on ordinary steps of a ``gift(track_coverage=True)`` stage.

    Args:
      state: a :class:`GiftState`.

    Returns:
      ``{kernel path: (B, S)}`` of the layers whose factor has a basis.
    """
    out = {}
    for path, f in state.member("factor").items():
        bs = coverage_basis(f)
        if bs is not None:
            out[path] = bs
    return out


def coverage_ratio(state: GiftState) -> jax.Array:
    """``min`` over the selected matrices of coverage / coverage just after the last refresh
    (1 where the reference is 0); host side, from a replicated state.

    Args:
      state: a :class:`GiftState` of a ``track_coverage=True`` stage.

    Returns:
      The smallest ratio, a () fp32.
    """
    ratios = [jnp.ravel(jnp.where(ref > 0, cov / jnp.where(ref > 0, ref, 1.0), 1.0))
              for cov, ref in zip(state.member("coverage").values(),
                                  state.member("coverage_ref").values(), strict=True)]
    return jnp.min(jnp.concatenate(ratios))


def validate_adaptive_refresh(threshold: float, min_every: int, max_every: int) -> None:
    """A ``ValueError`` naming the setting unless ``0 < threshold < 1`` and
    ``1 <= min_every <= max_every`` (ints).

    Args:
      threshold: ``refresh_threshold``.
      min_every: ``min_refresh_every``.
      max_every: ``max_refresh_every``.

    Raises:
      ValueError: naming the setting out of range.
    """
    if not (isinstance(threshold, (int, float)) and 0.0 < threshold < 1.0):
        raise ValueError(f"refresh_threshold={threshold!r} must be a number in (0, 1)")
    for name, v in (("min_refresh_every", min_every), ("max_refresh_every", max_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if min_every > max_every:
        raise ValueError(f"min_refresh_every={min_every} must be <= "
                         f"max_refresh_every={max_every}")


def refresh_due_adaptive(state: GiftState, threshold: float, min_every: int,
                         max_every: int) -> bool:
    """Host-side staleness rule (needs ``gift(track_coverage=True)``): refresh before the first
    refresh, when ``max_every`` steps have passed since the last one, or when at least
    ``min_every`` have and :func:`coverage_ratio` has dropped below ``threshold``.

    Reads three replicated scalars of ``state`` (one device→host sync per step, as PLUMAGE's
    adaptive rule).  ``min_every = max_every = K`` is the fixed schedule of :func:`refresh_due`.

    Args:
      state: the replicated :class:`GiftState` of a ``track_coverage=True`` stage.
      threshold: refresh when the coverage ratio drops below this, in (0, 1).
      min_every: the fewest steps between refreshes.
      max_every: the most steps between refreshes.

    Returns:
      Whether the step about to run refreshes (passes ``gift_stats``).

    Raises:
      ValueError: ``state`` does not track coverage.
    """
    if not state.member("coverage"):
        raise ValueError("refresh_due_adaptive needs a gift(track_coverage=True) state")
    if int(state.refreshes) == 0:
        return True
    since = int(state.count) + 1  # this step is the since-th after the last refresh
    if since >= max_every:
        return True
    return since >= min_every and float(coverage_ratio(state)) < threshold


def _layout(path: str, shape: tuple[int, ...], dims: Any) -> MatrixView:
    if dims is None:
        if len(shape) != 2:
            raise ValueError(
                f"gift: selected leaf {path!r} has shape {shape}; a leaf that is not a 2-D "
                "(in × out) kernel needs an entry in dimension_numbers"
            )
        dims = MatrixDimensionNumbers()
    return MatrixView.of(shape, dims, f"gift: dimension_numbers of leaf {path!r}")


def select_layers(
    tree: Any,
    layers: Sequence[str],
    dimension_numbers: Mapping[str, GiftDimensionNumbers] | None = None,
) -> dict[str, MatrixView]:
    """Map each selected leaf path of ``tree`` to its static layout; validates the patterns.

    Args:
      tree: the parameters or gradients.
      layers: GIFT's layer patterns (module docstring).
      dimension_numbers: ``{pattern: GiftDimensionNumbers}`` of non-2-D selected leaves.

    Returns:
      ``{leaf path: MatrixView}`` of the selected leaves.

    Raises:
      ValueError: a pattern that selects nothing, or a non-2-D leaf without dimension numbers.
    """
    dimension_numbers = dict(dimension_numbers or {})
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [(leaf_path(p), x) for p, x in flat]
    out: dict[str, MatrixView] = {}
    for path, x in paths:
        if not matches(path, layers):
            continue
        dims_for = [pat for pat in dimension_numbers if matches(path, pat)]
        dims = dimension_numbers[dims_for[0]] if dims_for else None
        out[path] = _layout(path, tuple(jnp.shape(x)), dims)
    require_matches(layers, (p for p, _ in paths), "gift.layers")
    require_matches(list(dimension_numbers), out, "gift.dimension_numbers")
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Settings:
    """The static settings of one :func:`gift` stage, validated once (:meth:`build`).

    Attributes are :func:`gift`'s arguments, with ``layers`` a tuple and ``axis_name``
    resolved (the inner all-reduce's axis when not given), plus:

    Attributes:
      inner: the wrapped stage with extra-args support (what the update calls).
      reduce_stage: the wrapped stage as built (what :func:`~gift_jax.comm.stage.transport_only`
        and :func:`~gift_jax.comm.stage.reframe_error_feedback` read its bucket plan from).
      comm_axis: the axis the inner all-reduce reduces over (``None``: not an all-reduce).
    """

    layers: tuple[str, ...]
    rank: int
    factor: str
    damping: float
    ema: float | None
    damping_mode: str
    axis_name: Any
    sqrt: str
    block_size: int
    eig_method: str
    eig_iters: int
    eig_oversample: int
    dimension_numbers: Mapping[str, GiftDimensionNumbers] | None
    two_sided: bool
    distribute_refresh: bool
    seed: int
    route_frame: str
    route_adam_eps: float
    track_coverage: bool
    ema_scheme: str
    stats_half_life: float
    inner: Any
    reduce_stage: Any
    comm_axis: Any

    @property
    def routing(self) -> bool:
        """Whether refreshes measure both transports and route (``route_frame != "off"``)."""
        return self.route_frame != "off"

    @property
    def bias_corrected(self) -> bool:
        """Whether the statistics' EMA is the per-step, bias-corrected one (else the
        artifact's per-fold EMA)."""
        return self.ema_scheme == "bias_corrected"

    @property
    def use_basis(self) -> bool:
        """Whether low-rank factors keep their eigenbasis (the warm-started eigensolver)."""
        return self.eig_method == "subspace" and self.factor.startswith("lowrank")

    def select(self, tree: Any) -> dict[str, MatrixView]:
        """The layouts of the selected leaves of ``tree`` (:func:`select_layers`).

        Args:
          tree: the parameters or per-device updates.

        Returns:
          ``{leaf path: MatrixView}`` of the selected leaves.

        Raises:
          ValueError: as :func:`select_layers` (a pattern that selects nothing, or a non-2-D
            leaf without dimension numbers).
        """
        return select_layers(tree, self.layers, self.dimension_numbers)

    @classmethod
    def build(cls, inner: optax.GradientTransformation, layers: Sequence[str] | str,
              **kwargs: Any) -> Settings:
        """Validated settings; ``kwargs`` are :func:`gift`'s other arguments.

        Args:
          inner: the wrapped all-reduce stage (any optax transformation).
          layers: GIFT's layer patterns (a single pattern may be given as a str).
          **kwargs: every other argument of :func:`gift`, by name, all of them required;
            ``axis_name=None`` resolves to the inner all-reduce's axis.

        Returns:
          The frozen :class:`Settings`, with ``inner`` wrapped with extra-args support and the
          stage as given kept as ``reduce_stage``.

        Raises:
          TypeError: ``inner`` is not an optax transformation.
          ValueError: a setting out of range, naming it and what is allowed.
        """
        if not hasattr(inner, "init") or not hasattr(inner, "update"):
            raise TypeError(f"gift: inner must be an optax GradientTransformation, got {inner!r}")
        k = dict(kwargs)
        comm_axis = allreduce_axis(inner)  # what the inner all-reduce reduces over, if it is one
        if k["axis_name"] is None:  # average statistics over the axis the inner all-reduce uses
            k["axis_name"] = comm_axis
        layers = (layers,) if isinstance(layers, str) else tuple(layers)
        if not layers:
            raise ValueError("gift: layers must name at least one pattern")
        if k["factor"] not in wh.FACTOR_KINDS:
            raise ValueError(f"gift: factor must be one of {wh.FACTOR_KINDS}, got {k['factor']!r}")
        if not (isinstance(k["rank"], int) and k["rank"] >= 1):
            raise ValueError(f"gift: rank must be an int >= 1, got {k['rank']!r}")
        if not k["damping"] > 0:
            raise ValueError(f"gift: damping must be > 0, got {k['damping']!r}")
        if k["damping_mode"] not in ("relative", "absolute"):
            raise ValueError(
                f"gift: damping_mode must be 'relative' or 'absolute', got {k['damping_mode']!r}"
            )
        if k["ema_scheme"] not in EMA_SCHEMES:
            raise ValueError(
                f"gift: ema_scheme must be one of {EMA_SCHEMES}, got {k['ema_scheme']!r}")
        if k["ema_scheme"] == "artifact":
            k["ema"] = 0.95 if k["ema"] is None else k["ema"]
            if not 0.0 <= k["ema"] < 1.0:
                raise ValueError(f"gift: ema must be in [0, 1), got {k['ema']!r}")
        elif k["ema"] is not None:
            raise ValueError(f"gift: ema={k['ema']!r} is the per-fold decay of "
                             "ema_scheme='artifact'; pass that scheme with it, or "
                             "stats_half_life= for the bias-corrected EMA")
        h = k["stats_half_life"]
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h < float("inf"):
            raise ValueError(f"gift: stats_half_life must be a number of steps > 0, got {h!r}")
        k["stats_half_life"] = float(h)
        if k["sqrt"] not in ("cholesky", "symmetric"):
            raise ValueError(f"gift: sqrt must be 'cholesky' or 'symmetric', got {k['sqrt']!r}")
        if not (isinstance(k["block_size"], int) and k["block_size"] >= 1):
            raise ValueError(f"gift: block_size must be an int >= 1, got {k['block_size']!r}")
        if k["eig_method"] not in ("eigh", "subspace"):
            raise ValueError(
                f"gift: eig_method must be 'eigh' or 'subspace', got {k['eig_method']!r}")
        if k["eig_iters"] < 0 or k["eig_oversample"] < 0:
            raise ValueError("gift: eig_iters and eig_oversample must be >= 0")
        if k["route_frame"] not in ROUTE_FRAMES:
            raise ValueError(
                f"gift: route_frame must be one of {ROUTE_FRAMES}, got {k['route_frame']!r}")
        if k["route_frame"] != "off" and allreduce_spec(inner) is None:
            raise ValueError(f"gift: route_frame={k['route_frame']!r} measures the round trip "
                             "with the codec of inner, which must be a gift_jax.allreduce stage")
        return cls(layers=layers, inner=optax.with_extra_args_support(inner),
                   reduce_stage=inner, comm_axis=comm_axis, **k)


# -------------------------------------------------------------------- per-layer pieces (pure)


def identity_of(s: Settings, lay: MatrixView) -> Any:
    """The identity factor of a layer whose updates have the layout ``lay`` (leading (B,)).

    Args:
      s: the stage's settings.
      lay: the layout of the layer's updates.

    Returns:
      The identity factor pytree (one-sided or Kronecker), every leaf with a (B,) axis.
    """
    left = wh.identity_factor(s.factor, lay.n_reduction, s.rank, s.block_size)
    if s.two_sided:
        right = wh.identity_factor(s.factor, lay.n_output, s.rank, s.block_size)
        left = wh.KroneckerFactor(left, right)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (lay.batch,) + x.shape), left)


def init_state(s: Settings, params: Any) -> GiftState:
    """The state before the first refresh: zero statistics, identity factors (a pass-through
    to ``inner``), every matrix routed whitened, zero coverage.

    Args:
      s: the stage's settings.
      params: the parameters (or gradients) the stage will see, per device.

    Returns:
      The initial :class:`GiftState`, with ``inner``'s state.

    Raises:
      ValueError: a layer pattern that selects nothing, or missing dimension numbers.
    """
    def leaf(lay: MatrixView) -> GiftLeafState:
        b, n, m = lay.batch, lay.n_reduction, lay.n_output
        zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
        cov = zeros(b) if s.track_coverage else None
        return GiftLeafState(
            stats=zeros(b, n, n), factor=identity_of(s, lay),
            out_stats=zeros(b, m, m) if s.two_sided else None,
            basis=zeros(b, n, min(s.rank, n)) if s.use_basis and s.rank < n else None,
            use_whitening=jnp.ones((b,), bool) if s.routing else None,
            route_error=zeros(2, b) if s.routing else None, coverage=cov, coverage_ref=cov,
            stats_weight=zeros(b) if s.bias_corrected else None)

    z = jnp.zeros((), jnp.int32)
    sel = s.select(params)
    check_scattered(s, sel)
    return GiftState(
        count=z, refreshes=z, damped_fallbacks=z, identity_fallbacks=z,
        whitened={path: leaf(lay) for path, lay in sel.items()},
        inner_state=s.inner.init(params), stats_count=z if s.bias_corrected else None)


def check_scattered(s: Settings, sel: Mapping[str, MatrixView]) -> None:
    """Refuse, in one line naming the leaf and what to do instead, a selected leaf that the
    inner all-reduce reduce-scatters (split over the data axis, FSDP) where whitening cannot
    be undone shard by shard. GIFT whitens the input side: ``W·G[:, cols] = (W·G)[:, cols]``,
    so a leaf split on an output axis (the second axis of a flax ``(in, out)`` kernel) or on a
    batch axis (a layer of a stack, with its own factor) is unwhitened on each device's shard;
    a leaf split on an input (reduction) axis is not (``W⁻¹`` mixes every input row), nor, with
    ``two_sided=True``, one split on an output axis; routing measures whole-leaf transports.

    Args:
      s: the stage's settings.
      sel: ``{leaf path: MatrixView}`` of the selected leaves.

    Raises:
      ValueError: a selected leaf split where its whitening cannot be undone shard by shard.
    """
    scattered = allreduce_scattered(s.reduce_stage)
    if scattered is None:
        return
    split = {p: d for p, d in scattered.dims.items() if p in sel}
    ax = scattered.axis
    for path, d in split.items():
        lay = sel[path]
        if d in lay.reduction_axes:
            raise ValueError(
                f"gift: {path!r} is split over {ax!r} on dimension {d}, an input (reduction) "
                f"dimension of its matrix, which GIFT whitens across and cannot unwhiten on a "
                f"shard: split it over {ax!r} on an output dimension (e.g. "
                f"nn.with_partitioning(init, (None, {ax!r})) for a flax (in, out) kernel), "
                "keep it off the data axis, or leave it out of gift(layers=...)")
        if s.two_sided and d in lay.output_axes:
            raise ValueError(
                f"gift: {path!r} is split over {ax!r} on output dimension {d}, which "
                "two_sided=True whitens across: use one-sided GIFT (two_sided=False) or keep "
                f"it off {ax!r}")
    if split and s.routing:
        path = next(iter(split))
        raise ValueError(
            f"gift: route_frame={s.route_frame!r} measures whole-leaf transports, but {path!r} "
            f"is split over {ax!r} and reduce-scattered into its shards: use "
            "route_frame='off' with FSDP on the data axis, or leave it out of gift(layers=...)")


def check_stats(name: str, given: Any, want_shapes: Mapping[str, tuple[int, ...]]) -> dict:
    """``given`` as a dict, after checking its keys and shapes against ``want_shapes``.

    Args:
      name: the argument's name for the messages (``"gift_stats"``, ``"gift_projection"``…).
      given: what the caller passed, a mapping ``{leaf path: array}``.
      want_shapes: ``{leaf path: expected shape}``; its keys are exactly the keys ``given``
        must have.

    Returns:
      ``given`` as a new ``dict`` (the arrays unchanged).

    Raises:
      ValueError: naming the argument (``gift_stats``…) and the mismatching keys or shape, or
        ``given`` is not a mapping.
    """
    if not isinstance(given, Mapping):
        raise ValueError(f"gift: {name} must be a mapping {{param path: array}}")
    given = {k: v for k, v in given.items()}
    if set(given) != set(want_shapes):
        raise ValueError(
            f"gift: {name} keys {sorted(given)} do not match the selected layers "
            f"{sorted(want_shapes)}"
        )
    for path, want in want_shapes.items():
        if tuple(jnp.shape(given[path])) != want:
            raise ValueError(
                f"gift: {name}[{path!r}] has shape {jnp.shape(given[path])}, expected {want}"
            )
    return given


def reduce_ema(s: Settings, given: Mapping[str, jax.Array], old: Mapping[str, jax.Array]
               ) -> tuple[dict, dict, dict]:
    """pmean over replicas, then the artifact's EMA per layer ``(B, n, n)``
    (``ema_scheme="artifact"``; the bias-corrected one is in :func:`fold_statistics`).

    ``A ← ema·A + (1 − ema)·Ā`` with ``Ā`` this step's reduced statistic. A layer whose
    reduced statistic is non-finite keeps its old statistic (the EMA is never poisoned); a
    layer with no statistic yet (zero trace) takes the new one as is.

    Args:
      s: the stage's settings (``axis_name``, ``ema``).
      given: the checked local statistics ``{leaf path: batch + (n, n)}`` (any float dtype;
        reshaped to ``old``'s shape).
      old: the EMA so far, ``{leaf path: (B, n, n)}`` fp32 (zeros before the first refresh).

    Returns:
      ``(new stats, finite mask (B,) per layer, this step's reduced stats)``, each a dict over
      the paths of ``given``; the statistics ``(B, n, n)`` fp32.
    """
    new, finite, reduced = {}, {}, {}
    for path, a in given.items():
        a = pmean(jnp.asarray(a, jnp.float32).reshape(old[path].shape), s.axis_name)
        ok = jnp.all(jnp.isfinite(a), axis=(-2, -1))
        fresh = jnp.trace(old[path], axis1=-2, axis2=-1) == 0
        upd = jnp.where(fresh[:, None, None], a, s.ema * old[path] + (1.0 - s.ema) * a)
        new[path] = jnp.where(ok[:, None, None], upd, old[path])
        finite[path] = ok
        reduced[path] = a
    return new, finite, reduced


def reduce_statistics(s: Settings, given: Mapping[str, jax.Array],
                      old: Mapping[str, jax.Array]) -> tuple[dict, dict]:
    """This step's statistics averaged over the replicas, and which are finite.

    Args:
      s: the stage's settings (``axis_name``).
      given: the checked local statistics ``{leaf path: batch + (n, n)}`` (any float dtype).
      old: the EMA so far, ``{leaf path: (B, n, n)}`` (its shapes are the results').

    Returns:
      ``(reduced {path: (B, n, n)} fp32, finite {path: (B,) bool})`` over ``given``'s paths.
    """
    reduced, finite = {}, {}
    for path, a in given.items():
        a = pmean(jnp.asarray(a, jnp.float32).reshape(old[path].shape), s.axis_name)
        reduced[path] = a
        finite[path] = jnp.all(jnp.isfinite(a), axis=(-2, -1))
    return reduced, finite


def bias_corrected_ema(a: jax.Array, old: jax.Array, weight: jax.Array, decay: jax.Array,
                       keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One fold of the bias-corrected EMA (``ema_scheme="bias_corrected"``) of a stack of
    statistics ``(B, n, n)``.

    With ``β = decay`` (the decay over the steps since the last fold) the running weight
    becomes ``w' = β·w + (1 − β)`` and the EMA ``A' = A + (1 − β)/w' · (Ā − A)``: the average
    of every folded statistic weighted by ``1 − β`` of its fold and its age, normalised by
    the weight so far.  A matrix never folded (``w = 0``, or a zero trace) takes ``Ā``
    exactly; a constant ``Ā`` stays exact (``Ā − A = 0``); a matrix where ``keep`` is false
    (a non-finite statistic) keeps its EMA and weight.

    Args:
      a: this fold's reduced statistics ``(B, n, n)`` fp32.
      old: the EMA ``(B, n, n)`` fp32.
      weight: the weight folded so far ``(B,)`` fp32 (0 before the first fold).
      decay: ``β``, a () fp32 in ``(0, 1]``.
      keep: ``(B,)`` bool, the matrices to update.

    Returns:
      ``(new EMA (B, n, n), new weight (B,))``.
    """
    fresh = (weight == 0) | (jnp.trace(old, axis1=-2, axis2=-1) == 0)
    w_old = jnp.where(fresh, 0.0, weight)
    w_new = decay * w_old + (1.0 - decay)
    alpha = (1.0 - decay) / jnp.where(w_new > 0, w_new, 1.0)
    upd = jnp.where(fresh[:, None, None], a, old + alpha[:, None, None] * (a - old))
    return (jnp.where(keep[:, None, None], upd, old), jnp.where(keep, w_new, weight))


def fold_statistics(s: Settings, state: GiftState, sel: Mapping[str, MatrixView],
                    gift_stats: Any, gift_output_stats: Any = None
                    ) -> tuple[GiftState, dict, dict]:
    """``state`` with this step's statistics reduced over the replicas and folded into the EMA
    by the stage's ``ema_scheme`` (module docstring); the factors are not touched.

    Args:
      s: the stage's settings.
      state: the state before the fold.
      sel: ``{leaf path: MatrixView}`` of this step's updates.
      gift_stats: ``{leaf path: batch + (n, n)}`` local ``E[xxᵀ]``.
      gift_output_stats: with ``two_sided=True``, ``{leaf path: batch + (m, m)}``; else
        ``None``.

    Returns:
      ``(state, finite, step_a)``: the state with ``stats`` (and ``out_stats``) folded, and
      with ``bias_corrected`` the weights folded and ``stats_count`` 0; ``finite`` ``{path:
      (B,) bool}`` (the matrices whose statistics were finite, both sides when two-sided);
      ``step_a`` this step's reduced ``Ā`` ``{path: (B, n, n)}``.

    Raises:
      ValueError: statistics with other keys or shapes than the layers, output statistics
        missing with ``two_sided=True`` or given without it.
    """
    old_stats, old_out_stats = state.member("stats"), state.member("out_stats")
    widths = {path: old_stats[path].shape[-1] for path in sel}  # n: A's side
    in_shapes = {path: lay.batch_shape + (widths[path],) * 2 for path, lay in sel.items()}
    given = check_stats("gift_stats", gift_stats, in_shapes)
    out_given = None
    if s.two_sided:
        if gift_output_stats is None:
            raise ValueError("gift: two_sided=True needs gift_output_stats with gift_stats")
        out_given = check_stats(
            "gift_output_stats", gift_output_stats,
            {p: lay.batch_shape + (lay.n_output,) * 2 for p, lay in sel.items()})
    elif gift_output_stats is not None:
        raise ValueError("gift: gift_output_stats given but two_sided=False")
    if not s.bias_corrected:  # the artifact's per-fold EMA, exactly as before
        stats, finite, step_a = reduce_ema(s, given, old_stats)
        out_stats = old_out_stats
        if s.two_sided:
            out_stats, out_finite, _ = reduce_ema(s, out_given, old_out_stats)
            finite = {p: finite[p] & out_finite[p] for p in finite}
        return state.with_members(stats=stats, out_stats=out_stats), finite, step_a
    step_a, finite = reduce_statistics(s, given, old_stats)
    out_a = {}
    if s.two_sided:
        out_a, out_finite = reduce_statistics(s, out_given, old_out_stats)
        finite = {p: finite[p] & out_finite[p] for p in finite}
    # the decay over the steps this fold stands for (since the last fold, this one included)
    steps = (state.stats_count + 1).astype(jnp.float32)
    decay = jnp.exp2(-steps / jnp.float32(s.stats_half_life))
    weights = state.member("stats_weight")
    stats, out_stats, new_weights = {}, dict(old_out_stats), {}
    for path in sel:
        stats[path], new_weights[path] = bias_corrected_ema(
            step_a[path], old_stats[path], weights[path], decay, finite[path])
        if s.two_sided:
            out_stats[path], _ = bias_corrected_ema(
                out_a[path], old_out_stats[path], weights[path], decay, finite[path])
    state = state.with_members(stats=stats, out_stats=out_stats, stats_weight=new_weights)
    return state._replace(stats_count=jnp.zeros((), jnp.int32)), finite, step_a


def count_step(state: GiftState) -> GiftState:
    """``state`` one step further on a step that neither refreshes nor folds: ``count`` + 1
    (and ``stats_count`` + 1 under the bias-corrected EMA).

    Args:
      state: a :class:`GiftState`.

    Returns:
      The state with its step counters advanced.
    """
    state = state._replace(count=state.count + 1)
    if state.stats_count is not None:
        state = state._replace(stats_count=state.stats_count + 1)
    return state


def build_factor(s: Settings, a: jax.Array, b_stats: jax.Array | None, proj: jax.Array | None,
                 basis: jax.Array | None, key: jax.Array | None) -> tuple[Any, jax.Array, Any]:
    """One layer's factor (no batch axis) from its statistic ``a`` (``MᵀAM`` when projected by
    ``proj = M``), its output statistic for two-sided whitening, and the last eigenbasis for
    the warm-started eigensolver.

    Args:
      s: the stage's settings (factor kind, rank, damping, square root, eigensolver).
      a: the layer's EMA statistic ``A`` (n × n), fp32.
      b_stats: the output-side EMA ``E[δδᵀ]`` (m × m) with ``two_sided=True``, else ``None``.
      proj: the projection ``M`` (n × k) of a layer fed projected coordinates, else ``None``.
      basis: the last eigenbasis (width × r, width = k when projected, else n) to warm-start
        the ``"subspace"`` eigensolver, or ``None`` (no basis kept: the eigensolver of
        :func:`~gift_jax.whitening.make_factor`, if any).
      key: this matrix's PRNG key for the randomized eigensolver, or ``None``
        (``eig_method="eigh"``).

    Returns:
      ``(factor, status, new basis or None)``; status 1: damped fallback, 2: identity.
      ``status`` is a () int32 (0: built as asked; two-sided: the worse side's); the new basis
      is the top eigenvectors (width × r) when ``basis`` was given.
    """
    kw = dict(
        rank=s.rank, damping=s.damping, damping_mode=s.damping_mode, block_size=s.block_size,
        sqrt=s.sqrt, eig_method=s.eig_method, oversample=s.eig_oversample, iters=s.eig_iters,
    )
    if proj is not None:
        a = jnp.matmul(proj.T, jnp.matmul(a, proj, precision="highest"), precision="highest")
    pairs = None
    if basis is not None:  # randomized eigensolver, warm-started from the last basis
        pairs = wh.top_eigenpairs(
            jnp.where(jnp.isfinite(a), a, 0.0), s.rank, "subspace", key=key, init=basis,
            oversample=s.eig_oversample, iters=s.eig_iters,
        )
    f, status = wh.make_factor(a, s.factor, key=key, eigenpairs=pairs, **kw)
    if b_stats is not None:
        k2 = None if key is None else jax.random.fold_in(key, 1)
        g, s2 = wh.make_factor(b_stats, s.factor, key=k2, **kw)
        f, status = wh.KroneckerFactor(f, g), jnp.maximum(status, s2)
    return f, status, None if pairs is None else pairs[0]


# -------------------------------------------------------------------- refresh


def _refresh_statistics(s: Settings, state: GiftState, sel: Mapping[str, MatrixView],
                        gift_stats: Any, gift_output_stats: Any, gift_projection: Any
                        ) -> tuple[GiftState, dict, dict, dict]:
    """A refresh's statistics folded (:func:`fold_statistics`) and its projections checked:
    ``(state, finite, this step's A, projections {path: M} of the projected layers)``."""
    widths = {path: state.whitened[path].stats.shape[-1] for path in sel}  # n: A's side
    projected = [path for path, lay in sel.items() if widths[path] != lay.n_reduction]
    state, finite, step_a = fold_statistics(s, state, sel, gift_stats, gift_output_stats)
    projs = {}
    if projected:
        if gift_projection is None:
            raise ValueError(
                f"gift: layers {projected} receive projected coordinates (statistics wider "
                "than their updates); pass gift_projection={path: M} on refreshes")
        projs = check_stats("gift_projection", gift_projection, {
            p: sel[p].batch_shape + (widths[p], sel[p].n_reduction) for p in projected})
        if s.track_coverage:
            raise ValueError(f"gift: track_coverage=True does not support layers {projected} "
                             "that receive projected coordinates")
    elif gift_projection is not None:
        raise ValueError("gift: gift_projection given, but no layer receives projected "
                         "coordinates (see GiftState.with_input_widths)")
    projs = {p: jnp.asarray(m, jnp.float32).reshape(sel[p].batch, widths[p], sel[p].n_reduction)
             for p, m in projs.items()}
    return state, finite, step_a, projs


def refresh(s: Settings, state: GiftState, sel: Mapping[str, MatrixView], gift_stats: Any,
            gift_output_stats: Any, gift_projection: Any) -> GiftState:
    """The state after a refresh: statistics reduced and folded into the EMA, factors rebuilt
    (spread over the replicas unless ``distribute_refresh=False``), layers with non-finite
    statistics on the identity, fallbacks counted; ``sel``: this step's update layouts.

    Args:
      s: the stage's settings.
      state: the state before the refresh.
      sel: ``{leaf path: MatrixView}`` of this step's updates.
      gift_stats, gift_output_stats, gift_projection: as :func:`update`.

    Returns:
      The refreshed :class:`GiftState` (count 0, refreshes + 1).

    Raises:
      ValueError: statistics (or projections) with other keys or shapes than the layers.
    """
    state, finite, step_a, projs = _refresh_statistics(
        s, state, sel, gift_stats, gift_output_stats, gift_projection)
    stats, out_stats = state.member("stats"), state.member("out_stats")
    key = jax.random.fold_in(jax.random.key(s.seed), state.refreshes)
    jobs = {}
    for path, lay in sel.items():
        keys = jax.random.split(jax.random.fold_in(key, zlib.crc32(path.encode())), lay.batch)
        bas = state.whitened[path].basis
        if bas is not None:  # first refresh: no previous basis → random start
            bas = jnp.where(state.refreshes == 0, jax.random.normal(key, bas.shape), bas)
        jobs[path] = (stats[path], out_stats.get(path) if s.two_sided else None,
                      projs.get(path), bas, keys if s.eig_method == "subspace" else None)
    build = lambda *job: build_factor(s, *job)
    built = map_matrices_grouped(build, jobs, s.axis_name if s.distribute_refresh else None)
    factors, basis, n_damped, n_ident = {}, {}, state.damped_fallbacks, state.identity_fallbacks
    for path, lay in sel.items():
        f, status, nb = built[path]
        # non-finite statistics this refresh → identity (Euclidean) for that layer
        f = jax.tree.map(
            lambda x, i, ok=finite[path]: jnp.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)),
                                                    x, i), f, identity_of(s, lay))
        status = jnp.where(finite[path], status, 2)
        factors[path] = f
        if nb is not None:
            basis[path] = nb
        n_damped = n_damped + jnp.sum(status == 1).astype(jnp.int32)
        n_ident = n_ident + jnp.sum(status == 2).astype(jnp.int32)
    if s.track_coverage:
        cov = {p: jax.vmap(input_coverage)(factors[p], step_a[p]) for p in sel}
        state = state.with_members(coverage=cov, coverage_ref=cov)
    return state.with_members(basis=basis, factor=factors)._replace(
            count=jnp.zeros((), jnp.int32), refreshes=state.refreshes + 1,
            damped_fallbacks=n_damped, identity_fallbacks=n_ident)


# -------------------------------------------------------------------- transport


def transform(updates: Any, sel: Mapping[str, MatrixView], factors: Mapping[str, Any],
              fn: Any, use: Mapping[str, jax.Array] | None = None,
              scattered: ScatteredLeaves | None = None) -> Any:
    """``fn`` (:func:`~gift_jax.whitening.whiten` or ``unwhiten``) on the selected leaves of
    ``updates``; with ``use`` (``{path: (B,) bool}``) only on the matrices routed through the
    whitened transport — a traced select, so a routing change never recompiles.

    Args:
      updates: a pytree of per-device updates.
      sel: ``{leaf path: MatrixView}`` of the selected leaves.
      factors: ``{leaf path: factor pytree}`` with a leading (B,) axis.
      fn: ``whiten`` or ``unwhiten`` of one matrix.
      use: ``{leaf path: (B,) bool}``, or ``None`` for every matrix.
      scattered: the leaves of ``updates`` that are this device's shard of a reduce-scatter
        (:func:`~gift_jax.comm.stage.allreduce_scattered`; :func:`check_scattered` has
        allowed them: split on an output or batch axis), or ``None``.

    Returns:
      ``updates`` with the selected matrices mapped, in their dtypes.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    out = []
    for p, x in flat:
        path = leaf_path(p)
        if path in sel:
            factor, leaf_use = factors[path], None if use is None else use[path]
            if scattered is not None and path in scattered.dims:
                factor, leaf_use = shard_factor(sel[path], factor, leaf_use,
                                                scattered.dims[path], scattered.axis)
            x = map_leaf(sel[path], x, factor, fn, leaf_use)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def shard_factor(lay: MatrixView, factor: Any, use: jax.Array | None, dim: int, axis: str
                 ) -> tuple[Any, jax.Array | None]:
    """The factors (and routes) of this device's shard of a leaf split over ``axis`` on
    dimension ``dim``: all of them for an output axis (whitening acts on the input side, column
    by column), the slice of this device's matrices for a batch axis.

    Args:
      lay: the whole leaf's view.
      factor: its factors, leading (B,) axis.
      use: its routes ``(B,)``, or ``None``.
      dim: the dimension split over ``axis`` (an output or batch axis of ``lay``).
      axis: the mesh axis (bound: inside ``jax.shard_map``).

    Returns:
      ``(factor, use)`` of the shard's matrices.
    """
    if dim not in lay.batch_axes:
        return factor, use
    k = lay.batch_axes.index(dim)
    size = lay.batch_shape[k] // axis_size(axis)
    start = jax.lax.axis_index(axis) * size

    def cut(x):
        y = x.reshape(lay.batch_shape + x.shape[1:])
        y = jax.lax.dynamic_slice_in_dim(y, start, size, axis=k)
        return y.reshape((-1,) + x.shape[1:])

    return jax.tree.map(cut, factor), None if use is None else cut(use)


def map_leaf(lay: MatrixView, x: jax.Array, factor: Any, fn: Any,
             use: jax.Array | None = None) -> jax.Array:
    """``fn`` (``whiten`` or ``unwhiten``) on each matrix of one leaf (:func:`transform`).

    Args:
      lay: the leaf's view, ``(B, n, m)`` matrices.
      x: the leaf.
      factor: its factors, leading (B,) axis.
      fn: ``whiten`` or ``unwhiten`` of one matrix.
      use: ``(B,) bool`` (map only these matrices), or ``None`` (all).

    Returns:
      ``x`` mapped, in its dtype.
    """
    m = lay.to_matrix(x)
    y = jax.vmap(fn)(factor, m)
    if use is not None:
        y = jnp.where(use[:, None, None], y, m.astype(y.dtype))
    return lay.from_matrix(y, shape=x.shape).astype(x.dtype)


def route(s: Settings, updates: Any, sel: Mapping[str, MatrixView], state: GiftState
          ) -> GiftState:
    """New ``use_whitening``/``route_error`` from this step's gradients and the (new)
    factors, measured on the reduced transports: the selected leaves are reduced both ways
    by the inner stage's transport (:func:`~gift_jax.comm.stage.transport_only`: its codec,
    scaling, accumulation and shards; no error feedback) and once exactly (fp32 ``pmean``),
    and each matrix is whitened where its whitened error in the frame is strictly smaller.
    Where the packing sets a selected leaf's scales the transport reduces the whole tree as
    the step packs it, so the recorded errors are those the step produces. Every input of
    the decision is a reduced value: identical on every replica.

    Args:
      s: the stage's settings (``route_frame`` on).
      updates: this step's per-device gradients (the tree the inner stage reduces).
      sel: ``{leaf path: MatrixView}`` of the selected leaves.
      state: the state with this refresh's factors.

    Returns:
      ``state`` with each leaf's ``use_whitening`` (B,) and ``route_error`` (2, B) set.
    """
    leaves = {leaf_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(updates)[0]}
    g = {path: leaves[path] for path in sel}
    white = {path: lay.from_matrix(jax.vmap(wh.whiten)(
        state.whitened[path].factor, lay.to_matrix(g[path])), shape=g[path].shape).astype(
            g[path].dtype) for path, lay in sel.items()}
    euclid, whitened = transport_only(s.reduce_stage, updates, g, white)
    use, err = {}, {}
    frame, eps = s.route_frame, s.route_adam_eps
    for path, lay in sel.items():
        f = state.whitened[path].factor
        exact = lay.to_matrix(pmean(jnp.asarray(g[path], jnp.float32), s.axis_name))
        back = jax.vmap(wh.unwhiten)(f, lay.to_matrix(whitened[path]))
        errs = jax.vmap(lambda a, b, r, fi: jnp.stack([
            frame_errors(a, r, frame, fi, eps)[0], *frame_errors(b, r, frame, fi, eps)]))(
                lay.to_matrix(euclid[path]).astype(jnp.float32), back, exact, f)
        e = errs.T  # (3, B): [err²(Euclidean), err²(whitened), ref²]
        use[path] = e[1] < e[0]
        err[path] = jnp.sqrt(e[:2] / jnp.maximum(e[2], 1e-30))
    return state.with_members(use_whitening=use, route_error=err)


def measured_coverage(s: Settings, state: GiftState, sel: Mapping[str, MatrixView],
                      sums: Any) -> dict[str, jax.Array]:
    """This ordinary step's coverage per matrix from the callers' local sample sums
    ``{path: lead + (2,)}`` (layers with a basis; the others keep 1), pmean'd.

    Args:
      s: the stage's settings (``track_coverage=True``).
      state: the state of the step.
      sel: ``{leaf path: MatrixView}`` of the selected leaves.
      sums: ``gift_coverage``: ``{path: batch + (2,)}`` local sums ``[Σ‖BᵀSx‖², Σ‖Sx‖²]``.

    Returns:
      ``{leaf path: (B,) fp32}`` coverage.

    Raises:
      ValueError: ``sums`` missing, or with other keys or shapes.
    """
    bases = coverage_bases(state)
    if not bases:  # no layer's factor has a basis: nothing can go stale
        return state.member("coverage")
    if sums is None:
        raise ValueError(
            "gift: track_coverage=True needs gift_coverage={path: [Σ‖BᵀSx‖², Σ‖Sx‖²]} on "
            "ordinary steps (gift_jax.whitening.capture.with_input_coverage with "
            "coverage_bases(state))")
    sums = check_stats("gift_coverage", sums, {p: sel[p].batch_shape + (2,) for p in bases})
    cov = state.member("coverage")
    for path, v in sums.items():
        v = pmean(jnp.asarray(v, jnp.float32).reshape(-1, 2), s.axis_name)
        cov[path] = v[:, 0] / jnp.maximum(v[:, 1], 1e-30)
    return cov


def refresh_and_reframe(s: Settings, state: GiftState, sel: Mapping[str, MatrixView],
                        updates: Any, gift_stats: Any, gift_output_stats: Any,
                        gift_projection: Any, gift_route_updates: Any) -> GiftState:
    """A refresh step's state: :func:`refresh`, then :func:`route` (on
    ``gift_route_updates`` when given), then the inner stage's error feedback moved from the
    old frame (``W₁`` where it was whitened, else ``I``) to the new one.

    Args:
      s: the stage's settings.
      state: the state before the refresh.
      sel: ``{leaf path: MatrixView}`` of this step's updates.
      updates: this step's per-device gradients.
      gift_stats, gift_output_stats, gift_projection, gift_route_updates: as :func:`update`.

    Returns:
      The refreshed, routed :class:`GiftState`, its inner error feedback in the new frame.
    """
    old_factors, old_use = state.member("factor"), state.member("use_whitening") or None
    state = refresh(s, state, sel, gift_stats, gift_output_stats, gift_projection)
    if s.routing:
        state = route(s, updates if gift_route_updates is None else gift_route_updates, sel,
                      state)
    new_factors, new_use = state.member("factor"), state.member("use_whitening") or None
    change = lambda t, old=old_factors, new=new_factors: transform(
        transform(t, sel, old, wh.unwhiten, old_use), sel, new, wh.whiten, new_use)
    moved = jax.tree_util.tree_map_with_path(lambda p, _: leaf_path(p) in sel, updates)
    return state._replace(inner_state=reframe_error_feedback(
        state.inner_state, s.reduce_stage, updates, change, moved))


def update(s: Settings, updates: Any, state: GiftState, params: Any = None, *,
           gift_stats: Any = None, gift_output_stats: Any = None, gift_projection: Any = None,
           gift_coverage: Any = None, gift_route_updates: Any = None, gift_refresh: bool = True,
           **extra_args: Any) -> tuple[Any, GiftState]:
    """The stage's update: refresh (when ``gift_stats`` is given), fold the statistics only
    (``gift_stats`` with ``gift_refresh=False``) or count the step, then ``W⁻¹ · inner(W · G)``
    on the selected matrices routed whitened (``G`` elsewhere).

    Args:
      s: the stage's settings.
      updates: this replica's gradients (inside ``shard_map``).
      state: the :class:`GiftState`.
      params: passed to ``inner``.
      gift_stats: on refresh and statistics steps only, ``{leaf path: batch + (n, n)}`` local
        ``E[xxᵀ]``.
      gift_output_stats: with ``two_sided=True``, ``{leaf path: batch + (m, m)}``.
      gift_projection: for layers fed projected coordinates, ``{leaf path: batch + (n, k)}``.
      gift_coverage: with ``track_coverage=True``, on ordinary steps (module docstring).
      gift_route_updates: on a routed refresh, the gradients to measure the routes on.
      gift_refresh: with ``gift_stats``: ``True`` (default) refreshes the factors, ``False``
        folds the statistics into the EMA only (:func:`fold_statistics`; no
        eigendecomposition, the factors and routes stay; with ``track_coverage=True`` the
        coverage is measured on this step's reduced ``Ā``). A static Python bool.
      **extra_args: forwarded to ``inner``.

    Returns:
      ``(the reduced updates, in the Euclidean frame; the new state)``.

    Raises:
      ValueError: an argument given on the wrong kind of step, or with wrong keys/shapes.
    """
    require_per_device(updates, s.comm_axis, "gift_jax.gift")
    sel = s.select(updates)
    check_scattered(s, sel)
    if not isinstance(gift_refresh, bool):
        raise ValueError(f"gift: gift_refresh must be a Python bool, got {gift_refresh!r}")
    if gift_coverage is not None and (gift_stats is not None or not s.track_coverage):
        raise ValueError("gift: gift_coverage is for the ordinary steps of a "
                         "gift(track_coverage=True) stage (refreshes take gift_stats)")
    if gift_stats is not None and gift_refresh:
        state = refresh_and_reframe(s, state, sel, updates, gift_stats, gift_output_stats,
                                    gift_projection, gift_route_updates)
    elif (gift_output_stats is not None or gift_projection is not None
          or gift_route_updates is not None) and gift_stats is None:
        raise ValueError("gift: gift_output_stats/gift_projection/gift_route_updates need "
                         "gift_stats")
    elif gift_stats is not None:  # a statistics step: fold, keep the factors
        if gift_projection is not None or gift_route_updates is not None:
            raise ValueError("gift: gift_projection/gift_route_updates are for refreshes, not "
                             "gift_refresh=False")
        state, _, step_a = fold_statistics(s, state, sel, gift_stats, gift_output_stats)
        state = state._replace(count=state.count + 1)  # steps since the last refresh
        if s.track_coverage:
            cov = {p: jax.vmap(input_coverage)(state.whitened[p].factor, step_a[p])
                   for p in sel}
            state = state.with_members(coverage=cov)
    else:
        state = count_step(state)
        if s.track_coverage:
            state = state.with_members(coverage=measured_coverage(s, state, sel, gift_coverage))
    factors, use = state.member("factor"), state.member("use_whitening") or None
    whitened = transform(updates, sel, factors, wh.whiten, use)
    reduced, inner_state = s.inner.update(whitened, state.inner_state, params, **extra_args)
    out = transform(reduced, sel, factors, wh.unwhiten, use,
                    allreduce_scattered(s.reduce_stage))
    return out, state._replace(inner_state=inner_state)


def frame_in_backward(s: Settings, params: Any, state: GiftState) -> AroundAllReduce:
    """An ordinary step of the stage as a change of frame around its all-reduce, for reducing
    inside the backward pass (:func:`gift_jax.comm.overlap.loss_and_reduced_grads`): each
    group's selected leaves are whitened with this step's factors (routed as :func:`update`
    routes them), reduced and unwhitened in their group's hook — :func:`update` without
    statistics, leaf by leaf, bit for bit.

    Args:
      s: the stage's settings.
      params: the per-device parameters (the gradients' structure).
      state: the :class:`GiftState` before the step.

    Returns:
      The :class:`~gift_jax.comm.overlap.AroundAllReduce`: the inner all-reduce and its state,
      the whitening frame, and the map from the inner stage's new state to the stage's.

    Raises:
      ValueError: ``track_coverage=True`` (its ordinary steps measure the coverage from the
        forward pass's inputs: reduce after the backward).
    """
    if s.track_coverage:
        raise ValueError("gift: a track_coverage=True stage measures each step's input "
                         "coverage (gift_coverage=) and reduces after the backward pass")
    sel = s.select(params)
    state = count_step(state)
    factors, use = state.member("factor"), state.member("use_whitening") or None
    index = {leaf_path(p): i
             for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])}
    views = {index[path]: lay for path, lay in sel.items()}

    def by_leaf(fn):
        def apply(i, x, data, one_layer):
            factor, leaf_use = data
            return map_leaf(views[i].layer_slice() if one_layer else views[i], x, factor, fn,
                            leaf_use)
        return apply

    frame = Frame(by_leaf(wh.whiten), by_leaf(wh.unwhiten),
                  {index[p]: (factors[p], None if use is None else use[p]) for p in sel})
    return AroundAllReduce(s.reduce_stage, state.inner_state, frame,
                           lambda inner_state: state._replace(inner_state=inner_state))


class GiftTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`gift` returns: optax's ``(init, update)`` pair, with its :class:`Settings`
    and :meth:`frame_in_backward` (the in-backward reduction reads it)."""

    settings: Settings

    def __new__(cls, init, update, settings: Settings):
        self = super().__new__(cls, init, update)
        self.settings = settings
        return self

    def frame_in_backward(self, params: Any, state: GiftState) -> AroundAllReduce:
        """:func:`frame_in_backward` of this stage's settings.

        Args:
          params: the per-device parameters.
          state: the :class:`GiftState` before the step.

        Returns:
          The :class:`~gift_jax.comm.overlap.AroundAllReduce` of an ordinary step.
        """
        return frame_in_backward(self.settings, params, state)

    def selected_paths(self, params: Any) -> tuple[str, ...]:
        """The paths of the leaves this stage whitens (every other leaf passes through the
        inner stage untouched): how :func:`gift_jax.data_parallel_grad` knows which leaves
        split over the data axis it may reduce-scatter inside the backward pass.

        Args:
          params: the parameters (or gradients), per device.

        Returns:
          The selected leaf paths.
        """
        return tuple(self.settings.select(params))


def gift(
    inner: optax.GradientTransformation,
    layers: Sequence[str] = ("*/mlp/down_proj",),
    rank: int = 32,
    factor: str = "lowrank_isotropic",
    damping: float = 1e-3,
    ema: float | None = None,
    *,
    damping_mode: str = "relative",
    axis_name: str | tuple[str, ...] | None = None,
    sqrt: str = "cholesky",
    block_size: int = 128,
    eig_method: str = "eigh",
    eig_iters: int = 2,
    eig_oversample: int = 8,
    dimension_numbers: Mapping[str, GiftDimensionNumbers] | None = None,
    two_sided: bool = False,
    distribute_refresh: bool = True,
    seed: int = 0,
    route_frame: str = "off",
    route_adam_eps: float = 1e-8,
    track_coverage: bool = False,
    ema_scheme: str = "bias_corrected",
    stats_half_life: float = 10.0,
) -> optax.GradientTransformationExtraArgs:
    """GIFT: whiten the selected layers' gradients, run ``inner``, unwhiten.

    Args:
      inner: the all-reduce stage (any optax transformation; extra args are forwarded to it).
      layers: path patterns of the layers to whiten (see module docstring).
      rank: r of the low-rank factors (``rank >= n`` gives the exact dense factor).
      factor: one of :data:`gift_jax.whitening.FACTOR_KINDS`.
      damping: ε, relative to tr(A)/n (``damping_mode="relative"``) or absolute.
      ema: with ``ema_scheme="artifact"``, the EMA decay of the statistics per fold
        (``None``: the artifact's 0.95, folded on refreshes); 0 = latest only. Not read by
        the bias-corrected EMA (giving it there is an error: ``stats_half_life`` is its
        decay).
      axis_name: data-parallel axis (or tuple) to average statistics over; ``None`` takes the
        axis of ``inner`` when it is a :func:`gift_jax.allreduce` stage, else one device.
      sqrt: ``"cholesky"`` (W = L⁻¹, the artifact) or ``"symmetric"`` (A^{-1/2}) for the
        dense and block forms.
      block_size: block of ``factor="block_diag"`` (last block may be ragged).
      eig_method: ``"eigh"`` (exact) or ``"subspace"`` (randomized subspace iteration warm-
        started from the previous eigenvectors; ``eig_iters``, ``eig_oversample``).
      dimension_numbers: ``{pattern: GiftDimensionNumbers}`` for non-2-D selected leaves.
      two_sided: also whiten the output side with E[δδᵀ] (K-FAC ablation); refreshes then
        need ``gift_output_stats={path: batch + (m, m)}`` too (both sides come from
        :func:`gift_jax.whitening.capture.kfac_value_and_grad`).
      distribute_refresh: spread a refresh's per-layer factor builds over the replicas of
        ``axis_name`` (each builds ~1/R of the layers, the factors are all-gathered; see
        :mod:`gift_jax.utils.linalg`) instead of every replica building every factor.  The
        factors agree either way up to fp32 rounding, and are bit-identical across replicas.
      seed: seed of the (replica-identical) randomized eigensolver.
      route_frame: one of :data:`ROUTE_FRAMES`.  ``"off"`` (default, the paper's GIFT):
        every selected layer is whitened.  Otherwise each refresh measures, per selected
        matrix and from that step's gradients, the round-trip error of both transports in this
        frame, on the reduced transports against the exact fp32 mean (module docstring;
        every replica takes the same decision) and sends the matrix whitened only where that is
        strictly better, until the next refresh (``GiftLeafState.use_whitening``).  Pick the frame
        the optimizer consumes: ``"adam"`` for AdamW, ``"muon"`` for Muon (the round-trip
        tables: whitening helps the whitened-frame and Muon errors but hurts the Euclidean and
        Adam errors under fp32 accumulation, so a fixed choice is wrong for one of them).
        Needs ``inner`` to be a :func:`gift_jax.allreduce` stage (its codec is measured).
      route_adam_eps: ε of the ``"adam"`` frame (the optimizer's eps).
      track_coverage: keep the staleness signal of :func:`refresh_due_adaptive` in the state
        (:func:`input_coverage`, every step; its value on the last refresh as the
        reference); ordinary steps then need ``gift_coverage=`` (see the module docstring).
      ema_scheme: one of :data:`EMA_SCHEMES`: ``"bias_corrected"`` (default), a per-step EMA
        of half-life ``stats_half_life`` steps normalised by the weight folded so far (the
        state counts the steps between folds), or ``"artifact"``, the artifact's EMA ``ema``
        per fold with the first statistic taken as is (module docstring).
      stats_half_life: the bias-corrected EMA's half-life in steps (> 0): a statistic folded
        ``h`` steps ago weighs half as much as this step's.

    Returns:
      A :class:`GiftTransformation` (an ``optax.GradientTransformationExtraArgs``) with state
      :class:`GiftState`: ``init`` is :func:`init_state`, ``update`` is :func:`update`, over
      the validated :class:`Settings`; with a grouped ``inner`` its ordinary steps can reduce
      inside the backward pass (:func:`gift_jax.comm.overlap.loss_and_reduced_grads`).
    """
    s = Settings.build(
        inner, layers, rank=rank, factor=factor, damping=damping, ema=ema,
        damping_mode=damping_mode, axis_name=axis_name, sqrt=sqrt, block_size=block_size,
        eig_method=eig_method, eig_iters=eig_iters, eig_oversample=eig_oversample,
        dimension_numbers=dimension_numbers, two_sided=two_sided,
        distribute_refresh=distribute_refresh, seed=seed, route_frame=route_frame,
        route_adam_eps=route_adam_eps, track_coverage=track_coverage, ema_scheme=ema_scheme,
        stats_half_life=stats_half_life)
    return GiftTransformation(functools.partial(init_state, s), functools.partial(update, s), s)
