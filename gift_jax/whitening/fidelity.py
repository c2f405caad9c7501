"""Fidelity metrics of an approximate reduction against the fp32 reference (pure functions).

Every metric compares ``approx`` (e.g. the output of an FP8 all-reduce, possibly wrapped in GIFT)
with ``ref`` (the fp32 reduction of the same gradients), in the frames of GIFT
(arXiv 2607.07494, Tables I/II):

* Euclidean: relative L2 ‖Ĝ − G‖/‖G‖, cosine ⟨Ĝ, G⟩/(‖Ĝ‖‖G‖), max ``|Ĝ − G|``;
* whitened: ‖W(Ĝ − G)‖/‖W G‖ for a whitener W of the layer's input factor (the geometry-aware
  error GIFT reduces; a floating-point format's per-element relative error is frame-invariant,
  so the gain is expected here, not in the Euclidean frame);
* optimizer update: relative L2 between the updates an optimizer would take from Ĝ and from G —
  Adam-normalised ``G/(|G| + eps)`` (this *is* one Adam step from fresh moments with bias
  correction: m̂ = G, v̂ = G²) and Muon-orthogonalised ``polar(G) = U Vᵀ`` (exact SVD, or the
  Newton–Schulz iteration Muon uses).

:func:`fidelity_report` returns a per-leaf dict and an aggregate (norms pooled over leaves;
max over leaves for the max error).  Leaves are keyed by '/'-joined path (as in
:func:`gift_jax.utils.tree_paths.leaf_path`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gift_jax import whitening as wh
from gift_jax.utils.linalg import matmul_highest
from gift_jax.utils.tree_paths import leaf_path

__all__ = [
    "adam_normalise",
    "cosine",
    "fidelity_report",
    "max_abs_error",
    "newton_schulz",
    "polar",
    "relative_l2",
    "whitened_relative_l2",
]

_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic Newton–Schulz coefficients
_TINY = 1e-30


def _f32(x):
    return jnp.asarray(x, jnp.float32)


# The metrics are fp32 reference math, as the rest of the package's: full precision, not the
# reduced (bf16-pass / TF32) default of fp32 matmuls on GPU and TPU.
_hi = matmul_highest


def _vdot(x: jax.Array, y: jax.Array) -> jax.Array:
    """``vdot(x, y)`` at ``Precision.HIGHEST``."""
    return jnp.vdot(x, y, precision=jax.lax.Precision.HIGHEST)


def relative_l2(approx: jax.Array, ref: jax.Array) -> jax.Array:
    """‖approx − ref‖₂ / ‖ref‖₂ (Frobenius), fp32.

    Args:
      approx: the approximate value Ĝ (any shape and float dtype).
      ref: the reference G, of the same shape.

    Returns:
      A () fp32 (the denominator is floored at 1e-30).
    """
    a, r = _f32(approx), _f32(ref)
    return jnp.linalg.norm((a - r).ravel()) / jnp.maximum(jnp.linalg.norm(r.ravel()), _TINY)


def cosine(approx: jax.Array, ref: jax.Array) -> jax.Array:
    """⟨approx, ref⟩ / (‖approx‖‖ref‖), fp32.

    Args:
      approx: the approximate value Ĝ (any shape and float dtype).
      ref: the reference G, of the same shape.

    Returns:
      A () fp32 in [−1, 1] (0 when either is zero).
    """
    a, r = _f32(approx).ravel(), _f32(ref).ravel()
    return _vdot(a, r) / jnp.maximum(jnp.linalg.norm(a) * jnp.linalg.norm(r), _TINY)


def max_abs_error(approx: jax.Array, ref: jax.Array) -> jax.Array:
    """max ``|approx − ref|``.

    Args:
      approx: the approximate value Ĝ (any shape and float dtype).
      ref: the reference G, of the same shape.

    Returns:
      A () fp32, in the units of the gradient.
    """
    return jnp.max(jnp.abs(_f32(approx) - _f32(ref)))


def whitened_relative_l2(approx: jax.Array, ref: jax.Array, factor: NamedTuple) -> jax.Array:
    """‖W(approx − ref)‖ / ‖W ref‖ for a kernel gradient (n × m) and a whitening factor.

    Args:
      approx: the approximate kernel gradient Ĝ (n × m).
      ref: the reference G (n × m).
      factor: one layer's whitening factor W (:mod:`gift_jax.whitening.factors`, no batch
        axis).

    Returns:
      A () fp32.
    """
    return relative_l2(wh.whiten(factor, _f32(approx)), wh.whiten(factor, _f32(ref)))


def adam_normalise(g: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``g / (|g| + eps)``: the first Adam step from fresh moments (bias-corrected m̂ = g, v̂ = g²).

    Args:
      g: a gradient (any shape and float dtype).
      eps: Adam's ε.

    Returns:
      The normalised gradient, fp32, of ``g``'s shape (``|entries| < 1`` for ``eps > 0``).
    """
    g = _f32(g)
    return g / (jnp.abs(g) + eps)


