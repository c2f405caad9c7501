"""The training loop: :func:`train`.

One call runs (or resumes) a whole run: it validates the config, builds the mesh, the model, the
optimizer chain and the compiled step variants, restores the latest checkpoint when asked, and
loops over steps with logging, evaluation, diagnostics and checkpoints.

:func:`train` is three phases: :func:`_setup`, :func:`_loop` and :func:`_finish`, sharing a
:class:`_Run`. Host-side choices per step: the refresh variant, as the run's
:class:`~gift_jax.training.method.CommPlan` decides (GIFT every ``gift.refresh_every`` steps,
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
from gift_jax.training.program import Program, program_for

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


def data_batches(spec: str, data_dir: str | None = None, tokenizer: str = "byte"
                 ) -> tuple[BatchFn, int, tuple[str, ...]]:
    """``(batches, vocab_size, splits)`` of a :mod:`gift_jax.data` source (``--data``) under
    ``data.tokenizer`` ``tokenizer``."""
    from gift_jax.data import batch_iterator, get_source

    source = get_source(spec=spec, data_dir=data_dir, tokenizer=tokenizer)

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

    Three phases: :func:`_setup` (config, mesh, compiled program, restored state, eval data,
    outputs), :func:`_loop` (the steps with logging, evaluation, diagnostics, checkpoints) and
    :func:`_finish` (final evaluation and checkpoint, ``summary.json``).

    Args:
      config: a run config (``configs/base.py`` + overrides); missing trainer fields get
        their defaults (:data:`gift_jax.training.config.TRAINER_DEFAULTS`), a former
        ``comm.mode`` is translated to ``comm.codec`` + ``comm.method``.
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
    run = _setup(config, workdir, resume=resume, data=data, data_dir=data_dir, batches=batches,
                 eval_split=eval_split, stop_after=stop_after,
                 compiler_options=compiler_options)
    progress = Progress(run.start, run.tc.num_steps, enabled=run.is_main and show_progress)
    try:
        interrupted = _loop(run, progress)
    except BaseException:
        progress.close()
        run.close()
        raise
    progress.close()
    if interrupted:
        run.save(run.step)
        run.close()
        raise KeyboardInterrupt(f"interrupted at step {run.step}; checkpoint saved")
    summary = _finish(run)
    run.close()
    return TrainResult(run.params, run.opt_state, run.step, run.history, summary)


@dataclasses.dataclass
class _Run:
    """One :func:`train` call's run: what :func:`_setup` builds, the carried state that
    :func:`_loop` advances, and what :func:`_finish` summarises."""

    config: ml_collections.ConfigDict
    workdir: str | None
    program: Program
    checkpointer: Checkpointer | None
    writer: MetricsWriter
    batches: BatchFn
    num_devices: int
    is_main: bool
    params: Any  # carried: replicated parameters
    opt_state: Any  # carried: the whole optimizer state
    start: int  # step this call starts from (0 or the restored checkpoint's)
    data_position: int  # index of the next training batch
    end: int  # step this call stops at
    compile_s: float  # seconds compiling the step variants
    wire: dict[bool, float]  # wire bytes per device per step of each variant
    n_params: int
    evaluate: Callable | None  # jitted eval step, or None without periodic evaluation
    eval_data: list[jax.Array]  # the fixed evaluation batches
    diagnose: Callable | None  # jitted fidelity diagnostic, or None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    step: int = 0  # optimizer steps completed
    eval_loss: float | None = None  # last evaluation
    last_loss: float | None = None  # loss of the last logged step
    train_time: float = 0.0  # seconds inside train steps during this call
    wall: float = 0.0  # seconds of the loop

    @property
    def tc(self) -> ml_collections.ConfigDict:
        return self.config.train

    @property
    def fp32_wire(self) -> float:
        """Bytes per device of one fp32 ring all-reduce of the parameters."""
        n = self.num_devices
        return 2 * (n - 1) / n * 4 * self.n_params

    @property
    def tokens_per_step(self) -> int:
        return self.tc.global_batch_size * self.tc.seq_len

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Appends a record to the history and writes it (metrics.jsonl, TensorBoard)."""
        metrics = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        self.history.append({"step": step, **metrics})
        self.writer.write(step, metrics)

    def run_eval(self, step: int) -> float:
        """Mean loss over the evaluation batches, recorded as ``eval/loss``."""
        losses = [float(self.evaluate(self.params, b)) for b in self.eval_data]
        value = float(np.mean(losses))
        self.record(step, {"eval/loss": value})
        return value

    def save(self, step: int) -> None:
        """Checkpoints the carried state at ``step`` (no-op without a workdir)."""
        if self.checkpointer is not None:
            self.checkpointer.save(step, {"params": self.params, "opt_state": self.opt_state},
                                   data_position=step, skipped=int(self.opt_state.skipped))

    def close(self) -> None:
        """Closes the metrics writer and the checkpointer."""
        self.writer.close()
        if self.checkpointer is not None:
            self.checkpointer.close()


