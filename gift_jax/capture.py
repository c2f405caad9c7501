"""Capture of GIFT's input statistics A = E[x xᵀ] from a Flax NNX model, only when asked.

GIFT (arXiv 2607.07494) needs, on refresh steps only, the second moment of the input of each
selected linear layer, in fp32, flattened over batch and sequence.  This module computes it
from an unmodified user model: for the duration of one call it swaps the class of each matched
``nnx.Linear`` for a subclass whose ``__call__`` adds ``xᵀx`` (with ``stop_gradient``) to a
temporary :class:`GiftInputSum` variable, then reads the sums, divides by the token count and
restores the model.  The ordinary loss function is untouched, so the non-refresh step does no
statistics work at all.

Recipe::

    loss_fn = lambda model, batch: ...                     # your NNX loss, unchanged
    refresh_loss = gift_jax.capture.with_input_stats(loss_fn, ["*/mlp/down_proj"])

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
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gift_jax.gift import _matches

__all__ = [
    "GiftInputCount",
    "GiftInputSum",
    "find_linear_layers",
    "input_stats",
    "install_capture",
    "remove_capture",
    "with_input_stats",
]

_SUM, _COUNT = "gift_input_sum", "gift_input_count"
_NODES = "_pytree__nodes"


class GiftInputSum(nnx.Variable):
    """Temporary per-layer Σ x xᵀ (lead + (n, n), fp32) while capturing."""


class GiftInputCount(nnx.Variable):
    """Temporary per-layer token count (lead, fp32) while capturing."""


@functools.cache
def _capturing_class(cls: type) -> type:
    """Subclass of an ``nnx.Linear`` class whose call accumulates Σ x xᵀ (cached, so jit's
    graph-structure cache sees one type)."""

    def __call__(self, inputs, *args, **kwargs):
        x = jax.lax.stop_gradient(inputs)
        x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        xtx = jnp.einsum("ti,tj->ij", x, x, precision=jax.lax.Precision.HIGHEST)
        getattr(self, _SUM)[...] = getattr(self, _SUM)[...] + xtx
        getattr(self, _COUNT)[...] = getattr(self, _COUNT)[...] + x.shape[0]
        return cls.__call__(self, inputs, *args, **kwargs)

    return type(f"GiftCapturing{cls.__name__}", (cls,), {"__call__": __call__})


def _module_path(path: Sequence[Any]) -> str:
    return "/".join(str(p) for p in path)


def find_linear_layers(model: nnx.Module, layers: Sequence[str]) -> dict[str, nnx.Linear]:
    """``{kernel path: module}`` for the ``nnx.Linear`` modules selected by ``layers``.

    Raises ``ValueError`` for a pattern that selects no module, or selects a module that is not
    an ``nnx.Linear``.
    """
    if isinstance(layers, str):
        layers = (layers,)
    found: dict[str, nnx.Linear] = {}
    hits = {pat: 0 for pat in layers}
    for path, module in nnx.iter_modules(model):
        mp = _module_path(path)
        kernel_path = f"{mp}/kernel" if mp else "kernel"
        chosen = [p for p in layers if _matches(mp, p) or _matches(kernel_path, p)]
        if not chosen:
            continue
        if not isinstance(module, nnx.Linear):
            raise ValueError(
                f"capture: layers pattern(s) {chosen} select {mp!r}, a "
                f"{type(module).__name__}; only nnx.Linear layers can be captured"
            )
        for p in chosen:
            hits[p] += 1
        found[kernel_path] = module
    missing = [p for p, c in hits.items() if c == 0]
    if missing:
        raise ValueError(f"capture: layers pattern(s) {missing} match no nnx.Linear module")
    return found


def install_capture(model: nnx.Module, layers: Sequence[str]) -> dict[str, tuple[Any, type, Any]]:
    """Start capturing: zero the sums and swap the matched modules' class (in place).

    Returns the handle for :func:`input_stats` / :func:`remove_capture`.
    """
    handle = {}
    for path, module in find_linear_layers(model, layers).items():
        saved = copy.copy(vars(module).get(_NODES))  # nnx's per-instance attribute registry
        kernel = module.kernel[...]
        lead, n = kernel.shape[:-2], kernel.shape[-2]
        setattr(module, _SUM, GiftInputSum(jnp.zeros(lead + (n, n), jnp.float32)))
        setattr(module, _COUNT, GiftInputCount(jnp.zeros(lead, jnp.float32)))
        orig = type(module)
        # bypass nnx's __setattr__: the class is not graph data
        object.__setattr__(module, "__class__", _capturing_class(orig))
        handle[path] = (module, orig, saved)
    return handle


def input_stats(handle: dict[str, tuple[Any, type, Any]]) -> dict[str, jax.Array]:
    """``{kernel path: A = Σ x xᵀ / #tokens}`` (lead + (n, n), fp32) from a capture handle."""
    out = {}
    for path, (module, _, _) in handle.items():
        s, c = getattr(module, _SUM)[...], getattr(module, _COUNT)[...]
        out[path] = s / jnp.maximum(c, 1.0)[..., None, None]
    return out


def remove_capture(handle: dict[str, tuple[Any, type, Any]]) -> None:
    """Restore the modules' classes and delete the temporary variables."""
    for module, orig, saved in handle.values():
        object.__setattr__(module, "__class__", orig)
        delattr(module, _SUM)
        delattr(module, _COUNT)
        if saved is not None:
            vars(module)[_NODES] = saved


def with_input_stats(
    loss_fn: Callable[..., Any], layers: Sequence[str]
) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """Refresh variant of ``loss_fn(model, *args, **kwargs)``: returns ``(out, stats)``.

    ``out`` is whatever ``loss_fn`` returns (so with ``nnx.value_and_grad(..., has_aux=True)``
    a scalar loss gives ``((loss, stats), grads)``; a ``(loss, aux)`` loss needs ``out`` to be
    unpacked by the caller).  The model is restored before returning, also on error.
    """

    @functools.wraps(loss_fn)
    def wrapped(model, *args, **kwargs):
        handle = install_capture(model, layers)
        try:
            out = loss_fn(model, *args, **kwargs)
            stats = input_stats(handle)
        finally:
            remove_capture(handle)
        return out, stats

    return wrapped
