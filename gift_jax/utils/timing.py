"""The one timer of the package: phases of a loop, and interleaved best-of rounds.

Two ways the package times things, both here:

* :class:`Stopwatch` — seconds spent in named phases of a loop (the trainer's ``train``,
  ``eval``, ``checkpoint``), so that throughput divides by the time of the phase it is about
  and nothing else. JAX dispatch is asynchronous: a phase that ends with device work in flight
  must ``block`` before its clock stops, or its time is charged to the next phase.
* :func:`interleaved_times` — benchmarks of several jitted callables measured in the same
  process, **interleaved**: round r runs every case once before round r+1, so a drift of the
  machine's load (the 2 shared cores of CI) hits all cases alike and their ratio stays honest.
  Each case is compiled and warmed up first; the times are of blocked calls.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

__all__ = ["Stopwatch", "interleaved_times", "timed_call"]


class Stopwatch:
    """Accumulated seconds per named phase: ``with watch.phase("eval"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str, block: Any = None) -> Iterator[None]:
        """Times the block as phase ``name``; ``block`` (a pytree of arrays, or a callable
        returning one) is waited for *before* the clock starts, so device work dispatched
        earlier is not charged to this phase.

        Args:
          name: the phase the block's seconds are added to (e.g. ``"train"``, ``"eval"``).
          block: a pytree of arrays, or a callable returning one, to wait for before the clock
            starts; ``None``: start at once.

        Yields:
          Nothing; the ``with`` block is timed (also when it raises).
        """
        if block is not None:
            jax.block_until_ready(block() if callable(block) else block)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Adds ``seconds`` to phase ``name``.

        Args:
          name: the phase.
          seconds: wall-clock seconds to add.
        """
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def get(self, name: str) -> float:
        """Seconds accumulated in phase ``name`` so far.

        Args:
          name: the phase.

        Returns:
          Its total seconds; 0.0 for a phase never timed.
        """
        return self.seconds.get(name, 0.0)


def timed_call(fn: Callable, *args: Any) -> tuple[float, Any]:
    """``(seconds, result)`` of one blocked call ``fn(*args)``.

    Args:
      fn: the callable (e.g. a jitted function), called once; not warmed up here.
      *args: its arguments.

    Returns:
      ``(seconds, result)``: wall-clock seconds until the result was ready
      (``jax.block_until_ready``), and the result.
    """
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def interleaved_times(cases: Mapping[str, Callable[[], Any]], rounds: int | Mapping[str, int],
                      *, warmup: bool = True) -> dict[str, list[float]]:
    """Seconds of each blocked call of each case over interleaved rounds.

    Args:
      cases: name → a callable of no arguments (close over its inputs; a stateful case may
        update its closure, e.g. feed a step's outputs to the next call).
      rounds: calls per case (one number, or per case: a case with fewer rounds stops
        taking part when its count is reached).
      warmup: call every case once, untimed, first (compilation).

    Returns:
      name → list of seconds, one per round the case took part in.
    """
    counts = {n: (rounds if isinstance(rounds, int) else rounds[n]) for n in cases}
    if warmup:
        for fn in cases.values():
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(max(counts.values(), default=0)):
        for name, fn in cases.items():
            if r < counts[name]:
                times[name].append(timed_call(fn)[0])
    return times
