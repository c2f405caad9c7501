"""The training loop: :class:`Trainer` and :func:`train`.

One :func:`train` call runs (or resumes) a whole run: a :class:`Trainer` validates the config,
builds the mesh, the model, the optimizer chain and the compiled step variants, restores the
latest checkpoint when asked; :meth:`Trainer.run` loops over steps with logging, evaluation,
diagnostics and checkpoints; :meth:`Trainer.finish` writes the summary. The experiments drive
the same :class:`Trainer` between their measurements (one loop in the package).

Host-side choices per step: the refresh variant, as the run's
:class:`~gift_jax.training.method.CommPlan` decides (GIFT every ``gift.refresh_every`` steps,
PLUMAGE when its state says a refresh is due). Metrics are fetched from the device only at log
steps (the loop otherwise runs ahead asynchronously). A fresh run refuses a workdir that
already holds checkpoints (pass ``resume=True``), so two runs are never mixed.

Preemption and Ctrl-C. SIGTERM (the notice spot/preemptible nodes get about 30 s before the
kill) and SIGINT stop the run between steps: every process finishes the step it is in, logs
the partial window, writes a checkpoint of that step and raises :class:`Preempted` (a
``KeyboardInterrupt``) naming the step; ``scripts/train.py`` prints that one line and exits 0
(130 on the process that got a Ctrl-C). A signal before the first step stops with one line
and writes no checkpoint (SIGTERM during the setup is held until it ends; Ctrl-C there stops
at once, as before). A second signal during a checkpoint's save is held until the save
has finished (the newest step stays intact); elsewhere a second signal stops at once, without
a checkpoint. With ``jax.distributed`` the processes agree on the step through JAX's
preemption sync point (:func:`jax.experimental.multihost_utils.reached_preemption_sync_point`,
asked once per step): the coordination service's notifier catches SIGTERM itself, tells the
other processes, and all stop at the step after the fastest one's (SIGINT is passed on to it
as SIGTERM); a single process (no ``jax.distributed``) checks a flag its handlers set.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import nnx

from gift_jax.data import batch_iterator, get_source, stream_batches, vocab_mismatch
from gift_jax.data.stream import default_workers, global_state
from gift_jax.models import count_params, model_config_of, model_spec
from gift_jax.training.checkpoint import Checkpointer
from gift_jax.training.config import (
    ConfigError,
    complete_config,
    extend_schedule,
    nothing_to_communicate,
    schedule_length,
    validate_config,
    validate_layer_patterns,
)
from gift_jax.training.mesh import data_axes, data_parallel_size, mesh_from_config
from gift_jax.training.method import STATS
from gift_jax.training.metrics import MetricsWriter, Progress
from gift_jax.training.optim import learning_rate_schedule
from gift_jax.training.program import program_for
from gift_jax.training.sharding import shard_bytes
from gift_jax.utils.timing import Stopwatch
from gift_jax.utils.tree_paths import flat_paths

log = logging.getLogger("gift_jax.training")

#: ``batches(split, global_batch, seq_len, *, seed, start_step, process_index, process_count)``
#: → iterator of this process's int32 ``[global_batch // process_count, seq_len + 1]`` rows;
#: batch ``k`` must not depend on ``start_step`` (the signature of
#: :func:`gift_jax.data.batch_iterator` without its source).
BatchFn = Callable[..., Iterator[np.ndarray]]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns (on process 0 the same numbers are in ``summary.json``)."""

    params: Any  # final parameters, as the mesh places them: replicated over the data axes,
    # split over fsdp/tensor on a sharded mesh
    opt_state: Any  # final optimizer state
    step: int  # optimizer steps completed
    history: list[dict[str, Any]]  # every logged record (train, eval, diagnostics)
    summary: dict[str, Any]  # end-of-run summary


