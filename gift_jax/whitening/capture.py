"""Capture of GIFT's K-FAC statistics from a Flax NNX model, only when asked: the input side
A = E[x xᵀ] (:func:`with_input_stats`) and, for two-sided whitening, also the output side
B = E[g gᵀ] (:func:`kfac_value_and_grad`).

GIFT (arXiv 2607.07494) needs, on refresh steps only, the second moment of the input of each
selected linear layer, in fp32, flattened over batch and sequence.  This module computes it
from an unmodified user model: for the duration of one call it swaps the class of each matched
``nnx.Linear`` for a subclass whose ``__call__`` adds ``xᵀx`` (with ``stop_gradient``) to a
temporary :class:`GiftInputSum` variable, then reads the sums, divides by the token count and
restores the model.  The ordinary loss function is untouched, so the non-refresh step does no
statistics work at all.

Recipe::

    loss_fn = lambda model, batch: ...                     # your NNX loss, unchanged
    refresh_loss = gift_jax.whitening.capture.with_input_stats(loss_fn, ["*/mlp/down_proj"])

    # ordinary step: no statistics work at all
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, params)

    # refresh step (a separately compiled variant, e.g. every 50 steps)
    (loss, stats), grads = nnx.value_and_grad(refresh_loss, has_aux=True)(model, batch)
    updates, opt_state = tx.update(grads, opt_state, params, gift_stats=stats)

``stats`` maps the kernel path (``"layers/3/mlp/down_proj/kernel"``; the same key GIFT computes
from the gradient tree) to the *local* mean A of shape ``lead + (n, n)``, where ``lead`` is the
kernel's leading (stacked) axes: layers built with ``nnx.vmap`` and applied with ``nnx.scan``
have one ``(L, n, m)`` kernel and get an ``(L, n, n)`` statistic (the temporary variables ride
along in the scanned state; if your ``nnx.scan`` routes state with ``nnx.StateAxes``, send
``GiftInputSum``/``GiftInputCount`` to axis 0 — the catch-all ``...`` does).  The GIFT stage
averages the local means over the data axis (equal local batch sizes assumed).  Layers are
chosen by the same path rule as :func:`gift_jax.gift.gift`: a pattern matches the module path
(``*/mlp/down_proj``) or the kernel path.

Input coverage (GIFT's adaptive refresh, ordinary steps).  :func:`with_input_coverage` wraps
a loss the same way but, instead of ``A``, adds ``[Σ‖BᵀSx‖², Σ‖Sx‖²]`` over a strided sample of
``samples`` to ``2·samples − 1`` input rows per call (every row of a call with fewer than
``samples``), with ``B, S`` the basis and input scale of each layer's current
factor (:func:`gift_jax.whitening.stage.coverage_bases`): O(samples·n·r) per layer, so a stage
with ``track_coverage=True`` can tell on every step how much of the inputs its rank-r basis
still captures.

Output side (two-sided K-FAC, ``gift(..., two_sided=True)``).  K-FAC (Martens & Grosse 2015,
"Optimizing Neural Networks with Kronecker-factored Approximate Curvature", §3) approximates
the Fisher block of a linear layer ``y = x W`` by ``A ⊗ B`` with ``A = E[x xᵀ]`` and
``B = E[g gᵀ]``, ``g = ∂ℓ/∂y`` the gradient of the *per-example* loss w.r.t. the layer output;
for a sequence model the examples are the tokens.  B needs the backward pass, so it cannot be
read off the forward pass like A; :func:`kfac_value_and_grad` computes the loss, the parameter
gradients and both statistics in one forward + backward pass::

    refresh = gift_jax.whitening.capture.kfac_value_and_grad(loss_fn, ["*/mlp/down_proj"])
    (loss, (a_stats, b_stats)), grads = refresh(model, batch)    # refresh steps only
    updates, opt_state = tx.update(grads, opt_state, params, gift_stats=a_stats,
                                   gift_output_stats=b_stats)

Mechanism: each selected layer's output passes through an identity with a custom VJP,
``y ↦ tap(y, P)``, where ``P`` is a temporary zero (``lead + (m, m)``, fp32) "probe" variable
(:class:`GiftOutputProbe`) on the module; the VJP passes the output cotangent ``δ`` through
unchanged and returns ``Σ_t δ_t δ_tᵀ`` (fp32, tokens flattened over batch and sequence, summed
over calls) as the cotangent of ``P``, so differentiating w.r.t. the probes as well as the
parameters yields ``Σ δ δᵀ`` at the cost of one ``(tokens × m)ᵀ(tokens × m)`` product per layer.
This is the zero-probe trick (add a zero to the output, differentiate w.r.t. it) with the outer
product taken inside the backward pass: the probe has the kernel's static shape (no per-token
probe arrays, no shape-discovery pass), it works with an unmodified user model, layers applied
more than once accumulate like A, and under ``nnx.scan`` the stacked ``(L, m, m)`` probe rides
along in the scanned state like the input sums (with ``nnx.StateAxes`` send
:class:`GiftOutputProbe` to axis 0 too) and gets a per-layer ``(L, m, m)`` gradient.

Scaling convention.  With a mean loss ``L = (1/N) Σ_t ℓ_t`` over the N tokens a layer sees, the
output cotangent is ``δ_t = ∂L/∂y_t = g_t / N`` — O(1/N) — and K-FAC's B uses the per-example
``g_t = N δ_t``.  We return the *per-token* second moment, the same convention as A (a mean
over the tokens, O(1) whatever the batch size and sequence length)::

    B = E_t[g_t g_tᵀ] = N · Σ_t δ_t δ_tᵀ        (reduction="mean", the default)
    B = (1/N) Σ_t δ_t δ_tᵀ                      (reduction="sum": L = Σ_t ℓ_t, δ_t = g_t)

with N the number of rows (tokens) the layer processed (the same count A is divided by).  Each
replica's local B is then the mean over its tokens, and the GIFT stage's ``pmean`` gives the
global mean (equal local batch sizes), exactly like A.  Why this matters little and still
matters: GIFT's whitening is invariant to a scalar scaling ``B → cB`` up to the damping —
with ``damping_mode="relative"`` (the default: ε = damping·tr(B)/m) the whitener of ``cB`` is
``c^{-1/2}`` times that of ``B`` and unwhitening multiplies by ``c^{1/2}``, so only the
all-reduce's per-tensor/per-block scale sees ``c`` (absorbed up to rounding); with an
*absolute* damping, however, the raw ``Σ_t δ_t δ_tᵀ`` (O(1/N)) would be swamped by ε as the
batch grows, while the per-token B keeps a batch-size-independent scale.  A masked mean loss
``Σ_t m_t ℓ_t / Σ_t m_t`` over ``M = Σ m_t ≤ N`` real tokens gives ``(N/M²)·Σ_t m_t² g_t g_tᵀ``,
a scalar multiple of the mean over the real tokens, harmless under relative damping.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gift_jax.utils.tree_paths import join_path, matches, require_matches

__all__ = [
    "GiftCoverageBasis",
    "GiftCoverageSum",
    "GiftInputCount",
    "GiftInputSum",
    "GiftOutputProbe",
    "find_linear_layers",
    "input_coverage",
    "input_stats",
    "install_capture",
    "install_coverage",
    "kfac_value_and_grad",
    "output_probes",
    "remove_capture",
    "with_input_coverage",
    "with_input_stats",
]

_SUM, _COUNT, _PROBE = "gift_input_sum", "gift_input_count", "gift_output_probe"
_BASIS, _SCALE, _COVERAGE = "gift_coverage_basis", "gift_coverage_scale", "gift_coverage_sum"
REDUCTIONS = ("mean", "sum")
_NODES = "_pytree__nodes"


class GiftInputSum(nnx.Variable):
    """Temporary per-layer Σ x xᵀ (lead + (n, n), fp32) while capturing."""


class GiftInputCount(nnx.Variable):
    """Temporary per-layer token count (lead, fp32) while capturing."""


class GiftOutputProbe(nnx.Variable):
    """Temporary per-layer zero (lead + (m, m), fp32) whose cotangent is Σ δ δᵀ of the layer
    output (see :func:`_output_tap`); present only while capturing the output side."""


class GiftCoverageBasis(nnx.Variable):
    """Temporary per-layer basis ``B`` (lead + (n, r)) and input scale ``S`` (lead + (n,)) of
    the layer's current GIFT factor while measuring input coverage (one variable each)."""


