"""Does GIFT's factor follow the model?  The EMA of ``A = E[xxᵀ]`` in a GIFT run's state,
at every refresh, against the statistic of the current model (issue #46, item 1).

A GIFT run of the library's trainer (``comm.method=gift``, ``gift.refresh_every`` K) is walked
to each refresh step ``s``; there, before the step runs, the input second moment of every
whitened layer is computed at the current parameters on a fixed held-out batch (many
sequences of another data stream than training's: the same tokens at every refresh, so the
comparison sees the model move, not the data), then the refresh step runs and the EMA it
rebuilt the factors from is read from the :class:`~gift_jax.whitening.stage.GiftState`.  The
distance is the relative Frobenius norm ``‖A_EMA − A_held-out‖ / ‖A_held-out‖`` per layer.
The same is given for the statistic of step ``s``'s own training batch (what an EMA that kept
only the latest statistic would hold: the sampling noise of one batch).

Two schemes side by side (``gift.ema_scheme``): the artifact's (EMA 0.95 per refresh, the
step-0 statistic unweighted) and the bias-corrected per-step EMA (statistics every
``gift.stats_every`` steps, half-life ``gift.stats_half_life`` steps).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from gift_jax.apps.experiments.roundtrip import Trainer, markdown_table
from gift_jax.models import next_token_loss
from gift_jax.whitening.capture import with_input_stats

__all__ = ["SCHEMES", "factor_distance_experiment", "factor_distance_markdown",
           "heldout_statistics"]

#: The steps over which a row's ``drift`` measures the current statistic's own motion.
DRIFT_STEPS = 2

#: The schemes compared by default: ``{name: gift.* settings}``.
SCHEMES: dict[str, dict[str, Any]] = {
    "artifact (EMA 0.95 per refresh)": {"gift.ema_scheme": "artifact"},
    "bias-corrected (default)": {"gift.ema_scheme": "bias_corrected"},
}


def heldout_statistics(graphdef: Any, layers: Sequence[str], params: Any,
                       tokens: np.ndarray, chunk: int = 32) -> dict[str, np.ndarray]:
    """The input second moments ``A = E[xxᵀ]`` of the layers ``layers`` over every token of
    ``tokens``, at ``params`` (one device, ``chunk`` sequences at a time).

    Args:
      graphdef: the model's ``nnx`` graph definition.
      layers: GIFT's layer patterns.
      params: the parameters (a pure dict on one device).
      tokens: int32 ``[sequences, seq_len + 1]``; the count a multiple of ``chunk``.
      chunk: sequences per forward pass.

    Returns:
      ``{kernel path: A (n, n)}`` float64, the mean over the chunks.
    """
    fn = jax.jit(lambda p, t: with_input_stats(next_token_loss, tuple(layers))(
        nnx.merge(graphdef, p), t)[1])
    total: dict[str, np.ndarray] = {}
    parts = max(1, len(tokens) // chunk)
    for i in range(parts):
        stats = jax.device_get(fn(params, jnp.asarray(tokens[i * chunk:(i + 1) * chunk])))
        for path, a in stats.items():
            total[path] = total.get(path, 0.0) + np.asarray(a, np.float64)
    return {p: a / parts for p, a in total.items()}


def _relative(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def _shape(a: np.ndarray, ref: np.ndarray) -> float:
    """:func:`_relative` of the trace-normalised matrices: the distance the factor sees (with
    relative damping a factor of ``cA`` is ``c^{-1/2}`` times that of ``A``, which the
    all-reduce's per-tensor scale absorbs)."""
    return _relative(a / np.trace(a), ref / np.trace(ref))


def _one_run(config: ml_collections.ConfigDict, name: str, settings: Mapping[str, Any],
             steps: int, heldout_sequences: int, seed: int, verbose: bool) -> list[dict]:
    from gift_jax.training.config import set_fields

    config = set_fields(ml_collections.ConfigDict(config.to_dict()),
                        {"comm.method": "gift", **settings})
    trainer = Trainer(config, schedule_steps=steps, seed=seed, log_every=max(steps, 1))
    heldout = trainer.batch(heldout_sequences, 0, stream=3)  # the same for every scheme
    every = int(trainer.config.gift.refresh_every)
    layers = tuple(trainer.config.gift.layers)
    rows = []
    t0 = time.perf_counter()
    try:
        for s in range(0, steps, every):
            before = None
            if s - DRIFT_STEPS >= trainer.step:  # the statistic's own motion before s
                trainer.advance(s - DRIFT_STEPS - trainer.step)
                before = heldout_statistics(trainer.graphdef, layers, trainer.params, heldout)
            trainer.advance(s - trainer.step)
            params = trainer.params
            ref = heldout_statistics(trainer.graphdef, layers, params, heldout)
            own = heldout_statistics(trainer.graphdef, layers, params,
                                     trainer.batch(trainer.global_batch, s),
                                     chunk=trainer.global_batch)
            trainer.advance(1)  # the refresh step: the EMA its factors are built from
            state = optax.tree.get(jax.device_get(trainer.run.opt_state), "GiftState")
            ema = {p: np.asarray(leaf.stats, np.float64).reshape(ref[p].shape)
                   for p, leaf in state.whitened.items()}
            d = [_relative(ema[p], ref[p]) for p in sorted(ref)]
            b = [_relative(own[p], ref[p]) for p in sorted(ref)]
            shape = [_shape(ema[p], ref[p]) for p in sorted(ref)]
            drift = (float("nan") if before is None
                     else float(np.mean([_relative(before[p], ref[p]) for p in sorted(ref)])))
            rows.append(dict(scheme=name, step=s, mean=float(np.mean(d)), worst=float(max(d)),
                             batch_mean=float(np.mean(b)), shape_mean=float(np.mean(shape)),
                             shape_worst=float(max(shape)), drift=drift, layers=len(d),
                             refresh_every=every))
            if verbose:
                print(f"  {name} | refresh at step {s}: EMA vs held-out {np.mean(d):.3f} "
                      f"(worst layer {max(d):.3f}); this step's batch {np.mean(b):.3f} "
                      f"[{time.perf_counter() - t0:.0f}s]", flush=True)
    finally:
        trainer.close()
    return rows


def factor_distance_experiment(
    config: ml_collections.ConfigDict,
    *,
    steps: int = 400,
    schemes: Mapping[str, Mapping[str, Any]] | None = None,
    heldout_sequences: int = 256,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, Any]:
    """The EMA's distance to the current model's statistic at every refresh, per scheme.

    Args:
      config: the run's config (e.g. ``configs/tiny.py``); ``comm.method`` is set to
        ``gift``, its codec and every ``gift.*`` setting not in a scheme are the config's.
      steps: the steps of each run (and the length of its learning-rate schedule).
      schemes: ``{name: {setting: value}}`` (e.g. ``{"gift.ema_scheme": "artifact"}``);
        ``None``: :data:`SCHEMES`.
      heldout_sequences: the held-out batch (sequences of the data stream 3, the same at
        every refresh and for every scheme; a multiple of 32).
      seed: the initialisation and data-order seed of every run.
      verbose: print each measurement.

    Returns:
      ``{"rows": [...], "steps", "heldout_sequences"}``; a row per scheme and refresh step:
      ``scheme``, ``step``, ``mean`` and ``worst`` (over the whitened layers) relative
      distance of the EMA to the held-out statistic, ``batch_mean`` (that of the step's own
      training batch), ``shape_mean`` and ``shape_worst`` (the same distance between the
      trace-normalised matrices: what the factor sees), ``drift`` (the held-out statistic's
      own relative change over the :data:`DRIFT_STEPS` steps before the refresh: how far any
      average over past steps must lag; NaN at step 0), ``layers`` and ``refresh_every``.

    Raises:
      ValueError: ``heldout_sequences`` not a positive multiple of 32.
    """
    if heldout_sequences <= 0 or heldout_sequences % 32:
        raise ValueError(f"heldout_sequences={heldout_sequences} must be a positive multiple "
                         "of 32")
    schemes = dict(SCHEMES if schemes is None else schemes)
    rows = []
    for name, settings in schemes.items():
        rows += _one_run(config, name, settings, steps, heldout_sequences, seed, verbose)
    return {"rows": rows, "steps": steps, "heldout_sequences": heldout_sequences}


def factor_distance_markdown(result: Mapping[str, Any], after: int = 100,
                             goal: float = 0.10, shape: bool = False) -> str:
    """The distances at every refresh, a column per scheme, and per scheme whether every
    refresh after step ``after`` is within ``goal``.

    Args:
      result: :func:`factor_distance_experiment`'s output.
      after: the first refresh step the goal applies to.
      goal: the largest relative distance allowed (of the worst layer).
      shape: the trace-normalised distances (``shape_mean``/``shape_worst``) in place of the
        raw ones.

    Returns:
      The table and the verdicts, ending in a newline.
    """
    rows = result["rows"]
    if shape:
        rows = [dict(r, mean=r["shape_mean"], worst=r["shape_worst"]) for r in rows]
    names = list(dict.fromkeys(r["scheme"] for r in rows))
    steps = sorted({r["step"] for r in rows})
    table = []
    for s in steps:
        line = {"refresh at step": str(s)}
        for n in names:
            hit = [r for r in rows if r["scheme"] == n and r["step"] == s]
            line[n] = (f"{hit[0]['mean']:.3f} ({hit[0]['worst']:.3f})" if hit else "")
        batch = [r["batch_mean"] for r in rows if r["step"] == s]
        line["one training batch"] = f"{np.mean(batch):.3f}"
        drift = [r["drift"] for r in rows if r["step"] == s and np.isfinite(r.get("drift", 0))]
        line[f"A's own change over {DRIFT_STEPS} steps"] = (f"{np.mean(drift):.3f}" if drift
                                                            else "")
        table.append(line)
    cols = ["refresh at step", *names, "one training batch",
            f"A's own change over {DRIFT_STEPS} steps"]
    out = [markdown_table(table, cols), ""]
    for n in names:
        late = [r for r in rows if r["scheme"] == n and r["step"] >= after]
        worst = max((r["worst"] for r in late), default=float("nan"))
        ok = late and worst <= goal
        out.append(f"- {n}: worst layer at refreshes from step {after} on {worst:.3f} — "
                   f"{'within' if ok else 'NOT within'} {goal:.0%}")
    return "\n".join(out) + "\n"
