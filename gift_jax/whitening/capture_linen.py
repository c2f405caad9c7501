"""GIFT's input statistics ``A = E[x xᵀ]`` from a Flax linen model, only when asked: the linen
counterpart of :func:`gift_jax.whitening.capture.with_input_stats` (NNX).

Recipe::

    loss_fn = lambda model, params, batch: ...   # your linen loss, calling model.apply
    refresh_loss = gift_jax.whitening.capture_linen.with_input_stats(loss_fn, ["*/mlp/down"])

    # ordinary step: no statistics work at all
    loss, grads = jax.value_and_grad(loss_fn, argnums=1)(model, params, batch)
    # refresh step (a separately compiled variant)
    (loss, stats), grads = jax.value_and_grad(refresh_loss, argnums=1, has_aux=True)(
        model, params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, gift_stats=stats)

The loss may take the module's ``apply`` instead (what a flax ``TrainState`` keeps:
``state.apply_fn`` is ``model.apply``): ``loss_fn(apply_fn, params, batch)`` calling
``apply_fn({"params": params}, x)``, captured as ``refresh_loss(state.apply_fn, params,
batch)``.  With :func:`gift_jax.data_parallel_grad` the one recipe is its ``refresh_loss=``
(the statistics go to the stage, beside whatever aux the loss returns)::

    capture = capture_linen.with_input_stats(loss_fn, ["*/mlp_out"])
    grad_fn = gift_jax.data_parallel_grad(
        lambda p, b: loss_fn(model.apply, p, b), mesh, wrap=lambda ar: gift_jax.gift(ar, ...),
        has_aux=True, aux_reduce={"tokens": "sum"},
        refresh_loss=lambda p, b: capture(model.apply, p, b))
    loss, grads, comm_state, aux = grad_fn(params, batch, comm_state, refresh=step % 50 == 0)

Why the loss takes the module.  A linen module is stateless: whatever a layer records leaves
``apply`` only through a ``mutable=`` collection, and leaves a lifted transform (``nn.scan``,
``nn.vmap``) only through a collection the transform carries.  A hook that kept the sums in a
Python variable instead would hold values of ``nn.scan``'s inner trace (an escaped tracer)
and could not stack them per layer.  So the capture must own the ``apply`` call: it hands
``loss_fn`` a view of ``model`` whose ``apply`` is ``model.apply`` with the statistics
collection added to ``mutable=`` (and removed from what it returns), and everything else
(``init``, ``bind``, attributes) is the model's own.  The loss itself is unchanged: called
with the plain module it is the ordinary step.

Mechanism: while that ``apply`` runs, :func:`flax.linen.intercept_methods` sees every
``nn.Dense`` / ``nn.DenseGeneral`` call; a selected one adds ``xᵀx`` (of
``stop_gradient(x)`` in fp32, rows flattened over batch and sequence, the same einsum at
``HIGHEST`` precision as the NNX capture) and its row count to the :data:`COLLECTION`
collection in its own scope (``sow``, summed over calls), before the layer runs.  The sums
are read from the returned collection, so the statistics are exactly the NNX capture's: the
key is the kernel's path in the ``params`` collection (``layers_0/mlp/down/kernel``: the
layer's module path, ``nn.Module.path``, then ``kernel``; the key GIFT computes from the
gradient of ``params``), the value ``Σ x xᵀ / #rows`` of shape ``lead + (n, n)``, fp32.  A
layer called more than once (tied, or several ``apply`` calls in one loss) accumulates over
every call, as in NNX.  Layers are selected by the one pattern rule
(:mod:`gift_jax.utils.tree_paths`): a pattern matches the module path (``*/mlp/down``) or the
kernel path, over the modules the loss calls.

``nn.scan`` (and ``nn.vmap``) over layers: the statistics are stacked per layer like the NNX
capture's under ``nnx.scan`` (an ``(L, n, m)`` kernel gets an ``(L, n, n)`` statistic), if
the transform carries the collection: add ``"gift_input_stats": 0`` to its
``variable_axes`` (``variable_axes={"params": 0, "gift_input_stats": 0}``; the NNX
counterpart is routing ``GiftInputSum`` to axis 0 with ``nnx.StateAxes``).  A selected layer
inside a lifted transform that does not carry it raises a one-line ``ValueError`` saying so.
``nn.remat`` / ``nn.jit`` carry every collection and need nothing.

``nn.DenseGeneral``: ``n`` is the product of the contracted input axes (``axis``, in order),
the layout of the kernel's reduction axes that GIFT's ``dimension_numbers`` flatten; a
``batch_dims`` layer is refused (its kernel's leading axes are not independent layers fed
the same rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import union_filters

from gift_jax.utils.tree_paths import join_path, matches, require_matches

__all__ = ["COLLECTION", "CapturingModule", "with_input_stats"]

#: The linen variable collection the per-layer sums live in while capturing.
COLLECTION = "gift_input_stats"
_SUM, _COUNT = "gift_sum", "gift_count"
_DENSE = (nn.Dense, nn.DenseGeneral)


class _Capture:
    """One capturing call: the patterns, what they selected, every module path seen."""

    def __init__(self, layers: tuple[str, ...]):
        self.layers = layers
        self.seen: list[str] = []  # every module path called (what a pattern may name)
        self.dense: list[str] = []  # the kernel paths that can be captured
        self.sums: list[Any] = []  # the statistics collection of each apply

    def intercept(self, next_fun, args, kwargs, context):
        """The ``nn.intercept_methods`` hook: record the selected Dense inputs, then call.

        Args:
          next_fun: the intercepted method (or the next interceptor).
          args: its positional arguments (a Dense's input first).
          kwargs: its keyword arguments.
          context: flax's ``InterceptorContext`` (the bound module and the method's name).

        Returns:
          What ``next_fun(*args, **kwargs)`` returns.

        Raises:
          ValueError: a pattern selects a module that is not a Dense, or as :func:`_record`.
        """
        module = context.module
        if module.scope is None:  # an unbound module's method: nothing to record or name
            return next_fun(*args, **kwargs)
        mp = join_path(module.scope.path)
        kernel_path = f"{mp}/kernel" if mp else "kernel"
        if mp not in self.seen:
            self.seen.append(mp)
        chosen = [p for p in self.layers if matches(mp, p) or matches(kernel_path, p)]
        is_dense = isinstance(module, _DENSE)
        if is_dense and kernel_path not in self.dense:
            self.dense.append(kernel_path)
        if chosen and not is_dense:
            raise ValueError(
                f"capture.layers: pattern(s) {chosen} select {mp!r}, a {type(module).__name__};"
                " only nn.Dense and nn.DenseGeneral layers can be captured")
        if chosen and context.method_name == "__call__":
            x = args[0] if args else kwargs["inputs"]
            _record(module, mp, x)
        return next_fun(*args, **kwargs)


def _rows(module: nn.Module, mp: str, x: jax.Array) -> jax.Array:
    """The layer's input as ``(rows, n)`` fp32 rows, gradient stopped."""
    x = jax.lax.stop_gradient(jnp.asarray(x))
    if isinstance(module, nn.DenseGeneral):
        batch_dims = module.batch_dims
        if (batch_dims if isinstance(batch_dims, Sequence) else (batch_dims,)):
            raise ValueError(f"capture.layers: {mp!r} is an nn.DenseGeneral with batch_dims="
                             f"{batch_dims}; only layers without batch_dims can be captured")
        axis = module.axis if isinstance(module.axis, Sequence) else (module.axis,)
        axis = sorted(a % x.ndim for a in axis)  # flax's order of the kernel's input axes
        x = jnp.moveaxis(x, axis, list(range(x.ndim - len(axis), x.ndim)))
        x = x.reshape(x.shape[: x.ndim - len(axis)] + (-1,))
    return x.reshape(-1, x.shape[-1]).astype(jnp.float32)