class GiftCoverageSum(nnx.Variable):
    """Temporary per-layer ``[Σ_t ‖Bᵀ S x_t‖², Σ_t ‖S x_t‖²]`` (lead + (2,), fp32) over the
    sampled token rows while measuring input coverage."""


@jax.custom_vjp
def _output_tap(y: jax.Array, probe: jax.Array) -> jax.Array:
    """Identity on ``y``; its VJP sends ``δ`` through and ``Σ_t δ_t δ_tᵀ`` (fp32) to ``probe``."""
    del probe
    return y


def _output_tap_fwd(y, probe):
    del probe
    return y, None


def _output_tap_bwd(_, g):
    d = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
    return g, jnp.einsum("ti,tj->ij", d, d, precision=jax.lax.Precision.HIGHEST)


_output_tap.defvjp(_output_tap_fwd, _output_tap_bwd)


@functools.cache
def _capturing_class(cls: type) -> type:
    """Subclass of an ``nnx.Linear`` class whose call accumulates what the module's temporary
    variables ask for: Σ x xᵀ (:class:`GiftInputSum`), the input coverage sums over a row
    sample (:class:`GiftCoverageSum`), and with a :class:`GiftOutputProbe` it taps its output
    for Σ δ δᵀ (cached, so jit's graph-structure cache sees one type)."""

    def __call__(self, inputs, *args, **kwargs):
        x = jax.lax.stop_gradient(inputs)
        x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        if _SUM in vars(self):
            xtx = jnp.einsum("ti,tj->ij", x, x, precision=jax.lax.Precision.HIGHEST)
            getattr(self, _SUM)[...] = getattr(self, _SUM)[...] + xtx
            getattr(self, _COUNT)[...] = getattr(self, _COUNT)[...] + x.shape[0]
        if _COVERAGE in vars(self):
            sx = x[:: max(1, x.shape[0] // getattr(self, _COVERAGE).samples)]
            sx = sx * getattr(self, _SCALE)[...]
            top = jnp.matmul(sx, getattr(self, _BASIS)[...], precision="highest")
            getattr(self, _COVERAGE)[...] = getattr(self, _COVERAGE)[...] + jnp.stack(
                [jnp.sum(top**2), jnp.sum(sx**2)])
        y = cls.__call__(self, inputs, *args, **kwargs)
        probe = vars(self).get(_PROBE)
        if probe is None:
            return y
        # tapped as (tokens, m): a layer may write its output split (HeadsLinear's heads)
        flat = y.reshape(-1, probe.shape[-1])
        return _output_tap(flat, probe[...]).reshape(y.shape)

    return type(f"GiftCapturing{cls.__name__}", (cls,), {"__call__": __call__})


def find_linear_layers(model: nnx.Module, layers: Sequence[str]) -> dict[str, nnx.Linear]:
    """``{kernel path: module}`` for the ``nnx.Linear`` modules selected by ``layers``.

    Args:
      model: the NNX model (only read).
      layers: GIFT's layer patterns (a single str is one pattern); each matches a module path
        (``*/mlp/down_proj``) or its kernel path.

    Returns:
      ``{kernel path: module}`` of the selected ``nnx.Linear`` modules, in module order.

    Raises:
      UnmatchedPatternError: a pattern that selects no module
        (:class:`~gift_jax.utils.tree_paths.UnmatchedPatternError`, a ``ValueError``).
      ValueError: a pattern that selects a module that is not an ``nnx.Linear``.
    """
    if isinstance(layers, str):
        layers = (layers,)
    found: dict[str, nnx.Linear] = {}
    candidates: list[str] = []  # every module path and its kernel path: what a pattern may name
    linear: list[str] = []  # the kernel paths that can be captured (shown when one is missed)
    for path, module in nnx.iter_modules(model):
        mp = join_path(path)
        kernel_path = f"{mp}/kernel" if mp else "kernel"
        candidates += [mp, kernel_path]
        if isinstance(module, nnx.Linear):
            linear.append(kernel_path)
        chosen = [p for p in layers if matches(mp, p) or matches(kernel_path, p)]
        if not chosen:
            continue
        if not isinstance(module, nnx.Linear):
            raise ValueError(
                f"capture: layers pattern(s) {chosen} select {mp!r}, a "
                f"{type(module).__name__}; only nnx.Linear layers can be captured"
            )
        found[kernel_path] = module
    require_matches(layers, candidates, "capture.layers", examples=linear)
    return found


def output_probes(model: nnx.Module, layers: Sequence[str]) -> dict[str, jax.Array]:
    """``{kernel path: zeros(lead + (m, m), fp32)}``: the probes of :func:`install_capture`'s
    ``output_probes`` (m = the kernel's last axis, lead = its stacked leading axes).

    Args:
      model: the NNX model (only read).
      layers: GIFT's layer patterns (as :func:`find_linear_layers`).

    Returns:
      ``{kernel path: zero probe}`` for every selected layer.

    Raises:
      ValueError: as :func:`find_linear_layers`.
    """
    out = {}
    for path, module in find_linear_layers(model, layers).items():
        shape = module.kernel[...].shape
        out[path] = jnp.zeros(shape[:-2] + (shape[-1], shape[-1]), jnp.float32)
    return out


def _swap_in(module: nnx.Linear, saved: Any) -> tuple[Any, type, Any]:
    """Give ``module`` its capturing class; the handle entry ``(module, original class,
    saved attribute registry)`` that :func:`remove_capture` restores from."""
    orig = type(module)
    # bypass nnx's __setattr__: the class is not graph data
    object.__setattr__(module, "__class__", _capturing_class(orig))
    return module, orig, saved


def _capturing(loss_fn: Callable[..., Any], install: Callable[[Any], dict],
               read: Callable[[dict], dict]) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """``loss_fn(model, ...)`` → ``(out, read(handle))`` with ``install(model)`` in effect for
    the call; the model is restored before returning, also on error."""

    @functools.wraps(loss_fn)
    def wrapped(model, *args, **kwargs):
        handle = install(model)
        try:
            out = loss_fn(model, *args, **kwargs)
            captured = read(handle)
        finally:
            remove_capture(handle)
        return out, captured

    return wrapped


def install_capture(
    model: nnx.Module,
    layers: Sequence[str],
    *,
    output_probes: Mapping[str, jax.Array] | None = None,
) -> dict[str, tuple[Any, type, Any]]:
    """Start capturing: zero the sums and swap the matched modules' class (in place).

    ``output_probes`` (``{kernel path: lead + (m, m) fp32 zeros}``, e.g. from
    :func:`output_probes`, keys = the selected kernel paths) also taps each layer's output: the
    gradient of the loss w.r.t. a probe is ``Σ_t δ_t δ_tᵀ`` of that layer's output cotangents
    (unscaled; :func:`kfac_value_and_grad` scales it).  Returns the handle for
    :func:`input_stats` / :func:`remove_capture`.

    Args:
      model: the NNX model (changed in place until :func:`remove_capture`).
      layers: GIFT's layer patterns.
      output_probes: ``{kernel path: zero probe}`` to also tap the outputs, or ``None``.

    Returns:
      The handle of the installed capture.

    Raises:
      ValueError: as :func:`find_linear_layers`, or ``output_probes`` whose keys are not the
        selected kernel paths or whose shapes are not ``lead + (m, m)``.
    """
    found = find_linear_layers(model, layers)
    if output_probes is not None and set(output_probes) != set(found):
        raise ValueError(
            f"capture: output_probes keys {sorted(output_probes)} do not match the selected "
            f"layers {sorted(found)}"
        )
    handle = {}
    for path, module in found.items():
        saved = copy.copy(vars(module).get(_NODES))  # nnx's per-instance attribute registry
        kernel = module.kernel[...]
        lead, n, m = kernel.shape[:-2], kernel.shape[-2], kernel.shape[-1]
        setattr(module, _SUM, GiftInputSum(jnp.zeros(lead + (n, n), jnp.float32)))
        setattr(module, _COUNT, GiftInputCount(jnp.zeros(lead, jnp.float32)))
        if output_probes is not None:
            probe = output_probes[path]
            if tuple(jnp.shape(probe)) != lead + (m, m):
                raise ValueError(
                    f"capture: output_probes[{path!r}] has shape {jnp.shape(probe)}, expected "
                    f"{lead + (m, m)}"
                )
            setattr(module, _PROBE, GiftOutputProbe(jnp.asarray(probe, jnp.float32)))
        handle[path] = _swap_in(module, saved)
    return handle


def input_stats(handle: dict[str, tuple[Any, type, Any]]) -> dict[str, jax.Array]:
    """``{kernel path: A = Σ x xᵀ / #tokens}`` (lead + (n, n), fp32) from a capture handle.

    Args:
      handle: what :func:`install_capture` returned, read while the capture is installed
        (before :func:`remove_capture`), after the forward pass.

    Returns:
      ``{kernel path: A}``, the mean over every row the layer processed since the install (a
      layer never called gives zeros).
    """
    out = {}
    for path, (module, _, _) in handle.items():
        s, c = getattr(module, _SUM)[...], getattr(module, _COUNT)[...]
        out[path] = s / jnp.maximum(c, 1.0)[..., None, None]
    return out


def remove_capture(handle: dict[str, tuple[Any, type, Any]]) -> None:
    """Restore the modules' classes and delete the temporary variables.

    Args:
      handle: what :func:`install_capture` returned.
    """
    for module, orig, saved in handle.values():
        object.__setattr__(module, "__class__", orig)
        for name in (_SUM, _COUNT, _PROBE, _BASIS, _SCALE, _COVERAGE):
            if name in vars(module):
                delattr(module, name)
        if saved is not None:
            vars(module)[_NODES] = saved


def install_coverage(
    model: nnx.Module,
    bases: Mapping[str, tuple[jax.Array, jax.Array]],
    samples: int = 256,
) -> dict[str, tuple[Any, type, Any]]:
    """Start measuring input coverage (in place): ``bases`` maps a kernel path to the basis
    ``B`` (``(..., n, r)``) and input scale ``S`` (``(..., n)``) of its GIFT factor, leading
    axes reshaped to the kernel's stacked axes.  Each call of a selected layer adds
    ``[Σ_t ‖Bᵀ S x_t‖², Σ_t ‖S x_t‖²]`` over every ``max(1, ⌊T / samples⌋)``-th of its ``T``
    input rows (``⌈T / stride⌉`` rows: all ``T`` when ``T < samples``, else between ``samples``
    and ``2·samples − 1``; O(samples·n·r) work).  Returns the handle for
    :func:`input_coverage` / :func:`remove_capture`.

    Args:
      model: the NNX model (changed in place until :func:`remove_capture`).
      bases: ``{kernel path: (B, S)}``, e.g. :func:`gift_jax.whitening.stage.coverage_bases`
        of the GIFT state; keys must be kernel paths of ``nnx.Linear`` layers.
      samples: the target number of input rows per call to sample, an int >= 1 (up to
        ``2·samples − 1`` are taken, see above).

    Returns:
      The handle of the installed measurement.

    Raises:
      ValueError: ``bases`` keys that are not kernel paths of ``nnx.Linear`` layers, or
        ``samples`` not an int >= 1.
    """
    found = find_linear_layers(model, list(bases))
    if set(found) != set(bases):
        raise ValueError(f"capture: bases keys {sorted(bases)} are not kernel paths of "
                         f"nnx.Linear layers (found {sorted(found)})")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"capture: samples={samples!r} must be an int >= 1")
    handle = {}
    for path, module in found.items():
        saved = copy.copy(vars(module).get(_NODES))
        kernel = module.kernel[...]
        lead, n = kernel.shape[:-2], kernel.shape[-2]
        basis, scale = (jnp.asarray(v, jnp.float32) for v in bases[path])
        basis = basis.reshape(lead + (n, basis.shape[-1]))
        setattr(module, _BASIS, GiftCoverageBasis(basis))
        setattr(module, _SCALE, GiftCoverageBasis(scale.reshape(lead + (n,))))
        setattr(module, _COVERAGE, GiftCoverageSum(jnp.zeros(lead + (2,), jnp.float32),
                                                   samples=samples))
        handle[path] = _swap_in(module, saved)
    return handle


def input_coverage(handle: dict[str, tuple[Any, type, Any]]) -> dict[str, jax.Array]:
    """``{kernel path: [Σ ‖BᵀSx‖², Σ ‖Sx‖²]}`` (lead + (2,), fp32) from a coverage handle.

    Args:
      handle: what :func:`install_coverage` returned, read while it is installed (before
        :func:`remove_capture`), after the forward pass.

    Returns:
      ``{kernel path: sums}``, summed over every call since the install.
    """
    return {path: getattr(module, _COVERAGE)[...] for path, (module, _, _) in handle.items()}


def with_input_coverage(
    loss_fn: Callable[..., Any],
    bases: Mapping[str, tuple[jax.Array, jax.Array]],
    samples: int = 256,
) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """Ordinary-step variant of ``loss_fn(model, ...)`` for GIFT's adaptive refresh: returns
    ``(out, sums)``, ``sums`` the input-coverage sums of :func:`install_coverage` (pass them
    as ``gift_coverage=`` to a ``gift(track_coverage=True)`` stage; ``bases`` from
    :func:`gift_jax.whitening.stage.coverage_bases` of its state).

    The coverage ``Σ‖BᵀSx‖² / Σ‖Sx‖²`` is the fraction of the layer's input energy (in the
    factor's frame) that the factor's rank-r basis captures, i.e. ``tr(BᵀSASB)/tr(SAS)`` for
    ``A`` the second moment of the sampled inputs: it falls as the input distribution rotates
    away from the basis the factor was built on.  Sums, not means, so gradient accumulation
    and layers applied more than once add up; only their ratio is used.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs)``, unchanged.
      bases: ``{kernel path: (B, S)}`` from
        :func:`~gift_jax.whitening.stage.coverage_bases` of the stage's current state.
      samples: the target number of input rows per layer call to sample (an int >= 1,
        checked when the returned function is called; between ``samples`` and
        ``2·samples − 1`` rows are taken from a call with at least ``samples``, as
        :func:`install_coverage`).

    Returns:
      ``fn(model, *args, **kwargs) → (out, {kernel path: [Σ‖BᵀSx‖², Σ‖Sx‖²]})``; it raises
      the ``ValueError`` of :func:`install_coverage`.
    """

    return _capturing(loss_fn, lambda m: install_coverage(m, bases, samples), input_coverage)


def with_input_stats(
    loss_fn: Callable[..., Any], layers: Sequence[str]
) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """Refresh variant of ``loss_fn(model, *args, **kwargs)``: returns ``(out, stats)``.

    ``out`` is whatever ``loss_fn`` returns (so with ``nnx.value_and_grad(..., has_aux=True)``
    a scalar loss gives ``((loss, stats), grads)``; a ``(loss, aux)`` loss needs ``out`` to be
    unpacked by the caller).  The model is restored before returning, also on error.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs)``.
      layers: GIFT's layer patterns.

    Returns:
      ``fn(model, *args, **kwargs) → (out, {kernel path: A = E[x xᵀ]})``.
    """

    return _capturing(loss_fn, lambda m: install_capture(m, layers), input_stats)


def kfac_value_and_grad(
    loss_fn: Callable[..., Any],
    layers: Sequence[str],
    *,
    has_aux: bool = False,
    reduction: str = "mean",
    wrt: Any = nnx.Param,
) -> Callable[..., tuple[tuple[Any, tuple[dict[str, jax.Array], dict[str, jax.Array]]], Any]]:
    """Refresh-step ``nnx.value_and_grad`` of ``loss_fn`` that also captures both K-FAC factors.

    Returns ``fn(model, *args, **kwargs) → ((out, (input_stats, output_stats)), grads)``:

    * ``out``: what ``loss_fn(model, *args, **kwargs)`` returns (a scalar loss, or
      ``(loss, aux)`` with ``has_aux=True``);
    * ``grads``: the gradient of the loss w.r.t. the model's ``wrt`` variables, an
      ``nnx.State`` equal to ``nnx.grad(loss_fn, wrt=wrt)(model, ...)`` (the probes add zero);
    * ``input_stats``: ``{kernel path: A = E_t[x_t x_tᵀ]}`` (``lead + (n, n)``, fp32), exactly
      what :func:`with_input_stats` gives (``gift_stats=``);
    * ``output_stats``: ``{kernel path: B}`` (``lead + (m, m)``, fp32) with the per-token
      convention of the module docstring, ``B = E_t[g_t g_tᵀ] = N·Σ_t δ_t δ_tᵀ`` for a mean
      loss over the layer's N tokens (``reduction="mean"``) or ``(1/N)·Σ_t δ_t δ_tᵀ`` for a sum
      (``reduction="sum"``), ``δ_t = ∂loss/∂y_t`` (``gift_output_stats=``).

    Keys are the kernel paths of :func:`with_input_stats` (GIFT's selected paths).  Use it on
    refresh steps only (it differentiates through the output taps; the ordinary step keeps the
    plain ``nnx.value_and_grad(loss_fn)`` and does no statistics work).  Jit it as you would
    ``nnx.value_and_grad``.  The model is restored before returning, also on error; layers
    stacked with ``nnx.vmap`` and applied with ``nnx.scan`` give ``(L, ·, ·)`` statistics.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs)`` → a scalar loss (or ``(loss, aux)``).
      layers: GIFT's layer patterns (the selected ``nnx.Linear`` layers).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      reduction: ``"mean"`` or ``"sum"``, how ``loss_fn`` reduces over tokens (sets the scale
        of ``B``).
      wrt: the variable filter to differentiate (``nnx.Param``).

    Returns:
      The function described above.

    Raises:
      ValueError: an unknown ``reduction``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"capture: reduction must be one of {REDUCTIONS}, got {reduction!r}")

    def fn(model, *args, **kwargs):
        probes = output_probes(model, layers)

        def f(m, probes):
            handle = install_capture(m, layers, output_probes=probes)
            try:
                out = loss_fn(m, *args, **kwargs)
                stats = input_stats(handle)
                counts = {p: getattr(mod, _COUNT)[...] for p, (mod, _, _) in handle.items()}
            finally:
                remove_capture(handle)
            loss = out[0] if has_aux else out
            return loss, (out, stats, counts)

        (_, (out, a_stats, counts)), (grads, sums) = nnx.value_and_grad(
            f, argnums=(nnx.DiffState(0, wrt), 1), has_aux=True)(model, probes)
        b_stats = {}
        for path, s in sums.items():
            c = counts[path][..., None, None]
            b_stats[path] = s * c if reduction == "mean" else s / jnp.maximum(c, 1.0)
        return (out, (a_stats, b_stats)), grads

    return fn