def data_batches(spec: str, data_dir: str | None = None, tokenizer: str = "byte",
                 pipeline: str = "grid", workers: int = -1, id_cache: str = ""
                 ) -> tuple[BatchFn, int, tuple[str, ...]]:
    """``(batches, vocab_size, splits)`` of a :mod:`gift_jax.data` source (``--data``) under
    ``data.tokenizer`` ``tokenizer``.

    Args:
      spec, data_dir, tokenizer: ``--data``, ``--data_dir`` and ``data.tokenizer``.
      pipeline: ``"grid"`` (:func:`gift_jax.data.batch_iterator`: windows of each split's
        whole token stream) or ``"stream"`` (:func:`gift_jax.data.stream_batches`: lanes of
        documents tokenized as they are consumed; the iterator has a ``state()`` that the
        trainer checkpoints, and ``batches`` takes it back as ``state=``).
      workers: ``stream``'s worker processes (-1: the host's cores).
      id_cache: ``stream``'s per-shard id cache (a local directory; ``""``: none).

    Returns:
      The batch function (see :data:`BatchFn`), the tokenizer's vocabulary and the splits.
    """
    source = get_source(spec=spec, data_dir=data_dir, tokenizer=tokenizer)
    if pipeline == "grid":
        def batches(split, global_batch, seq_len, **kwargs):
            return batch_iterator(source, split, global_batch, seq_len, **kwargs)
    else:
        workers = default_workers() if workers == -1 else workers

        def batches(split, global_batch, seq_len, *, start_step=0, state=None, **kwargs):
            it = stream_batches(source, split, global_batch, seq_len, workers=workers,
                                state=state, id_cache=id_cache, **kwargs)
            if state is None and start_step:  # a position saved without its data state
                log.info("data: replaying %d batches to reach the saved position", start_step)
                for _ in range(start_step):
                    next(it)
            return it

    return batches, source.vocab_size, tuple(source.splits)


class Preempted(KeyboardInterrupt):  # noqa: N818 -- a KeyboardInterrupt, not an error
    """The run stopped on a signal: SIGTERM (a preemption notice, on this or another
    process) or SIGINT (Ctrl-C), after checkpointing the step it had reached (``saved``; not
    when it came before the first step or without a workdir)."""

    def __init__(self, message: str, *, step: int, signal_name: str, saved: bool):
        """Args:
          message: the one line to show (names the step).
          step: the step the run stopped at (the checkpoint's, where ``saved``).
          signal_name: ``"SIGTERM"`` or ``"SIGINT"`` (this process's signal; ``"SIGTERM"``
            for a notice that reached it through another process).
          saved: whether a checkpoint of ``step`` was written.
        """
        super().__init__(message)
        self.step, self.signal_name, self.saved = step, signal_name, saved


#: Calls of JAX's preemption sync point in this process: every process asks it once per
#: step, in the same order (one count for every Trainer a process runs).
_SYNC_CALLS = itertools.count(1)


def _preemption_service() -> bool:
    """Whether JAX's preemption sync manager runs (``jax.distributed`` initialised with
    ``jax_enable_preemption_service``): its notifier then owns SIGTERM."""
    from jax._src import distributed

    state = distributed.global_state
    return (getattr(state, "client", None) is not None
            and getattr(state, "preemption_sync_manager", None) is not None)


class _Signals:
    """SIGTERM and SIGINT as a stop request, checked between steps (main thread only;
    re-entrant: ``train`` holds it over the Trainer's setup, ``Trainer.run`` over its steps).

    A first signal sets :attr:`received`; under JAX's preemption service a SIGINT is passed on
    as SIGTERM to the service's notifier, which owns SIGTERM (no Python handler replaces it).
    A second signal during :meth:`saving` waits for the save; elsewhere it raises
    ``KeyboardInterrupt`` at once. During :meth:`setup` (a Trainer's construction: data
    preparation, compilation) SIGINT raises ``KeyboardInterrupt`` at once, as Python's own
    handler does, while SIGTERM is noted and stops the run before its first step."""

    def __init__(self):
        self.received: str | None = None  # the first signal this process got
        self._depth = 0
        self._old: dict[int, Any] = {}
        self._saving = False
        self._setup = False
        self._service = False

    def __enter__(self):
        if self._depth == 0:
            self.received, self._old = None, {}
            self._service = _preemption_service()
            if threading.current_thread() is threading.main_thread():
                ours = [signal.SIGINT] + ([] if self._service else [signal.SIGTERM])
                for signum in ours:
                    self._old[signum] = signal.signal(signum, self._handle)
        self._depth += 1
        return self

    def _handle(self, signum, frame):
        del frame
        name = signal.Signals(signum).name
        if self._setup and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = name
            if self._service:  # the coordination service spreads the notice
                os.kill(os.getpid(), signal.SIGTERM)
            return
        if self._saving:
            log.warning("%s during a checkpoint's save: the save finishes first", name)
            return
        raise KeyboardInterrupt(f"second signal ({name}): stopped without a checkpoint")

    def saving(self):
        """A ``with`` block during which a second signal waits (a checkpoint being written)."""
        return self._while("_saving")

    def setup(self):
        """A ``with`` block during which SIGINT stops at once (a Trainer's construction)."""
        return self._while("_setup")

    def _while(self, attribute: str):
        signals = self

        class _While:
            def __enter__(self):
                setattr(signals, attribute, True)

            def __exit__(self, *exc):
                setattr(signals, attribute, False)
                return False

        return _While()

    def stop_now(self, step: int, every: int) -> bool:
        """Whether to stop before ``step``. Under JAX's preemption service: its sync point
        (every process stops at the same step, whichever received the signal); a single
        process: the flag; several processes without the service: the flags, agreed on (an
        all-gather) every ``every`` steps."""
        if self._service:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(next(_SYNC_CALLS))
        if jax.process_count() == 1:
            return self.received is not None
        if step % every:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.received is not None,
                                                             np.int32))
        return bool(np.any(flags))

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for signum, old in self._old.items():
                signal.signal(signum, old)
            self._old = {}
        return False