def newton_schulz(g: jax.Array, steps: int = 5) -> jax.Array:
    """Muon's quintic Newton–Schulz approximation of polar(G) for a 2-D G (fp32).

    Args:
      g: a 2-D G (any float dtype; normalised by its Frobenius norm first).
      steps: the number of Newton–Schulz iterations (Muon: 5).

    Returns:
      The estimate of U Vᵀ, fp32, of ``g``'s shape (Muon's coefficients drive the singular
      values near 1, not exactly to 1).
    """
    a, b, c = _NS_COEFFS
    x = _f32(g)
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / (jnp.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        s = _hi(x, x.T)
        x = a * x + _hi(b * s + _hi(c * s, s), x)
    return x.T if transpose else x


def polar(g: jax.Array, method: str = "svd") -> jax.Array:
    """Orthogonal polar factor U Vᵀ of a 2-D G (``"svd"``) or its Newton–Schulz estimate.

    Args:
      g: a 2-D G (any float dtype).
      method: ``"svd"`` (exact, thin SVD) or ``"newton_schulz"`` (:func:`newton_schulz`,
        5 steps).

    Returns:
      U Vᵀ, fp32, of ``g``'s shape.

    Raises:
      ValueError: an unknown ``method``.
    """
    if method == "newton_schulz":
        return newton_schulz(g)
    if method != "svd":
        raise ValueError(f"method must be 'svd' or 'newton_schulz', got {method!r}")
    u, _, vt = jnp.linalg.svd(_f32(g), full_matrices=False)
    return _hi(u, vt)


def _leaf_metrics(a, r, factor, adam_eps, muon):
    na, nr = adam_normalise(a, adam_eps), adam_normalise(r, adam_eps)
    out = {
        "relative_l2": relative_l2(a, r),
        "cosine": cosine(a, r),
        "max_abs_error": max_abs_error(a, r),
        "adam_relative_l2": relative_l2(na, nr),
        "_aerr2": jnp.sum((na - nr) ** 2),
        "_aref2": jnp.sum(nr**2),
        # pooled-aggregate ingredients
        "_err2": jnp.sum((_f32(a) - _f32(r)) ** 2),
        "_ref2": jnp.sum(_f32(r) ** 2),
        "_dot": _vdot(_f32(a).ravel(), _f32(r).ravel()),
        "_app2": jnp.sum(_f32(a) ** 2),
    }
    if jnp.ndim(r) == 2 and muon:
        out["muon_relative_l2"] = relative_l2(polar(a, muon), polar(r, muon))
    if factor is not None:
        e, w = wh.whiten(factor, _f32(a) - _f32(r)), wh.whiten(factor, _f32(r))
        out["whitened_relative_l2"] = jnp.linalg.norm(e) / jnp.maximum(jnp.linalg.norm(w), _TINY)
        out["_werr2"], out["_wref2"] = jnp.sum(e**2), jnp.sum(w**2)
    return out


def fidelity_report(
    approx: Any,
    ref: Any,
    factors: Mapping[str, NamedTuple] | None = None,
    *,
    adam_eps: float = 1e-8,
    muon: str | None = "svd",
) -> dict[str, dict[str, jax.Array]]:
    """Per-leaf metrics ``{path: {metric: value}}`` plus ``"aggregate"``.

    ``factors`` maps leaf paths of 2-D (n × m) kernel gradients to whitening factors (one layer,
    no batch axis); those leaves also get ``whitened_relative_l2``.  ``muon`` is the polar
    method for 2-D leaves (``"svd"``, ``"newton_schulz"``, or None to skip).  The aggregate
    pools squared norms over leaves (so it is the metric of the concatenated gradient: relative
    L2, cosine, Adam and whitened errors) and takes the max of ``max_abs_error``; the Muon error
    is per matrix only (polar factors of different leaves do not pool).

    Args:
      approx: the reduced gradient tree under test (e.g. an FP8 all-reduce's output).
      ref: the exact reference tree of the same structure (e.g. the fp32 mean).
      factors: ``{leaf path: whitening factor}`` of the leaves to also measure in the whitened
        frame, or ``None``.
      adam_eps: ε of the Adam frame ``G/(|G| + ε)``.
      muon: polar method of the Muon frame, or ``None`` to skip it.

    Returns:
      ``{path: {metric: scalar}}`` with an ``"aggregate"`` entry.
    """
    factors = dict(factors or {})
    fa = {leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(approx)[0]}
    fr = {leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(ref)[0]}
    if set(fa) != set(fr):
        raise ValueError("fidelity_report: approx and ref have different tree structures")
    unknown = set(factors) - set(fr)
    if unknown:
        raise ValueError(f"fidelity_report: factors for unknown leaves {sorted(unknown)}")
    per = {p: _leaf_metrics(fa[p], fr[p], factors.get(p), adam_eps, muon) for p in fr}
    tot = lambda k: sum(m[k] for m in per.values() if k in m)
    agg = {
        "relative_l2": jnp.sqrt(tot("_err2") / jnp.maximum(tot("_ref2"), _TINY)),
        "cosine": tot("_dot") / jnp.maximum(jnp.sqrt(tot("_app2") * tot("_ref2")), _TINY),
        "max_abs_error": jnp.max(jnp.stack([m["max_abs_error"] for m in per.values()])),
        "adam_relative_l2": jnp.sqrt(tot("_aerr2") / jnp.maximum(tot("_aref2"), _TINY)),
    }
    if factors:
        agg["whitened_relative_l2"] = jnp.sqrt(tot("_werr2") / jnp.maximum(tot("_wref2"), _TINY))
    report = {p: {k: v for k, v in m.items() if not k.startswith("_")} for p, m in per.items()}
    report["aggregate"] = agg
    return report
