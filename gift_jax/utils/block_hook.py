"""A hook on every block of a model's block stack, set from outside the model.

The models apply their blocks through :func:`gift_jax.models.common.apply_blocks`. While a
:func:`block_hook` is active, that function hands each block's state to the hook before the
block runs — inside the ``nnx.scan`` body when the blocks are scanned, so the hook sees one
layer's slice of the stacked parameters together with that layer's slice of
``per_layer`` (any pytree of arrays stacked over the layers). This is how
:mod:`gift_jax.comm.overlap` reduces a scanned layer's gradient inside the backward loop
(a ``jax.custom_vjp`` on the layer's parameters) without the model knowing about it.

Only scanned block stacks consult the hook: an unrolled stack's parameters are separate
leaves, which the caller can hook before the model is built.

A :func:`block_runner` goes one step further: it runs each block (scanned or unrolled) itself,
given the block's graph and state, the residual stream and the block's other arguments — how
:mod:`gift_jax.comm.fsdp` runs a layer in a ``shard_map`` manual over ``fsdp``, gathering its
weights there and reduce-scattering their gradients in a codec of its choice.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class BlockHook:
    """``fn(block_state, layer_inputs) → block_state`` and its inputs stacked over layers.

    Attributes:
      fn: maps one block's ``nnx.State`` (its arrays; one layer's slice when scanned) and that
        layer's slice of ``per_layer`` to the state the block runs with (same structure,
        shapes and dtypes).
      per_layer: a pytree of arrays whose leading axis is the layer axis.
    """

    fn: Callable[[Any, Any], Any]
    per_layer: Any


_ACTIVE: contextvars.ContextVar[BlockHook | None] = contextvars.ContextVar(
    "gift_jax_block_hook", default=None)


@contextlib.contextmanager
def _set_while(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """``var`` holds ``value`` until the block exits (then what it held before)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def block_hook(fn: Callable[[Any, Any], Any], per_layer: Any
               ) -> contextlib.AbstractContextManager[None]:
    """Activate a :class:`BlockHook` for the scanned block stacks traced inside the block.

    Args:
      fn: ``(block_state, layer_inputs) → block_state``.
      per_layer: the hook's inputs, stacked over the layers (leading axis).

    Returns:
      A context manager; the hook is active until its block exits.
    """
    return _set_while(_ACTIVE, BlockHook(fn, per_layer))


def active_block_hook() -> BlockHook | None:
    """The :class:`BlockHook` of the innermost active :func:`block_hook`, or ``None``."""
    return _ACTIVE.get()


#: ``run(block_fn, graphdef, state, x, *args) → x``: runs one block, ``block_fn(module, x,
#: *args)`` (not rematerialised: the runner places the remat) on ``nnx.merge(graphdef,
#: state)``, or on whatever state it makes of ``state`` first.
BlockRunner = Callable[..., Any]

_RUNNER: contextvars.ContextVar[BlockRunner | None] = contextvars.ContextVar(
    "gift_jax_block_runner", default=None)


def block_runner(run: BlockRunner) -> contextlib.AbstractContextManager[None]:
    """Run every block of the stacks traced inside the block through ``run`` (after the
    :func:`block_hook`, if one is active, has mapped its state).

    Args:
      run: the :data:`BlockRunner`.

    Returns:
      A context manager; the runner is active until its block exits.
    """
    return _set_while(_RUNNER, run)


def active_block_runner() -> BlockRunner | None:
    """The :data:`BlockRunner` of the innermost active :func:`block_runner`, or ``None``."""
    return _RUNNER.get()
