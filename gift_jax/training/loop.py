"""The training loop: :func:`train`.

One call runs (or resumes) a whole run: it validates the config, builds the mesh, the model, the
optimizer chain and the compiled step variants, restores the latest checkpoint when asked, and
loops over steps with logging, evaluation, diagnostics and checkpoints.

Host-side choices per step: the refresh variant (GIFT every ``gift.refresh_every`` steps,
PLUMAGE when its state says a refresh is due). Metrics are fetched from the device only at log
steps (the loop otherwise runs ahead asynchronously). Ctrl-C (SIGINT) is turned into a flag
checked between steps (agreed on by all processes every ``log_every`` steps): the loop stops,
writes a checkpoint of the last completed step and then raises ``KeyboardInterrupt``. A fresh
run refuses a workdir that already holds checkpoints (pass ``resume=True``), so two runs are
never mixed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import ml_collections
import numpy as np

from gift_jax.models import LlamaConfig, count_params
from gift_jax.training.checkpoint import Checkpointer
from gift_jax.training.config import ConfigError, complete_config, validate_config
from gift_jax.training.mesh import make_mesh
from gift_jax.training.metrics import MetricsWriter, Progress
from gift_jax.training.program import program_for

log = logging.getLogger("gift_jax.training")

#: ``batches(split, global_batch, seq_len, *, seed, start_step, process_index, process_count)``
#: → iterator of this process's int32 ``[global_batch // process_count, seq_len + 1]`` rows;
#: batch ``k`` must not depend on ``start_step`` (the signature of
#: :func:`gift_jax.data.batch_iterator` without its source).
BatchFn = Callable[..., Iterator[np.ndarray]]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns (on process 0 the same numbers are in ``summary.json``)."""

    params: Any  # final parameters (replicated)
    opt_state: Any  # final optimizer state
    step: int  # optimizer steps completed
    history: list[dict[str, Any]]  # every logged record (train, eval, diagnostics)
    summary: dict[str, Any]  # end-of-run summary


def data_batches(spec: str, data_dir: str | None = None) -> tuple[BatchFn, int, tuple[str, ...]]:
    """``(batches, vocab_size, splits)`` of a :mod:`gift_jax.data` source (``--data``)."""
    from gift_jax.data import batch_iterator, get_source

    source = get_source(spec=spec, data_dir=data_dir)

    def batches(split, global_batch, seq_len, **kwargs):
        return batch_iterator(source, split, global_batch, seq_len, **kwargs)

    return batches, source.vocab_size, tuple(source.splits)