def _record(module: nn.Module, mp: str, x: jax.Array) -> None:
    """Add ``xᵀx`` and the row count to the module's sums in :data:`COLLECTION`."""
    if not module.scope.is_mutable_collection(COLLECTION):
        raise ValueError(
            f"capture.layers: {mp!r} runs inside a lifted transform (nn.scan, nn.vmap) that "
            f"does not carry the {COLLECTION!r} collection; add {COLLECTION!r}: 0 to its "
            "variable_axes")
    x = _rows(module, mp, x)
    n = x.shape[-1]
    xtx = jnp.einsum("ti,tj->ij", x, x, precision=jax.lax.Precision.HIGHEST)
    add = lambda a, b: a + b
    module.sow(COLLECTION, _SUM, xtx, init_fn=lambda: jnp.zeros((n, n), jnp.float32),
               reduce_fn=add)
    module.sow(COLLECTION, _COUNT, x.shape[0], init_fn=lambda: jnp.zeros((), jnp.float32),
               reduce_fn=add)


class CapturingModule:
    """The view of a linen module that :func:`with_input_stats` passes to the loss: ``apply``
    records the selected layers' input sums; every other attribute is the module's own."""

    def __init__(self, module: nn.Module, capture: _Capture):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_capture", capture)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def apply(self, variables: Any, *args, mutable: Any = False, **kwargs) -> Any:
        """``module.apply`` with the statistics collection also mutable (and kept back).

        Args:
          variables: the variables, as for ``nn.Module.apply``.
          *args: the method's positional arguments.
          mutable: the caller's ``mutable=`` (the statistics collection is added to it).
          **kwargs: ``method=``, ``rngs=`` and the method's keyword arguments.

        Returns:
          What ``module.apply(variables, *args, mutable=mutable, **kwargs)`` returns: the
          output, or ``(output, mutated)`` when ``mutable`` asks for collections (without the
          statistics collection).
        """
        capture = self._capture
        with nn.intercept_methods(capture.intercept):
            out, mutated = self._module.apply(
                variables, *args, mutable=union_filters(mutable, COLLECTION), **kwargs)
        mutated = dict(mutated)
        capture.sums.append(mutated.pop(COLLECTION, {}))
        return out if mutable is False else (out, mutated)