_SIGNALS = _Signals()


def _global_batch(local: np.ndarray, sharding, global_shape) -> jax.Array:
    local = np.asarray(local, np.int32)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def _window_record(fetched: list[dict[str, Any]], seconds: float,
                   tokens_per_step: int) -> dict[str, Any]:
    """Mean loss and gradient norm (over non-skipped steps), skips, throughput (tokens over
    the seconds spent in train steps) and the number of steps of a window of per-step
    metrics. ``window`` is below ``log_every`` after a resume, at the end of a call and at an
    interrupt, so every record says how many steps it averages."""
    norms = [float(m["grad_norm"]) for m in fetched]
    finite = [n for n in norms if np.isfinite(n)]
    return {
        "loss": float(np.mean([m["loss"] for m in fetched])),
        "grad_norm": float(np.mean(finite)) if finite else float("nan"),
        "skipped": int(sum(int(m["skipped"]) for m in fetched)),
        "skipped_total": int(fetched[-1]["skipped_total"]),
        "tokens_per_s": tokens_per_step * len(fetched) / max(seconds, 1e-9),
        "window": len(fetched),
    }


class TrainingStalledError(RuntimeError):
    """``train.max_consecutive_skips`` steps in a row were skipped (non-finite updates); the
    run stopped with a checkpoint of its last step (the parameters of the last good step)."""


def _resolve_config(config: ml_collections.ConfigDict, workdir: str | None, *,
                    resume: bool | str, data: str | None, num_devices: int
                    ) -> tuple[ml_collections.ConfigDict, str | None]:
    """The completed, validated config (``data`` and the workdir written into it) and the
    workdir (``None``: no output)."""
    if resume not in (False, True, "auto"):
        raise ConfigError(f"resume={resume!r} must be False, True or 'auto'")
    config = complete_config(config)
    if data:
        with config.unlocked():
            config.data.source = data
    workdir = workdir if workdir is not None else (config.train.workdir or None)
    if resume and not workdir:
        raise ConfigError("resume needs a workdir (--workdir) holding the checkpoints")
    with config.unlocked():
        config.train.workdir = workdir or ""
    validate_config(config, num_devices)
    return config, workdir


def _parameter_paths(model_config: Any) -> list[str]:
    """The model's parameter paths (``layers/0/mlp/down_proj/kernel``), from abstract shapes:
    nothing is allocated or compiled."""
    abstract = model_spec(model_config).abstract(model_config)
    return list(flat_paths(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))))


def _warn_if_nothing_to_communicate(config: ml_collections.ConfigDict, replicas: int) -> None:
    """Logs a warning when a run with one data-parallel replica asks for a codec or method
    (:func:`~gift_jax.training.config.nothing_to_communicate`): it would otherwise finish
    with wire bytes 0 and look like a comparison it is not. ``replicas``: the mesh's
    :func:`~gift_jax.training.mesh.data_parallel_size` (not its device count: ``fsdp`` and
    ``tensor`` devices share one replica)."""
    warning = nothing_to_communicate(config, replicas)
    if warning is not None:
        log.warning(warning)


def _read_summary(workdir: str | None) -> dict[str, Any] | None:
    path = epath.Path(workdir) / "summary.json" if workdir else None
    if path and path.exists():
        return json.loads(path.read_text())
    return None


