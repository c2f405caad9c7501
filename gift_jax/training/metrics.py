"""Metric sinks: JSON lines, TensorBoard event files and a tqdm progress bar.

Only process 0 writes; other processes get a writer that does nothing. The workdir may be a
local folder or object storage (``gs://…``, through ``etils.epath``). Object stores have no
append and no partial writes, so there the records are kept in memory and written as whole
objects: ``metrics.jsonl`` is rewritten, and the TensorBoard events since the last write go to
a new event file (TensorBoard reads every event file of a folder in name order). That happens
at most every ``flush_every_s`` seconds, at every checkpoint (:meth:`MetricsWriter.flush`) and
at the end, so what a checkpoint covers is never lost.
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from typing import Any

from etils import epath

from gift_jax.data.storage import is_remote


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    return value


class _ObjectEventFile:
    """A TensorBoard event file on object storage: what is written between two flushes
    becomes one object ``<path>.<part>`` (object stores cannot append)."""

    def __init__(self, path: str):
        self.path = path
        self.part = 0
        self.buffer = io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        data = self.buffer.getvalue()
        if data:
            epath.Path(f"{self.path}.{self.part:06d}").write_bytes(data)
            self.part += 1
            self.buffer = io.BytesIO()

    def close(self) -> None:
        self.flush()


class _ObjectEventFiles:
    """tensorboardX's writer factory for a URL scheme (``register_writer_factory``)."""

    @staticmethod
    def open(path: str) -> _ObjectEventFile:
        return _ObjectEventFile(path)

    @staticmethod
    def directory_check(path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


def _tensorboard(logdir: str):
    from tensorboardX import SummaryWriter, record_writer

    if is_remote(logdir):
        record_writer.register_writer_factory(logdir.split("://")[0], _ObjectEventFiles)
        # tensorboardX's own timer must not write a part between two of our flushes
        return SummaryWriter(logdir, flush_secs=24 * 3600)
    return SummaryWriter(logdir)


class MetricsWriter:
    """Appends ``{"step": s, **metrics}`` records to ``<workdir>/metrics.jsonl`` and writes the
    same scalars to TensorBoard event files in ``<workdir>/tensorboard``."""

    def __init__(self, workdir: str | None, enabled: bool = True, *, start_step: int = 0,
                 flush_every_s: float = 60.0):
        """Args:
          workdir: a local folder or an object-store URL (``None`` or empty: write nothing).
          enabled: ``False`` on processes other than 0.
          start_step: records of later steps (from a run that died after its last
            checkpoint) are dropped from the JSONL file, so a resumed run does not log them
            twice.
          flush_every_s: on object storage, the shortest time between two writes (local files
            are written at every record).
        """
        self.enabled = enabled and bool(workdir)
        self._tb = None
        if not self.enabled:
            return
        self.remote = is_remote(workdir)
        self.flush_every_s = flush_every_s if self.remote else 0.0
        root = epath.Path(workdir)
        root.mkdir(parents=True, exist_ok=True)
        self._path = root / "metrics.jsonl"
        self._lines: list[str] = []
        if self._path.exists():
            self._lines = [line + "\n" for line in self._path.read_text().splitlines()
                           if line.strip() and json.loads(line).get("step", 0) <= start_step]
            self._path.write_text("".join(self._lines))
        self._written = len(self._lines)
        self._last_flush = time.monotonic()
        self._tb = _tensorboard(str(root / "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """One record; keys with a ``/`` become TensorBoard groups (``eval/loss``).

        Args:
          step: the step the record belongs to.
          metrics: ``{name: value}``; array scalars are converted with ``.item()``,
            non-finite floats are written to the JSON line as strings, and only int and float
            values (not bools) go to TensorBoard.
        """
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._lines.append(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Writes what is not yet on storage: appended to a local file, or the whole
        ``metrics.jsonl`` and a new event file on object storage."""
        if not self.enabled or self._written == len(self._lines):
            return
        if self.remote:
            self._path.write_text("".join(self._lines))
        else:
            with self._path.open("a") as f:
                f.writelines(self._lines[self._written:])
        self._written = len(self._lines)
        self._tb.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._tb is not None:
            self.flush()
            self._tb.close()
            self._tb = None


class Progress:
    """A tqdm bar over the run's steps showing loss and tokens/s (a no-op when disabled)."""

    def __init__(self, start: int, total: int, enabled: bool = True):
        """Args:
          start: the step the bar starts at (a resumed run's).
          total: the run's last step (``train.num_steps``).
          enabled: ``False``: no bar (processes other than 0, or progress not shown).
        """
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                             file=sys.stderr, desc="train")

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advances the bar by ``n`` steps.

        Args:
          n: steps completed since the last update.
          **postfix: ``{label: value}`` shown after the bar, replacing the previous ones
            (none given: the previous ones stay).
        """
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(n)

    def write(self, line: str) -> None:
        """Prints ``line`` above the bar without breaking it (nothing when disabled).

        Args:
          line: the text.
        """
        if self._bar is not None:
            self._bar.write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
