"""Whole-train-step timing of several run configurations, measured in the same process.

The GIFT and PLUMAGE issues ask for step-time *ratios* (GIFT-FP8 vs Euclidean FP8, PLUMAGE vs
GaLore) measured in the same run.  :func:`step_times` compiles each configuration's ordinary
and refresh step variants (the trainer's own :class:`gift_jax.training.step.TrainStep`:
forward, backward, the data-parallel reduction and the optimizer, inside ``shard_map``) and
times them **interleaved** — round r times every configuration once before round r+1 — so
that a change in machine load between configurations (the 2 shared cores here) hits all of
them alike.  Each call feeds the previous call's outputs (the step donates its inputs), as
training does.  Reported: best and median of the rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from gift_jax.training.program import program_for
from gift_jax.utils.timing import interleaved_times

__all__ = ["step_times"]


class _Chained:
    """A train step variant as a no-argument case: each call feeds the previous call's
    ``(params, state)`` (the step donates its inputs), shared by the run's two variants."""

    def __init__(self, run: dict[str, Any], refresh: bool):
        self.run, self.refresh = run, refresh

    def __call__(self):
        r = self.run
        r["params"], r["state"], metrics = r["step"](r["params"], r["state"], r["batch"],
                                                     self.refresh)
        return r["params"], r["state"], metrics


def step_times(
    configs: Mapping[str, ml_collections.ConfigDict],
    mesh: Mesh,
    *,
    repeats: int = 20,
    refresh_repeats: int = 3,
    seed: int = 0,
    compiler_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Seconds per ordinary and per refresh train step of each named configuration.

    Returns one row per configuration: ``ordinary_best``, ``ordinary_median`` and, when the
    configuration has a refresh variant (GIFT, PLUMAGE), ``refresh_best``,
    ``refresh_median`` and ``refresh_every``; ``None`` otherwise.

    Args:
      configs: ``{name: config}`` of completed, valid trainer configs; each is built into a
        :class:`~gift_jax.training.program.Program` on ``mesh`` and fed one random batch of
        ``train.global_batch_size`` × ``train.seq_len + 1`` tokens.
      mesh: the mesh every configuration runs on.
      repeats: timed ordinary steps per configuration.
      refresh_repeats: timed refresh steps per configuration that has them.
      seed: seed of the random token batch.
      compiler_options: XLA compiler options for the jitted steps (``None``: the defaults).

    Returns:
      One dict per configuration, in ``configs`` order: ``config`` (its name),
      ``ordinary_best`` and ``ordinary_median`` in seconds, ``refresh_best`` and
      ``refresh_median`` (``None`` without a refresh variant) and ``refresh_every``.
    """
    cases, rounds, every = {}, {}, {}
    for name, config in configs.items():
        program = program_for(config, mesh, compiler_options)
        params, state = program.init()
        tc = config.train
        tokens = np.random.default_rng(seed).integers(
            0, config.model.vocab_size, (tc.global_batch_size, tc.seq_len + 1), np.int32)
        run = dict(step=program.step, params=params, state=state,
                   batch=jax.device_put(tokens, program.step.batch_sharding))
        every[name] = program.optimizer.refresh_every
        cases[(name, False)], rounds[(name, False)] = _Chained(run, False), repeats
        if every[name] is not None:
            cases[(name, True)], rounds[(name, True)] = _Chained(run, True), refresh_repeats
    times = interleaved_times(cases, rounds)
    rows = []
    for name in configs:
        row = {"config": name, "ordinary_best": min(times[(name, False)]),
               "ordinary_median": float(np.median(times[(name, False)])),
               "refresh_best": None, "refresh_median": None, "refresh_every": every[name]}
        if (name, True) in times:
            row.update(refresh_best=min(times[(name, True)]),
                       refresh_median=float(np.median(times[(name, True)])))
        rows.append(row)
    return rows