def _stats(capture: _Capture) -> dict[str, jax.Array]:
    """``{kernel path: Σ x xᵀ / #rows}`` from the collections of every apply."""
    sums: dict[str, dict[str, jax.Array]] = {}
    for collection in capture.sums:
        for path, leaf in jax.tree_util.tree_flatten_with_path(collection)[0]:
            keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
            layer = sums.setdefault(join_path(keys[:-1]), {})
            layer[keys[-1]] = layer[keys[-1]] + leaf if keys[-1] in layer else leaf
    out = {}
    for mp, layer in sums.items():
        s, c = layer[_SUM], layer[_COUNT]
        out[f"{mp}/kernel" if mp else "kernel"] = s / jnp.maximum(c, 1.0)[..., None, None]
    return out


def _module_of(model: Any) -> nn.Module:
    """The linen module of ``model``: the module itself, or the module whose ``apply`` it is
    (``model.apply``, e.g. a flax ``TrainState``'s ``apply_fn``)."""
    if isinstance(model, nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    if isinstance(owner, nn.Module) and getattr(model, "__name__", None) == "apply":
        return owner
    raise TypeError(
        f"capture_linen: the loss's first argument must be the linen module or its apply "
        f"(model.apply, a TrainState's apply_fn), got {model!r}")


def with_input_stats(
    loss_fn: Callable[..., Any], layers: Sequence[str]
) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """Refresh variant of a linen ``loss_fn(model, *args, **kwargs)``: returns ``(out, stats)``.

    ``loss_fn`` takes the linen module first and calls ``model.apply`` itself (e.g.
    ``loss_fn(model, params, batch)``), or takes the module's ``apply`` first and calls it
    (``loss_fn(apply_fn, params, batch)`` calling ``apply_fn({"params": params}, ...)``: what a
    flax ``TrainState`` holds, ``state.apply_fn``, which is ``model.apply``); the capture passes
    a capturing view of the same kind. See the module docstring for why the capture needs the
    module (or its ``apply``) rather than a closure over it.  ``out`` is whatever ``loss_fn``
    returns (so ``jax.value_and_grad(fn, argnums=1, has_aux=True)(model, params, batch)``
    gives ``((loss, stats), grads)``), ``stats`` is ``{kernel path: A = E[x xᵀ]}`` (``lead + (n,
    n)``, fp32), what the NNX :func:`~gift_jax.whitening.capture.with_input_stats` returns for
    the same model and GIFT's ``gift_stats=`` takes.  Works under ``jax.jit`` (the module is
    hashable: a static argument, or close over it) and inside ``jax.shard_map`` (each device's
    local mean; the stage averages over the data axis).

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs)``, ``model`` a linen module whose
        ``model.apply`` the loss calls (any number of times), or that module's bound
        ``apply`` (``model.apply``, ``TrainState.apply_fn``) that the loss calls.
      layers: GIFT's layer patterns (a single str is one pattern); each matches the module
        path of an ``nn.Dense`` / ``nn.DenseGeneral`` (``*/mlp/down``) or its kernel path.

    Returns:
      ``fn(model, *args, **kwargs) → (out, {kernel path: A})``; calling it raises
      :class:`~gift_jax.utils.tree_paths.UnmatchedPatternError` (a ``ValueError``, one line
      naming ``capture.layers``) for a pattern that selects none of the modules the loss
      called, and ``ValueError`` for a pattern that selects a module other than a Dense, a
      ``DenseGeneral`` with ``batch_dims``, or a selected layer inside an ``nn.scan`` /
      ``nn.vmap`` that does not carry :data:`COLLECTION`, and ``TypeError`` for a first
      argument that is neither a linen module nor its ``apply``.

    Raises:
      TypeError: ``layers`` is not a str or a sequence of str.
    """
    layers = (layers,) if isinstance(layers, str) else tuple(layers)
    if not all(isinstance(p, str) for p in layers):
        raise TypeError(f"capture.layers must be str patterns, got {layers!r}")

    @functools.wraps(loss_fn)
    def wrapped(model, *args, **kwargs):
        capture = _Capture(layers)
        module = _module_of(model)
        view = CapturingModule(module, capture)
        out = loss_fn(view if model is module else view.apply, *args, **kwargs)
        require_matches(layers, capture.seen + [f"{p}/kernel" if p else "kernel"
                                                for p in capture.seen],
                        "capture.layers", examples=capture.dense)
        return out, _stats(capture)

    return wrapped