def _resolve_config(config: ml_collections.ConfigDict, workdir: str | None, *, resume: bool,
                    data: str | None) -> tuple[ml_collections.ConfigDict, str | None]:
    """The completed, validated config (``data`` and the workdir written into it) and the
    workdir (``None``: no output)."""
    config = complete_config(config)
    if data:
        with config.unlocked():
            config.data.source = data
    workdir = workdir if workdir is not None else (config.train.workdir or None)
    if resume and not workdir:
        raise ConfigError("resume=True needs a workdir (--workdir) holding the checkpoints")
    with config.unlocked():
        config.train.workdir = workdir or ""
    validate_config(config, jax.device_count())
    return config, workdir


def _setup(config: ml_collections.ConfigDict, workdir: str | None, *, resume: bool,
           data: str | None, data_dir: str | None, batches: BatchFn | None,
           eval_split: str | None, stop_after: int | None,
           compiler_options: dict[str, Any] | None) -> _Run:
    """Everything before the first step: validates the config, builds the mesh and the
    cached compiled program, initialises or restores the state (refusing a workdir with
    checkpoints unless ``resume``), compiles every step variant and reads its wire bytes,
    loads the evaluation batches and opens the metrics writer."""
    config, workdir = _resolve_config(config, workdir, resume=resume, data=data)
    num_devices = jax.device_count()
    model_config = LlamaConfig.from_mapping(config.model)
    splits: tuple[str, ...] = ("train", "validation")
    if batches is None:
        from gift_jax.data import vocab_mismatch

        mismatch = vocab_mismatch(model_config.vocab_size, config.data.tokenizer)
        if mismatch:  # before the corpus or the tokenizer is prepared on disk
            raise ConfigError(mismatch)
        batches, _, splits = data_batches(config.data.source, data_dir, config.data.tokenizer)
    if eval_split is None:
        eval_split = next((s for s in ("validation", "test") if s in splits), None)
    tc = config.train

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
    step_fn = program.step
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
    is_main = jax.process_index() == 0
    writer = MetricsWriter(workdir, enabled=is_main, start_step=start)
    return _Run(config=config, workdir=workdir, program=program, checkpointer=checkpointer,
                writer=writer, batches=batches, num_devices=num_devices, is_main=is_main,
                params=params, opt_state=opt_state, start=start, data_position=data_position,
                end=end, compile_s=compile_s, wire=wire, n_params=count_params(model_config),
                evaluate=evaluate, eval_data=eval_data, diagnose=diagnose, step=start)


