"""Metric sinks: JSON lines, TensorBoard event files and a tqdm progress bar.

Only process 0 writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    return value


class MetricsWriter:
    """Appends ``{"step": s, **metrics}`` records to ``<workdir>/metrics.jsonl`` and writes the
    same scalars to TensorBoard event files in ``<workdir>/tensorboard``."""

    def __init__(self, workdir: str | None, enabled: bool = True, *, start_step: int = 0):
        """``start_step``: records of later steps (from a run that died after its last
        checkpoint) are dropped from the JSONL file, so a resumed run does not log them twice.
        """
        self.enabled = enabled and bool(workdir)
        self._jsonl = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                kept = [line for line in f if line.strip()
                        and json.loads(line).get("step", 0) <= start_step]
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(kept)
        self._jsonl = open(path, "a", encoding="utf-8")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """One record; keys with a ``/`` become TensorBoard groups (``eval/loss``)."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._tb.close()
            self._jsonl = self._tb = None


class Progress:
    """A tqdm bar over the run's steps showing loss and tokens/s (a no-op when disabled)."""

    def __init__(self, start: int, total: int, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                             file=sys.stderr, desc="train")

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(n)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