class _Interrupt:
    """Turns SIGINT into a flag (main thread only) for the duration of a ``with`` block; a
    second SIGINT raises ``KeyboardInterrupt`` at once."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        del signum, frame
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True

    def stop_now(self, step: int, every: int) -> bool:
        """Whether to stop before ``step``. With several processes the flag is agreed on (an
        all-gather) every ``every`` steps, so that all processes stop at the same step even
        if only one of them received the signal."""
        if jax.process_count() == 1:
            return self.requested
        if step % every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
        return bool(np.any(flags))

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _global_batch(local: np.ndarray, sharding, global_shape) -> jax.Array:
    local = np.asarray(local, np.int32)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def _window_record(fetched: list[dict[str, Any]], elapsed: float,
                   tokens_per_step: int) -> dict[str, Any]:
    """Mean loss and gradient norm (over non-skipped steps), skips and throughput of a window
    of per-step metrics."""
    norms = [float(m["grad_norm"]) for m in fetched]
    finite = [n for n in norms if np.isfinite(n)]
    return {
        "loss": float(np.mean([m["loss"] for m in fetched])),
        "grad_norm": float(np.mean(finite)) if finite else float("nan"),
        "skipped": int(sum(int(m["skipped"]) for m in fetched)),
        "skipped_total": int(fetched[-1]["skipped_total"]),
        "tokens_per_s": tokens_per_step * len(fetched) / max(elapsed, 1e-9),
    }


def train(
    config: ml_collections.ConfigDict,
    workdir: str | None = None,
    *,
    resume: bool = False,
    data: str | None = None,
    data_dir: str | None = None,
    batches: BatchFn | None = None,
    eval_split: str | None = None,
    stop_after: int | None = None,
    show_progress: bool = True,
    compiler_options: dict[str, Any] | None = None,
) -> TrainResult:
    """Trains the Llama of ``config`` data-parallel over all devices of all processes.

    Args:
      config: a run config (``configs/base.py`` + overrides); missing trainer fields get
        their defaults (:data:`gift_jax.training.config.TRAINER_DEFAULTS`).
      workdir: checkpoints, ``metrics.jsonl``, TensorBoard events and ``summary.json``
        (default ``config.train.workdir``; empty: nothing is written and ``resume`` is
        impossible).
      resume: continue from the latest checkpoint in ``workdir`` (if there is none, start
        from scratch). The config must be the one the checkpoint was written with, except for
        logging/eval/checkpoint cadence.
      data: corpus spec for :func:`gift_jax.data.get_source` (default ``config.data.source``).
      data_dir: where the corpus lives (TFDS data dir / cache).
      batches: inject a batch function instead of :mod:`gift_jax.data` (see :data:`BatchFn`).
      eval_split: split of the periodic evaluation (default ``"validation"`` if the source has
        it, else ``"test"``; with injected ``batches``: ``"validation"``).
      stop_after: stop after this many steps of this call (a partial run; its checkpoint
        continues with ``resume=True``).
      show_progress: show the tqdm bar (process 0).
      compiler_options: XLA options for the train step variants (e.g.
        ``{"xla_backend_optimization_level": 0}`` to compile small test models fast).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ConfigError: a bad setting (one line naming it and what is allowed).
      CheckpointMismatchError: ``resume`` with a checkpoint of another config.
      KeyboardInterrupt: after saving a checkpoint, on Ctrl-C.
    """
    config = complete_config(config)
    if data:
        with config.unlocked():
            config.data.source = data
    workdir = workdir if workdir is not None else (config.train.workdir or None)
    if resume and not workdir:
        raise ConfigError("resume=True needs a workdir (--workdir) holding the checkpoints")
    with config.unlocked():
        config.train.workdir = workdir or ""
    num_devices = jax.device_count()
    validate_config(config, num_devices)
    model_config = LlamaConfig.from_mapping(config.model)
    splits: tuple[str, ...] = ("train", "validation")
    if batches is None:
        batches, vocab, splits = data_batches(config.data.source, data_dir)
        if vocab > model_config.vocab_size:
            raise ConfigError(
                f"model.vocab_size={model_config.vocab_size} is smaller than the vocabulary of "
                f"data {config.data.source!r} ({vocab})"
            )
    if eval_split is None:
        eval_split = next((s for s in ("validation", "test") if s in splits), None)
    is_main = jax.process_index() == 0
    tc = config.train

    # ---- build --------------------------------------------------------------------------
    mesh = make_mesh(config.mesh.intra_size)
    checkpointer = Checkpointer(workdir, config, keep=tc.keep_checkpoints) if workdir else None
    latest = checkpointer.latest_step() if checkpointer else None
    if latest is not None and not resume:
        raise ConfigError(
            f"workdir {workdir!r} already holds checkpoints (latest step {latest}): pass "
            "--resume to continue that run, or choose a new workdir"
        )
    resuming = latest is not None
    if resuming:
        checkpointer.check_config()  # fail fast, before anything is compiled
    program = program_for(config, mesh, compiler_options)
    step_fn, optimizer = program.step, program.optimizer
    params, opt_state = program.init()
    start = data_position = 0
    if resuming:
        restored = checkpointer.restore({"params": params, "opt_state": opt_state})
        params, opt_state = step_fn.place(restored.state["params"],
                                          restored.state["opt_state"])
        start, data_position = restored.step, restored.data_position
        log.info("resumed from step %d", start)
    end = tc.num_steps if stop_after is None else min(tc.num_steps, start + stop_after)

    t0 = time.perf_counter()
    for variant in step_fn.variants():
        step_fn.compiled(variant)
    compile_s = time.perf_counter() - t0
    wire = {v: step_fn.wire_report(v).total for v in step_fn.variants()}
    n_params = count_params(model_config)
    fp32_wire = 2 * (num_devices - 1) / num_devices * 4 * n_params
    tokens_per_step = tc.global_batch_size * tc.seq_len

    evaluate = program.evaluate if (tc.eval_every and eval_split) else None
    eval_data = []
    if evaluate is not None:
        it = batches(eval_split, tc.global_batch_size, tc.seq_len, seed=config.data.shuffle_seed,
                     start_step=0, process_index=jax.process_index(),
                     process_count=jax.process_count())
        shape = (tc.global_batch_size, tc.seq_len + 1)
        eval_data = [_global_batch(next(it), step_fn.batch_sharding, shape)
                     for _ in range(tc.eval_batches)]
    diagnose = program.diagnose if tc.diagnostics_every else None

    writer = MetricsWriter(workdir, enabled=is_main, start_step=start)
    progress = Progress(start, tc.num_steps, enabled=is_main and show_progress)
    history: list[dict[str, Any]] = []

    def record(step: int, metrics: dict[str, Any]) -> None:
        metrics = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        history.append({"step": step, **metrics})
        writer.write(step, metrics)

    def run_eval(step: int) -> float:
        losses = [float(evaluate(params, b)) for b in eval_data]
        value = float(np.mean(losses))
        record(step, {"eval/loss": value})
        return value

    def save(step: int) -> None:
        if checkpointer is not None:
            checkpointer.save(step, {"params": params, "opt_state": opt_state},
                              data_position=step, skipped=int(opt_state.skipped))

    train_it = batches("train", tc.global_batch_size, tc.seq_len, seed=config.data.shuffle_seed,
                       start_step=data_position, process_index=jax.process_index(),
                       process_count=jax.process_count())
    shape = (tc.global_batch_size, tc.seq_len + 1)
    window: list[dict[str, jax.Array]] = []
    window_refreshes = 0
    window_start = run_start = time.perf_counter()
    window_time = train_time = 0.0  # seconds in train steps: this window, the whole call
    step = start
    eval_loss = last_loss = None
    interrupted = False
    try:
        with _Interrupt() as interrupt:
            while step < end:
                if interrupt.stop_now(step, tc.log_every):
                    interrupted = True
                    break
                batch = _global_batch(next(train_it), step_fn.batch_sharding, shape)
                refresh = step_fn.refresh_due(step, opt_state)
                params, opt_state, metrics = step_fn(params, opt_state, batch, refresh)
                window.append(metrics)
                window_refreshes += int(refresh)
                step += 1
                if step % tc.log_every == 0 or step == end:
                    fetched = jax.device_get(window)
                    elapsed = window_time + time.perf_counter() - window_start
                    train_time += elapsed
                    last_loss = float(fetched[-1]["loss"])
                    rec = _window_record(fetched, elapsed, tokens_per_step)
                    rec["learning_rate"] = float(optimizer.schedule(step - 1))
                    rec["refreshes"] = window_refreshes
                    record(step, rec)
                    progress.update(len(fetched), loss=f"{rec['loss']:.4f}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}")
                    window, window_refreshes, window_time = [], 0, 0.0
                extra = False
                if evaluate is not None and step % tc.eval_every == 0:
                    eval_loss, extra = run_eval(step), True
                if tc.diagnostics_every and step % tc.diagnostics_every == 0:
                    diag = {f"wire/bytes_per_step_{'refresh' if v else 'ordinary'}": b
                            for v, b in wire.items()}
                    diag["wire/fp32_reference"] = fp32_wire
                    if diagnose is not None:
                        report = jax.device_get(diagnose(params, opt_state, batch))
                        diag.update({f"fidelity/{k}": float(v) for k, v in report.items()})
                    record(step, diag)
                    extra = True
                if checkpointer and tc.checkpoint_every and step % tc.checkpoint_every == 0:
                    save(step)
                    extra = True
                if extra or not window:  # time spent outside train steps is not throughput
                    if window:
                        jax.block_until_ready(window[-1])
                        window_time += time.perf_counter() - window_start
                    window_start = time.perf_counter()
    except BaseException:
        progress.close()
        writer.close()
        if checkpointer is not None:
            checkpointer.close()
        raise
    progress.close()
    if interrupted:
        save(step)
        writer.close()
        if checkpointer is not None:
            checkpointer.close()
        raise KeyboardInterrupt(f"interrupted at step {step}; checkpoint saved")

    wall = time.perf_counter() - run_start
    if evaluate is not None and (eval_loss is None or step % tc.eval_every):
        eval_loss = run_eval(step)
    save(step)
    refresh_fraction = 0.0
    if optimizer.refresh_every:
        refresh_fraction = 1.0 / optimizer.refresh_every
    mean_wire = (1 - refresh_fraction) * wire[False] + refresh_fraction * wire.get(True, 0.0)
    summary = {
        "steps": step,
        "steps_this_call": step - start,
        "final_loss": last_loss,
        "eval_loss": eval_loss,
        "skipped_steps": int(opt_state.skipped),
        "params": n_params,
        "devices": num_devices,
        "processes": jax.process_count(),
        "comm_mode": config.comm.mode,
        "optimizer": config.optimizer.name,
        "wire_bytes_per_step": {("refresh" if v else "ordinary"): b for v, b in wire.items()},
        "wire_bytes_per_step_mean": mean_wire,
        "wire_fp32_reference": fp32_wire,
        "compile_s": compile_s,
        "wall_s": wall,
        "train_s": train_time,
        "tokens_per_s": tokens_per_step * (step - start) / max(train_time, 1e-9),
    }
    if is_main:
        if workdir:
            with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2, default=str)
        print("summary: " + json.dumps(summary, default=str), flush=True)
    writer.close()
    if checkpointer is not None:
        checkpointer.close()
    return TrainResult(params, opt_state, step, history, summary)