def _loop(run: _Run, progress: Progress) -> bool:
    """Runs steps ``run.start .. run.end``: the plan's refresh variant where due, a record
    every ``log_every`` steps (window means, throughput excluding time outside train steps),
    evaluation, wire/fidelity diagnostics and checkpoints at their cadences. Advances
    ``run``'s carried state and counters; returns whether Ctrl-C stopped it early."""
    tc, config = run.tc, run.config
    step_fn, optimizer = run.program.step, run.program.optimizer
    train_it = run.batches("train", tc.global_batch_size, tc.seq_len,
                           seed=config.data.shuffle_seed, start_step=run.data_position,
                           process_index=jax.process_index(),
                           process_count=jax.process_count())
    shape = (tc.global_batch_size, tc.seq_len + 1)
    window: list[dict[str, jax.Array]] = []
    window_refreshes = 0
    window_start = run_start = time.perf_counter()
    window_time = 0.0  # seconds in train steps of this window
    interrupted = False
    with _Interrupt() as interrupt:
        while run.step < run.end:
            if interrupt.stop_now(run.step, tc.log_every):
                interrupted = True
                break
            batch = _global_batch(next(train_it), step_fn.batch_sharding, shape)
            refresh = step_fn.refresh_due(run.step, run.opt_state)
            run.params, run.opt_state, metrics = step_fn(run.params, run.opt_state, batch,
                                                         refresh)
            window.append(metrics)
            window_refreshes += int(refresh)
            run.step += 1
            step = run.step
            if step % tc.log_every == 0 or step == run.end:
                fetched = jax.device_get(window)
                elapsed = window_time + time.perf_counter() - window_start
                run.train_time += elapsed
                run.last_loss = float(fetched[-1]["loss"])
                rec = _window_record(fetched, elapsed, run.tokens_per_step)
                rec["learning_rate"] = float(optimizer.schedule(step - 1))
                rec["refreshes"] = window_refreshes
                run.record(step, rec)
                progress.update(len(fetched), loss=f"{rec['loss']:.4f}",
                                tok_s=f"{rec['tokens_per_s']:.0f}")
                window, window_refreshes, window_time = [], 0, 0.0
            extra = False
            if run.evaluate is not None and step % tc.eval_every == 0:
                run.eval_loss, extra = run.run_eval(step), True
            if tc.diagnostics_every and step % tc.diagnostics_every == 0:
                diag = {f"wire/bytes_per_step_{'refresh' if v else 'ordinary'}": b
                        for v, b in run.wire.items()}
                diag["wire/fp32_reference"] = run.fp32_wire
                if run.diagnose is not None:
                    report = jax.device_get(run.diagnose(run.params, run.opt_state, batch))
                    diag.update({f"fidelity/{k}": float(v) for k, v in report.items()})
                run.record(step, diag)
                extra = True
            if run.checkpointer and tc.checkpoint_every and step % tc.checkpoint_every == 0:
                run.save(step)
                extra = True
            if extra or not window:  # time spent outside train steps is not throughput
                if window:
                    jax.block_until_ready(window[-1])
                    window_time += time.perf_counter() - window_start
                window_start = time.perf_counter()
    run.wall = time.perf_counter() - run_start
    return interrupted


def _finish(run: _Run) -> dict[str, Any]:
    """After the last step: a final evaluation (unless the last step had one), the final
    checkpoint, and the summary (printed and written to ``summary.json`` on process 0)."""
    tc, config, step = run.tc, run.config, run.step
    if run.evaluate is not None and (run.eval_loss is None or step % tc.eval_every):
        run.eval_loss = run.run_eval(step)
    run.save(step)
    plan = run.program.optimizer.plan
    refresh_fraction = plan.refresh_fraction()
    mean_wire = ((1 - refresh_fraction) * run.wire[False]
                 + refresh_fraction * run.wire.get(True, 0.0))
    summary = {
        "steps": step,
        "steps_this_call": step - run.start,
        "final_loss": run.last_loss,
        "eval_loss": run.eval_loss,
        "skipped_steps": int(run.opt_state.skipped),
        "params": run.n_params,
        "devices": run.num_devices,
        "processes": jax.process_count(),
        "comm_codec": config.comm.codec,
        "comm_method": config.comm.method,
        "optimizer": config.optimizer.name,
        "wire_bytes_per_step": {("refresh" if v else "ordinary"): b
                                for v, b in run.wire.items()},
        "wire_bytes_per_step_mean": mean_wire,
        "wire_fp32_reference": run.fp32_wire,
        "compile_s": run.compile_s,
        "wall_s": run.wall,
        "train_s": run.train_time,
        "tokens_per_s": run.tokens_per_step * (step - run.start) / max(run.train_time, 1e-9),
    }
    if run.is_main:
        if run.workdir:
            with open(os.path.join(run.workdir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2, default=str)
        print("summary: " + json.dumps(summary, default=str), flush=True)
    return summary
