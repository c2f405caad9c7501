"""The README demo: the tiny Llama on 8 data-parallel devices, trained from the same seed with
each communication mode, compared in one table and one loss-curve plot.

A demo mode is a label for a ``(comm.codec, comm.method)`` pair
(:data:`gift_jax.training.config.COMM_MODES`); the low-precision modes use the config file's
codec when it sets a low-precision one (``tiny`` does not: FP8 e4m3).

Columns: the mode with its settings (:func:`describe_mode`); final eval loss; wire bytes per
step relative to the fp32 all-reduce (from each run's compiled HLO); the one-step round-trip
error of the run's reduction against the fp32 mean at the last diagnostic step (relative L2 in
the Euclidean frame, and in the whitened frame where the run has GIFT factors). A cell without
a value (no whitened frame) reads ``–``.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil

from gift_jax.comm.codecs import get_codec
from gift_jax.training import train
from gift_jax.training.config import (
    apply_overrides,
    complete_config,
    load_config,
    resolve_comm_mode,
)

#: The demo's modes (:data:`gift_jax.training.config.COMM_MODES`): the exact fp32 all-reduce,
#: Euclidean FP8 (e4m3, per tensor), GIFT-whitened FP8, PLUMAGE's projected coordinates in FP8.
DEMO_MODES = ("fp32", "fp8", "gift_fp8", "plumage")


def demo_config(mode: str, steps: int, config_file: str | os.PathLike):
    """The tiny config with the ``(comm.codec, comm.method)`` of demo mode ``mode`` and a
    short schedule.

    Args:
      mode: one of :data:`DEMO_MODES`.
      steps: training steps (>= 1); warm-up is a tenth of them (at most ``steps - 1``), eval
        and diagnostics run every quarter, logging every twentieth, no checkpoints.
      config_file: path of the tiny config file (``configs/tiny.py``).

    Returns:
      The completed and overridden ``ml_collections.ConfigDict``.

    Raises:
      ValueError: ``mode`` is not a demo mode.
      ConfigError: the config file is missing or defines no ``get_config()`` (a
        ``ValueError``).
    """
    if mode not in DEMO_MODES:
        raise ValueError(f"demo mode {mode!r} is not one of {', '.join(DEMO_MODES)}")
    config = complete_config(load_config(config_file))
    codec, method = resolve_comm_mode(mode, config.comm.codec)
    every = max(1, steps // 4)
    return apply_overrides(config, [
        ("comm.codec", codec), ("comm.method", method), ("train.num_steps", str(steps)),
        ("optimizer.warmup_steps", str(min(max(1, steps // 10), steps - 1))),
        ("train.eval_every", str(every)), ("train.log_every", str(max(1, steps // 20))),
        ("train.checkpoint_every", "0"), ("train.diagnostics_every", str(every)),
    ])


def describe_mode(mode: str, config) -> str:
    """The table's label of demo mode ``mode`` run with ``config``: the mode and the settings
    that define it, e.g. ``fp8 (e4m3, per tensor)``, ``gift_fp8 (rank 32, K = 50)``,
    ``plumage (rank 32, τ = 50, FP8 wire)``.

    Args:
      mode: the demo mode's name (the label's first word).
      config: the run's config (as :func:`demo_config` returns it); its ``comm``, ``gift``
        and ``plumage`` settings give the details.

    Returns:
      ``"<mode> (<details>)"``, or ``mode`` alone when there are no details to add.
    """
    comm = config.comm
    codec = get_codec(comm.codec)
    if comm.method == "gift":
        details = [f"rank {config.gift.rank}", f"K = {config.gift.refresh_every}"]
    elif comm.method == "plumage":
        details = [f"rank {config.plumage.rank}", f"τ = {config.plumage.refresh_every}",
                   f"{codec.label} wire"]
    elif codec.supports_block_scaling:
        scales = (f"blocks of {comm.block_size}" if comm.scaling == "block" else "per tensor")
        details = [comm.codec.removeprefix("fp8_"), scales]
    elif comm.codec != mode:
        details = [comm.codec]
    else:
        details = []
    return f"{mode} ({', '.join(details)})" if details else mode


#: What a trainer workdir holds; a demo rerun replaces a workdir made only of these.
RUN_ARTEFACTS = frozenset({"checkpoints", "metrics.jsonl", "summary.json", "tensorboard"})


def _fresh_workdir(workdir: pathlib.Path) -> None:
    """Make the demo re-runnable: remove a previous run's workdir (only trainer artefacts in
    it); refuse, naming the path, if it holds anything else."""
    if not workdir.exists():
        return
    found = {p.name for p in workdir.iterdir()}
    if not found <= RUN_ARTEFACTS:
        raise ValueError(
            f"demo: {workdir} holds files that are not a previous demo run "
            f"({sorted(found - RUN_ARTEFACTS)}); choose another --out")
    print(f"demo: replacing the previous run in {workdir}", flush=True)
    shutil.rmtree(workdir)


def _last(history, key):
    values = [r[key] for r in history if key in r]
    return values[-1] if values else float("nan")


def run_demo(out_dir: str | os.PathLike, config_file: str | os.PathLike, steps: int = 100,
             modes=DEMO_MODES, data: str | None = None, data_dir: str | None = None,
             show_progress: bool = True,
             compiler_options: dict | None = None) -> list[dict]:
    """Train every mode (same seed), write ``<out_dir>/<mode>/`` runs, return table rows.

    ``config_file`` is the tiny config (``configs/tiny.py`` in the repository; the scripts pass
    it); ``compiler_options`` go to the trainer.

    Args:
      out_dir: the folder of the runs; ``<out_dir>/<mode>`` is replaced when it holds only a
        previous run's artefacts.
      config_file: path of the tiny config file.
      steps: training steps per mode (see :func:`demo_config`).
      modes: the demo modes to train, in table order (a subset of :data:`DEMO_MODES`).
      data, data_dir: the corpus spec and its folder, passed to
        :func:`gift_jax.training.train` (``None``: the config's).
      show_progress: show the trainer's progress bar.
      compiler_options: XLA compiler options for the trainer's jitted steps.

    Returns:
      One dict per mode: ``mode``, ``label`` (:func:`describe_mode`), ``eval_loss``,
      ``final_train_loss``, ``wire_vs_fp32`` (mean wire bytes per step / fp32 all-reduce),
      ``roundtrip_rel_l2`` and ``roundtrip_whitened`` (last diagnostic; NaN when absent),
      ``tokens_per_s`` and ``workdir``.

    Raises:
      ValueError: a mode is not a demo mode, or a workdir holds files that are not a
        previous run's.
    """
    rows = []
    for mode in modes:
        workdir = pathlib.Path(out_dir) / mode
        _fresh_workdir(workdir)
        config = demo_config(mode, steps, config_file)
        result = train(config, str(workdir), data=data, data_dir=data_dir,
                       show_progress=show_progress, compiler_options=compiler_options)
        s, h = result.summary, result.history
        rows.append({
            "mode": mode,
            "label": describe_mode(mode, config),
            "eval_loss": s["eval_loss"],
            "final_train_loss": s["final_loss"],
            "wire_vs_fp32": s["wire_bytes_per_step_mean"] / s["wire_fp32_reference"],
            "roundtrip_rel_l2": _last(h, "fidelity/relative_l2"),
            "roundtrip_whitened": _last(h, "fidelity/whitened_relative_l2"),
            "tokens_per_s": s["tokens_per_s"],
            "workdir": str(workdir),
        })
    return rows


#: A table cell without a value (e.g. the whitened-frame error of a run without GIFT).
MISSING = "–"


def _cell(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or :data:`MISSING` for ``None``/NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The Markdown comparison table of :func:`run_demo`'s rows (the README's demo table).

    Args:
      rows: dicts as :func:`run_demo` returns them (``label`` falls back to ``mode``; a
        missing, ``None`` or NaN value reads :data:`MISSING`).

    Returns:
      The table as one string: header, separator and a line per row.
    """
    columns = [("eval_loss", ".4f"), ("final_train_loss", ".4f"), ("wire_vs_fp32", ".3f"),
               ("roundtrip_rel_l2", ".2e"), ("roundtrip_whitened", ".2e"),
               ("tokens_per_s", ".0f")]
    lines = ["| mode | eval loss | train loss | wire bytes / fp32 | round-trip rel. L2 | "
             "whitened rel. L2 | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.get("label", r["mode"])] + [_cell(r.get(k), spec) for k, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