class Trainer:
    """One training run in progress: the trainer's loop as an object.

    Construction is the setup (config validation, mesh, the cached compiled
    :class:`~gift_jax.training.program.Program`, the initial or restored state, the compiled
    step variants and their wire bytes, the evaluation batches, the metrics writer);
    :meth:`run` advances the carried ``params``/``opt_state`` by a number of steps with
    logging, evaluation, diagnostics and checkpoints at their cadences; :meth:`finish` writes
    the final evaluation, checkpoint and ``summary.json``. :func:`train` is these three calls;
    the experiments (:mod:`gift_jax.apps.experiments`) drive the same object between their
    measurements, so there is one training loop in the package.

    Timing: the :class:`~gift_jax.utils.timing.Stopwatch` ``watch`` charges ``train`` only
    with train steps (each record's ``tokens_per_s`` divides by its steps' share), and keeps
    ``eval`` (evaluation and diagnostics) and ``checkpoint`` apart.

    Skipped steps (non-finite updates, :func:`~gift_jax.training.optim.skip_nonfinite`) are
    shown in the progress bar, warned about when a logged window skips more than
    ``train.skip_warning_fraction`` of its steps, and stop the run
    (:class:`TrainingStalledError`, checkpoint kept) after ``train.max_consecutive_skips``
    consecutive skips (detected at log steps).
    """

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        workdir: str | None = None,
        *,
        resume: bool | str = False,
        data: str | None = None,
        data_dir: str | None = None,
        batches: BatchFn | None = None,
        eval_split: str | None = None,
        compiler_options: dict[str, Any] | None = None,
        show_progress: bool = False,
        devices: Sequence[jax.Device] | None = None,
        update_rule: Callable | None = None,
    ):
        """Arguments as :func:`train`'s, plus ``devices`` (the mesh's devices; default: all of
        every process) and ``update_rule`` (``schedule → optax transformation`` replacing the
        config's AdamW/Muon after the reduction; see
        :func:`~gift_jax.training.method.build_optimizer`)."""
        devices = jax.devices() if devices is None else list(devices)
        config, workdir = _resolve_config(config, workdir, resume=resume, data=data,
                                          num_devices=len(devices))
        self.config, self.workdir = config, workdir
        tc = config.train
        model_config = model_config_of(config.model)
        # gift.layers against the model's paths, before anything is written to disk
        validate_layer_patterns(config, _parameter_paths(model_config))
        splits: tuple[str, ...] = ("train", "validation")
        if batches is None:
            mismatch = vocab_mismatch(model_config.vocab_size, config.data.tokenizer)
            if mismatch:  # before the corpus or the tokenizer is prepared on disk
                raise ConfigError(mismatch)
            batches, _, splits = data_batches(config.data.source, data_dir,
                                              config.data.tokenizer, config.data.pipeline,
                                              config.data.workers, config.data.id_cache)
        if eval_split is None:
            eval_split = next((s for s in ("validation", "test") if s in splits), None)
        self.batches = batches

        mesh = mesh_from_config(config.mesh, devices)
        _warn_if_nothing_to_communicate(config, data_parallel_size(mesh))
        self.checkpointer = (Checkpointer(workdir, config, keep=tc.keep_checkpoints,
                                          mesh_shape=dict(mesh.shape))
                             if workdir else None)
        latest = self.checkpointer.latest_step() if self.checkpointer else None
        if latest is not None and not resume:
            self.close()
            raise ConfigError(
                f"workdir {workdir!r} already holds checkpoints (latest step {latest}): pass "
                "--resume to continue that run, or choose a new workdir")
        if latest is None and resume is True:
            self.close()
            raise ConfigError(
                f"resume=True but workdir {workdir!r} holds no checkpoint: run without --resume "
                "to start fresh, or pass --resume=auto (resume='auto') to resume when there is "
                "one and start fresh otherwise")
        if latest is not None:  # fail fast, before anything is compiled
            meta = self.checkpointer.check_config()
            config = self._extend(config, meta)
        self.program = program = program_for(config, mesh, compiler_options, update_rule)
        step_fn = program.step
        self.params, self.opt_state = program.init()
        self.step = self.data_position = 0
        self.data_state = None  # the stream pipeline's position (see data_state())
        if latest is not None:
            restored = self.checkpointer.restore({"params": self.params,
                                                  "opt_state": self.opt_state})
            self.params, self.opt_state = step_fn.place(restored.state["params"],
                                                        restored.state["opt_state"])
            self.step, self.data_position = restored.step, restored.data_position
            self.data_state = restored.data_state
            log.info("resumed from step %d", self.step)
        elif resume == "auto":
            log.info("no checkpoint in %s: starting a fresh run", workdir)
        self.start = self.step
        #: The restored checkpoint is of a run that had already reached ``train.num_steps``.
        self.already_finished = latest is not None and self.step >= tc.num_steps

        self.watch = Stopwatch()
        with self.watch.phase("compile"):
            for variant in step_fn.variants():
                step_fn.compiled(variant)
        # bytes per device across the data axes (on a sharded mesh GSPMD's collectives inside
        # a replica are not counted: they are the model parallelism's, not the reduction's)
        self.wire = {v: step_fn.wire_report(v).over(data_axes(mesh)).total
                     for v in step_fn.variants()}
        self.replicas = data_parallel_size(mesh)
        self.local_param_bytes = shard_bytes(self.params)

        self.evaluate_fn = program.evaluate if (tc.eval_every and eval_split) else None
        self.eval_data: list[jax.Array] = []
        if self.evaluate_fn is not None:
            it = batches(eval_split, tc.global_batch_size, tc.seq_len,
                         seed=config.data.shuffle_seed, start_step=0,
                         process_index=jax.process_index(), process_count=jax.process_count())
            shape = (tc.global_batch_size, tc.seq_len + 1)
            self.eval_data = [_global_batch(next(it), step_fn.batch_sharding, shape)
                              for _ in range(tc.eval_batches)]
        self.diagnose = program.diagnose if tc.diagnostics_every else None
        self.is_main = jax.process_index() == 0
        self.writer = MetricsWriter(workdir if not self.already_finished else None,
                                    enabled=self.is_main, start_step=self.start)
        self.progress = Progress(self.start, tc.num_steps,
                                 enabled=self.is_main and show_progress
                                 and not self.already_finished)
        self.n_params = count_params(model_config)
        self.num_devices = len(devices)
        self.history: list[dict[str, Any]] = []
        self.eval_loss: float | None = None  # last evaluation
        self.last_loss: float | None = None  # loss of the last logged step
        self._train_it: Iterator[np.ndarray] | None = None
        self._consecutive_skips = 0
        self._steps_run = self._refreshes_run = 0  # by this process (the refresh share)

    # ---- small helpers -------------------------------------------------------------------

    def _extend(self, config: ml_collections.ConfigDict,
                meta: dict[str, Any]) -> ml_collections.ConfigDict:
        """The config with the schedule of a resumed run whose ``train.num_steps`` changed
        made explicit (:func:`~gift_jax.training.config.extend_schedule`), logged in one
        line (a warning where the learning rate jumps)."""
        extended, message, old_length = extend_schedule(meta["config"], config)
        if message is not None:
            if extended.train.extend_schedule == "stretch":
                step = meta["step"]
                before = learning_rate_schedule(extended.optimizer, old_length)(step)
                after = learning_rate_schedule(extended.optimizer,
                                               schedule_length(extended))(step)
                log.warning("%s: %.3g -> %.3g at step %d", message, before, after, step)
            else:
                log.info(message)
        self.config = extended
        self.checkpointer.config = extended
        return extended

    @property
    def tc(self) -> ml_collections.ConfigDict:
        return self.config.train

    @property
    def tokens_per_step(self) -> int:
        return self.tc.global_batch_size * self.tc.seq_len

    @property
    def fp32_wire(self) -> float:
        """Bytes per device of one fp32 ring all-reduce of the parameters (of each device's
        shard of them, on a sharded mesh) across the data-parallel replicas."""
        n = self.replicas
        return 2 * (n - 1) / n * self.local_param_bytes

    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Appends a record to the history and writes it (metrics.jsonl, TensorBoard).

        Args:
          step: the step the record belongs to.
          metrics: ``{name: value}``; array scalars are converted with ``.item()``.
        """
        metrics = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        self.history.append({"step": step, **metrics})
        self.writer.write(step, metrics)

    def evaluate(self) -> float:
        """Mean loss over the evaluation batches at the current step, recorded as
        ``eval/loss`` (timed as ``eval``)."""
        with self.watch.phase("eval", block=self.params):
            value = float(np.mean([float(self.evaluate_fn(self.params, b))
                                   for b in self.eval_data]))
        self.record(self.step, {"eval/loss": value})
        self.eval_loss = value
        return value

    def save(self) -> None:
        """Checkpoints the carried state at the current step (no-op without a workdir)."""
        if self.checkpointer is not None:
            with self.watch.phase("checkpoint"), _SIGNALS.saving():
                self.checkpointer.save(
                    self.step, {"params": self.params, "opt_state": self.opt_state},
                    data_position=self.data_position, skipped=int(self.opt_state.skipped),
                    data_state=self._data_state())
            self.writer.flush()  # what the checkpoint covers is on storage too

    def _data_state(self) -> dict | None:
        """The train iterator's position as one global state (every process's lanes, gathered)
        when it has one (the stream pipeline), else ``None``."""
        it = self._train_it
        if it is None or not hasattr(it, "state"):
            return self.data_state  # not read since the restore (or no state to keep)
        mine = it.state()
        if jax.process_count() == 1:
            return global_state([mine])
        from jax.experimental import multihost_utils

        lanes = np.asarray(mine["lanes"], np.int64)
        gathered = multihost_utils.process_allgather(lanes)  # (processes, lanes, 2)
        return {"lanes": gathered.reshape(-1, 2).tolist()}

    def _diagnostics(self, batch: jax.Array) -> None:
        with self.watch.phase("eval", block=self.params):
            diag = {f"wire/bytes_per_step_{'refresh' if v else 'ordinary'}": b
                    for v, b in self.wire.items()}
            diag["wire/fp32_reference"] = self.fp32_wire
            diag.update(self.program.optimizer.plan.state_metrics(self.opt_state))
            if self.diagnose is not None:
                report = jax.device_get(self.diagnose(self.params, self.opt_state, batch))
                diag.update({f"fidelity/{k}": float(v) for k, v in report.items()})
        self.record(self.step, diag)

    def _log_window(self, window: list[dict[str, jax.Array]], seconds: float,
                    refreshes: int) -> None:
        """One train record of a window of steps; tracks consecutive skips."""
        fetched = jax.device_get(window)
        self.last_loss = float(fetched[-1]["loss"])
        rec = _window_record(fetched, seconds, self.tokens_per_step)
        rec["learning_rate"] = float(self.program.optimizer.schedule(self.step - 1))
        rec["refreshes"] = refreshes
        self.record(self.step, rec)
        for m in fetched:
            self._consecutive_skips = self._consecutive_skips + 1 if int(m["skipped"]) else 0
        postfix = {"loss": f"{rec['loss']:.4f}", "tok_s": f"{rec['tokens_per_s']:.0f}"}
        if rec["skipped_total"]:
            postfix["skipped"] = rec["skipped_total"]
        self.progress.update(len(fetched), **postfix)
        warn_at = self.tc.skip_warning_fraction
        if rec["skipped"] and rec["skipped"] > warn_at * len(fetched):
            msg = (f"steps {self.step - len(fetched) + 1}-{self.step}: {rec['skipped']} of "
                   f"{len(fetched)} skipped (non-finite updates; {rec['skipped_total']} in "
                   f"all) - the learning rate (optimizer.learning_rate="
                   f"{self.config.optimizer.learning_rate}) may be too high")
            log.warning(msg)

    def _check_stalled(self) -> None:
        limit = self.tc.max_consecutive_skips
        if limit and self._consecutive_skips >= limit:
            self.save()
            where = (f"; checkpoint of step {self.step} kept in {self.workdir}"
                     if self.checkpointer else "")
            raise TrainingStalledError(
                f"stopped at step {self.step}: the last {self._consecutive_skips} steps were "
                f"all skipped (non-finite updates; train.max_consecutive_skips={limit}){where}; "
                f"lower optimizer.learning_rate={self.config.optimizer.learning_rate} or check "
                "the data")

    # ---- the loop ------------------------------------------------------------------------

    def run(self, steps: int | None = None) -> None:
        """Advances ``steps`` optimizer steps (default: to ``train.num_steps``; never past it).

        Per step: the plan's refresh variant where due; a record every ``log_every`` steps and
        at the end of the call; evaluation, wire/fidelity diagnostics and checkpoints at their
        cadences. Metrics are fetched from the device only at log steps.

        Args:
          steps: the number of optimizer steps to run, or ``None`` (up to
            ``train.num_steps``).

        Raises:
          Preempted: on SIGTERM or SIGINT (a ``KeyboardInterrupt``), after logging the partial
            window and saving a checkpoint of the last completed step (see the module).
          TrainingStalledError: too many consecutive skipped steps (checkpoint saved).
        """
        tc = self.tc
        end = tc.num_steps if steps is None else min(tc.num_steps, self.step + steps)
        step_fn = self.program.step
        if self._train_it is None:
            resume = {"state": self.data_state} if self.data_state is not None else {}
            self._train_it = self.batches(
                "train", tc.global_batch_size, tc.seq_len, seed=self.config.data.shuffle_seed,
                start_step=self.data_position, process_index=jax.process_index(),
                process_count=jax.process_count(), **resume)
        shape = (tc.global_batch_size, tc.seq_len + 1)
        window: list[dict[str, jax.Array]] = []
        refreshes, window_s = 0, 0.0
        clock = time.perf_counter()  # start of the current stretch of train steps

        def stop_clock() -> None:
            nonlocal window_s
            if window:
                jax.block_until_ready(window[-1])
            elapsed = time.perf_counter() - clock
            window_s += elapsed
            self.watch.add("train", elapsed)

        def flush() -> None:
            nonlocal window, refreshes, window_s
            stop_clock()
            self._log_window(window, window_s, refreshes)
            window, refreshes, window_s = [], 0, 0.0

        with _SIGNALS as signals:
            while self.step < end:
                if signals.stop_now(self.step, tc.log_every):
                    if window:
                        flush()
                    self._stop(signals.received or "SIGTERM")
                batch = _global_batch(next(self._train_it), step_fn.batch_sharding, shape)
                refresh = step_fn.refresh_due(self.step, self.opt_state)
                if refresh is STATS and not step_fn.is_compiled(STATS):
                    stop_clock()  # GIFT's statistics-only variant compiles on its first step
                    with self.watch.phase("compile"):
                        step_fn.compiled(STATS)
                    clock = time.perf_counter()
                self.params, self.opt_state, metrics = step_fn(self.params, self.opt_state,
                                                               batch, refresh)
                window.append(metrics)
                refreshes += int(refresh)
                self._steps_run += 1
                self._refreshes_run += int(refresh)
                self.step += 1
                self.data_position += 1
                step = self.step
                if step % tc.log_every == 0 or step == end:
                    flush()
                    self._check_stalled()
                due_eval = self.evaluate_fn is not None and step % tc.eval_every == 0
                due_diag = bool(tc.diagnostics_every) and step % tc.diagnostics_every == 0
                due_ckpt = (self.checkpointer is not None and bool(tc.checkpoint_every)
                            and step % tc.checkpoint_every == 0)
                if due_eval or due_diag or due_ckpt:
                    if window:
                        stop_clock()
                    if due_eval:
                        self.evaluate()
                    if due_diag:
                        self._diagnostics(batch)
                    if due_ckpt:
                        self.save()
                    clock = time.perf_counter()
                elif not window:
                    clock = time.perf_counter()  # the record's writing is not a train step

    def _stop(self, name: str) -> None:
        """Stops on the signal ``name``: checkpoints the current step (unless no step has run
        in this process: nothing new to save) and raises :class:`Preempted` naming it."""
        what = "interrupted" if name == "SIGINT" else f"preempted ({name})"
        if not self._steps_run:
            raise Preempted(f"{what} before the first step (step {self.step}): stopped, no "
                            "checkpoint written", step=self.step, signal_name=name, saved=False)
        self.save()
        saved = self.checkpointer is not None
        raise Preempted(f"{what} at step {self.step}" + ("; checkpoint saved" if saved else ""),
                        step=self.step, signal_name=name, saved=saved)

    def summary(self) -> dict[str, Any]:
        """The run's summary (also what ``summary.json`` holds)."""
        config, step = self.config, self.step
        # the share of refresh steps this process ran (an adaptive rule's is not 1/K), or the
        # plan's nominal one before any step
        refresh_fraction = (self._refreshes_run / self._steps_run if self._steps_run
                            else self.program.optimizer.plan.refresh_fraction())
        mean_wire = ((1 - refresh_fraction) * self.wire[False]
                      + refresh_fraction * self.wire.get(True, 0.0))
        train_s = self.watch.get("train")
        return {
            "steps": step,
            "steps_this_call": step - self.start,
            "final_loss": self.last_loss,
            "eval_loss": self.eval_loss,
            "skipped_steps": int(self.opt_state.skipped),
            "params": self.n_params,
            "devices": self.num_devices,
            "mesh": {k: int(v) for k, v in self.program.mesh.shape.items()},
            "processes": jax.process_count(),
            "comm_codec": config.comm.codec,
            "comm_method": config.comm.method,
            "optimizer": config.optimizer.name,
            "wire_bytes_per_step": {("refresh" if v else "ordinary"): b
                                    for v, b in self.wire.items()},
            "wire_bytes_per_step_mean": mean_wire,
            "wire_fp32_reference": self.fp32_wire,
            "compile_s": self.watch.get("compile"),
            "train_s": train_s,
            "eval_s": self.watch.get("eval"),
            "checkpoint_s": self.watch.get("checkpoint"),
            "tokens_per_s": self.tokens_per_step * (step - self.start) / max(train_s, 1e-9),
        }

    def finish(self) -> dict[str, Any]:
        """After the last step: a final evaluation (unless this step had one), the final
        checkpoint, and the summary (printed and written to ``summary.json`` on process 0)."""
        tc = self.tc
        if self.evaluate_fn is not None and (self.eval_loss is None or self.step % tc.eval_every):
            self.evaluate()
        self.save()
        summary = self.summary()
        self.progress.close()  # the summary goes on a line of its own, below the bar
        if self.is_main:
            if self.workdir:
                (epath.Path(self.workdir) / "summary.json").write_text(
                    json.dumps(summary, indent=2, default=str))
            print("summary: " + json.dumps(summary, default=str), flush=True)
        return summary

    def close(self) -> None:
        """Closes the progress bar, the metrics writer and the checkpointer, and lets the train
        iterator go (the stream pipeline's worker processes end with it)."""
        for part in ("progress", "writer", "checkpointer"):
            obj = getattr(self, part, None)
            if obj is not None:
                obj.close()
        it, self._train_it = getattr(self, "_train_it", None), None
        if hasattr(it, "close"):
            it.close()


