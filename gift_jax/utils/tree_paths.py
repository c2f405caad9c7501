"""Parameter paths and layer selection: the one pattern language of the package.

A leaf's path is its pytree keys joined by ``/`` (``layers/3/mlp/down_proj/kernel``), with a
trailing Flax ``Variable`` ``value`` key dropped, so a ``nnx.State``, its pure dict and an
optax update tree name a parameter alike. Layers are selected with ``fnmatch`` patterns
(``*`` also matches ``/``), given for the leaf or for its module: ``*/mlp/down_proj`` selects
``layers/0/mlp/down_proj/kernel``. Patterns are case-sensitive and match whole paths
(``embed/*``, not ``embed``, keeps every leaf under ``embed`` out). A pattern that selects
nothing is an error of the setting that holds it: :func:`require_matches` raises the one
:class:`UnmatchedPatternError` of the package, naming the setting.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import Any

import jax

__all__ = [
    "UnmatchedPatternError",
    "flat_paths",
    "join_path",
    "leaf_path",
    "matches",
    "path_mask",
    "require_matches",
    "unmatched",
]

#: How many available paths an :class:`UnmatchedPatternError` shows.
_EXAMPLES = 5


def leaf_path(path: Sequence[Any]) -> str:
    """The '/'-joined path of a pytree key path (``jax.tree_util`` key entries).

    Args:
      path: the key entries of one leaf, as ``jax.tree_util.tree_flatten_with_path`` gives.

    Returns:
      The keys joined by ``/``, a trailing ``/value`` (a Flax ``Variable``) dropped.
    """
    s = jax.tree_util.keystr(tuple(path), simple=True, separator="/")
    return s[: -len("/value")] if s.endswith("/value") else s


def join_path(parts: Iterable[Any]) -> str:
    """The '/'-joined path of plain keys (e.g. the paths of ``nnx.iter_modules``).

    Args:
      parts: the keys, each turned into a string with ``str``.

    Returns:
      The keys joined by ``/``.
    """
    return "/".join(str(p) for p in parts)


def matches(path: str, patterns: str | Sequence[str]) -> bool:
    """Whether ``path`` matches a pattern, given for the leaf or for its module.

    Args:
      path: a '/'-joined leaf path.
      patterns: one ``fnmatch`` pattern or several; a pattern matches ``path`` itself or
        ``path`` as its module's ``kernel`` (``pattern + "/kernel"``), case-sensitively.

    Returns:
      Whether any pattern matches.
    """
    if isinstance(patterns, str):
        patterns = (patterns,)
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + "/kernel")
               for p in patterns)


def unmatched(patterns: Sequence[str], paths: Iterable[str]) -> list[str]:
    """The patterns that select none of ``paths``.

    Args:
      patterns: the ``fnmatch`` patterns of a setting (as for :func:`matches`).
      paths: the '/'-joined leaf paths available.

    Returns:
      The patterns matching no path, in the given order.
    """
    paths = list(paths)
    return [p for p in patterns if not any(matches(path, p) for path in paths)]


class UnmatchedPatternError(ValueError):
    """A layer-selection setting holds patterns that select nothing (a typo, or a model without
    those layers). A ``ValueError``, so callers that catch those keep working."""


def require_matches(patterns: Sequence[str], paths: Iterable[str], setting: str,
                    examples: Iterable[str] | None = None) -> None:
    """Raise :class:`UnmatchedPatternError` unless every pattern selects one of ``paths``.

    The message is one line: the setting (e.g. ``"gift.layers"``), the unmatched patterns and
    the first few available paths (``examples``, default ``paths``: what the user could have
    meant), so every selection in the package reports a typo alike.

    Args:
      patterns: the setting's ``fnmatch`` patterns.
      paths: the '/'-joined leaf paths they may select.
      setting: the setting's name, which starts the message.
      examples: the paths to show as available; ``None``: ``paths``.

    Raises:
      UnmatchedPatternError: a pattern matches none of ``paths``.
    """
    paths = list(paths)
    missing = unmatched(patterns, paths)
    if not missing:
        return
    shown = list(paths if examples is None else examples)
    sample = ", ".join(shown[:_EXAMPLES]) + (", ..." if len(shown) > _EXAMPLES else "")
    raise UnmatchedPatternError(
        f"{setting}: pattern(s) {missing} match no path (available: {sample or 'none'})")


def flat_paths(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` of a pytree (an ``nnx.State`` is read as its pure dict).

    Args:
      tree: a pytree, or anything with a ``to_pure_dict()`` method (an ``nnx.State``).

    Returns:
      ``{leaf path: leaf}`` in flattening order, paths as :func:`leaf_path` gives them.
    """
    to_pure = getattr(tree, "to_pure_dict", None)
    if callable(to_pure):
        tree = to_pure()
    return {leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def path_mask(tree: Any, patterns: Sequence[str]) -> Any:
    """Tree of bools: True where the leaf's path matches one of ``patterns``.

    Args:
      tree: a pytree (e.g. params or updates).
      patterns: the ``fnmatch`` patterns (as for :func:`matches`).

    Returns:
      A pytree of ``tree``'s structure with a Python bool per leaf (e.g. an optax mask).
    """
    return jax.tree_util.tree_map_with_path(lambda p, _: matches(leaf_path(p), patterns), tree)

