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

import time
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from gift_jax.training.program import program_for

__all__ = ["step_times"]


def _timed(step, params, state, batch, refresh):
    t0 = time.perf_counter()
    params, state, metrics = step(params, state, batch, refresh)
    jax.block_until_ready((params, state, metrics))
    return time.perf_counter() - t0, params, state


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
    """
    runs = {}
    for name, config in configs.items():
        program = program_for(config, mesh, compiler_options)
        params, state = program.init()
        tc = config.train
        tokens = np.random.default_rng(seed).integers(
            0, config.model.vocab_size, (tc.global_batch_size, tc.seq_len + 1), np.int32)
        batch = jax.device_put(tokens, program.step.batch_sharding)
        has_refresh = program.optimizer.refresh_every is not None
        for refresh in ((False, True) if has_refresh else (False,)):  # compile + warm up
            _, params, state = _timed(program.step, params, state, batch, refresh)
        runs[name] = dict(step=program.step, params=params, state=state, batch=batch,
                          refresh=has_refresh, every=program.optimizer.refresh_every,
                          ordinary=[], refreshes=[])
    for r in range(max(repeats, refresh_repeats)):
        for run in runs.values():
            kinds = ([False] if r < repeats else []) + (
                [True] if run["refresh"] and r < refresh_repeats else [])
            for refresh in kinds:
                dt, run["params"], run["state"] = _timed(
                    run["step"], run["params"], run["state"], run["batch"], refresh)
                run["refreshes" if refresh else "ordinary"].append(dt)
    rows = []
    for name, run in runs.items():
        row = {"config": name, "ordinary_best": min(run["ordinary"]),
               "ordinary_median": float(np.median(run["ordinary"])),
               "refresh_best": None, "refresh_median": None, "refresh_every": run["every"]}
        if run["refreshes"]:
            row.update(refresh_best=min(run["refreshes"]),
                       refresh_median=float(np.median(run["refreshes"])))
        rows.append(row)
    return rows