def train(
    config: ml_collections.ConfigDict,
    workdir: str | None = None,
    *,
    resume: bool | str = False,
    data: str | None = None,
    data_dir: str | None = None,
    batches: BatchFn | None = None,
    eval_split: str | None = None,
    stop_after: int | None = None,
    show_progress: bool = True,
    compiler_options: dict[str, Any] | None = None,
) -> TrainResult:
    """Trains the model of ``config`` data-parallel over all devices of all processes.

    A :class:`Trainer` built, run and finished: setup, the steps with logging, evaluation,
    diagnostics and checkpoints, then the final evaluation and checkpoint and
    ``summary.json``.

    Args:
      config: a run config (``configs/base.py`` + overrides); missing trainer fields get
        their defaults (:data:`gift_jax.training.config.TRAINER_DEFAULTS`), a former
        ``comm.mode`` is translated to ``comm.codec`` + ``comm.method``.
      workdir: checkpoints, ``metrics.jsonl``, TensorBoard events and ``summary.json``
        (default ``config.train.workdir``; empty: nothing is written and ``resume`` is
        impossible).
      resume: ``True``: continue from the latest checkpoint in ``workdir`` (an error if there
        is none); ``"auto"``: continue if there is one, else start fresh; ``False``: start
        fresh (an error if ``workdir`` holds checkpoints). The config must be the one the
        checkpoint was written with, except for logging/eval/checkpoint cadence. Resuming a
        run that already reached ``train.num_steps`` changes nothing on disk and returns its
        ``summary.json``.
      data: corpus spec for :func:`gift_jax.data.get_source` (default ``config.data.source``).
      data_dir: where the corpus lives (TFDS data dir / cache).
      batches: inject a batch function instead of :mod:`gift_jax.data` (see :data:`BatchFn`).
      eval_split: split of the periodic evaluation (default ``"validation"`` if the source has
        it, else ``"test"``; with injected ``batches``: ``"validation"``).
      stop_after: stop after this many steps of this call (a partial run: a checkpoint is
        written, and ``resume=True`` continues it; ``--stop_after`` in ``scripts/train.py``).
      show_progress: show the tqdm bar (process 0).
      compiler_options: XLA options for every program of the run: initialisation, the train
        step variants, evaluation and diagnostics (e.g.
        ``{"xla_backend_optimization_level": 0}`` to compile small test models fast).

    Returns:
      A :class:`TrainResult`.

    Raises:
      ConfigError: a bad setting (one line naming it and what is allowed).
      CheckpointMismatchError: ``resume`` with a checkpoint of another config.
      TrainingStalledError: ``train.max_consecutive_skips`` consecutive skipped steps.
      Preempted: on SIGTERM or SIGINT (a ``KeyboardInterrupt``), after saving a checkpoint
        of the step reached (see the module).
    """
    with _SIGNALS:  # a signal during the setup stops before the first step
        return _train(config, workdir, resume=resume, data=data, data_dir=data_dir,
                      batches=batches, eval_split=eval_split, stop_after=stop_after,
                      show_progress=show_progress, compiler_options=compiler_options)


def _train(config, workdir, *, resume, data, data_dir, batches, eval_split, stop_after,
           show_progress, compiler_options) -> TrainResult:
    with _SIGNALS.setup():
        trainer = Trainer(config, workdir, resume=resume, data=data, data_dir=data_dir,
                          batches=batches, eval_split=eval_split,
                          compiler_options=compiler_options, show_progress=show_progress)
    try:
        if trainer.already_finished:
            summary = _read_summary(trainer.workdir) or trainer.summary()
            msg = (f"run in {trainer.workdir} already finished at step {trainer.step} "
                   f"(train.num_steps={trainer.tc.num_steps}); nothing to do")
            log.info(msg)
            if trainer.is_main:
                print(msg, flush=True)
        else:
            trainer.run(stop_after)
            summary = trainer.finish()
    finally:
        trainer.close()
    return TrainResult(trainer.params, trainer.opt_state, trainer.step, trainer.history,
                       summary)
