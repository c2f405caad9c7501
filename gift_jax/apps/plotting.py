"""Loss curves of several runs in one PNG (used by ``scripts/plot.py`` and the demo).

Runs are ``(label, workdir)`` pairs: two workdirs with the same folder name (``a/fp8`` and
``b/fp8``) are both drawn, labelled by the shortest path suffix that tells them apart
(:func:`path_labels`). With a ``reference`` run (the demo's fp32) a second panel shows each
other run's loss minus the reference's, smoothed: curves that lie on top of each other in the
first panel differ there, which is the effect of the wire format.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence

from etils import epath


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``metrics.jsonl``.

    Args:
      workdir: a training workdir (local path or any ``etils.epath`` path).

    Returns:
      One dict per non-empty line of ``<workdir>/metrics.jsonl``, in file order.

    Raises:
      FileNotFoundError: the workdir has no ``metrics.jsonl``.
    """
    path = epath.Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {workdir} a training workdir?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def unique_labels(labels: Sequence[str]) -> list[str]:
    """``labels`` with repeats numbered (``fp8``, ``fp8 (2)``), so no run is dropped.

    Args:
      labels: run labels, possibly repeated.

    Returns:
      The labels in order, the n-th repeat of a label (n >= 2) suffixed `` (n)``.
    """
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def path_labels(workdirs: Sequence[str | os.PathLike]) -> list[str]:
    """A label per workdir: the shortest suffix of its path (in folders) that no other
    workdir shares (``a/fp8``, ``b/fp8`` for two runs named ``fp8``; the folder name alone
    when it is unique). The same directory given twice is numbered (:func:`unique_labels`).

    Args:
      workdirs: the runs' folders (relative paths are resolved against the current
        directory first).

    Returns:
      One label per workdir, in order.
    """
    parts = [pathlib.Path(os.path.abspath(w)).parts for w in workdirs]
    labels = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i and p != mine]
        k = 1
        while k < len(mine) and any(p[-k:] == mine[-k:] for p in others):
            k += 1
        labels.append(str(pathlib.PurePath(*mine[-k:])))
    return unique_labels(labels)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Centred moving average over ``window`` points (fewer at the ends).

    Args:
      values: the series.
      window: points averaged (an even window acts as ``window + 1``; < 1 as 1).

    Returns:
      The smoothed series, as long as ``values``.
    """
    half = max(window, 1) // 2
    n = len(values)
    out = []
    for i in range(n):
        chunk = values[max(0, i - half): min(n, i + half + 1)]
        out.append(sum(chunk) / len(chunk))
    return out


def difference_to(reference: Sequence[tuple[int, float]],
                  run: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """``(step, run loss − reference loss)`` at the steps both runs logged.

    Args:
      reference: ``(step, loss)`` pairs of the reference run.
      run: ``(step, loss)`` pairs of the other run.

    Returns:
      ``(step, difference)`` pairs in ``run``'s order, for the steps present in both.
    """
    ref = dict(reference)
    return [(step, value - ref[step]) for step, value in run if step in ref]


def _series(records: Iterable[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def difference_table(runs: Sequence[tuple[str, str | os.PathLike]], reference: str) -> str:
    """Markdown: per run, the largest ``|train loss − reference's|`` over the steps both
    logged, and the last eval losses' difference.

    Args:
      runs: ``(label, workdir)`` pairs with distinct labels (:func:`unique_labels` numbers
        repeated ones).
      reference: the label of the run to compare with (one of ``runs``' labels).

    Returns:
      The Markdown table, one line per run (the reference's own included); NaN where a run
      has no common train step or no eval loss.

    Raises:
      ValueError: a label given twice, or a ``reference`` that is none of the labels.
      FileNotFoundError: a workdir without ``metrics.jsonl``.
    """
    labels = [label for label, _ in runs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"difference_table: labels {repeated} are given to more than one run "
                         "(one line per label); number them with unique_labels")
    if reference not in labels:
        raise ValueError(f"difference_table: reference={reference!r} is not a run label; "
                         f"the labels are {labels}")
    records = {label: read_metrics(workdir) for label, workdir in runs}
    ref_train, ref_eval = _series(records[reference], "loss"), _series(records[reference],
                                                                      "eval/loss")
    lines = [f"| run | max abs train-loss difference to {reference} | last eval loss "
             "| difference |", "|---|---|---|---|"]
    for label, recs in records.items():
        diffs = [abs(d) for _, d in difference_to(ref_train, _series(recs, "loss"))]
        last = _series(recs, "eval/loss")[-1:] or [(None, float("nan"))]
        gap = last[0][1] - (ref_eval[-1][1] if ref_eval else float("nan"))
        lines.append(f"| {label} | {max(diffs, default=float('nan')):.2e} | {last[0][1]:.6f} "
                     f"| {gap:+.2e} |")
    return "\n".join(lines)


def plot_runs(runs: Mapping[str, str | os.PathLike] | Sequence[tuple[str, str | os.PathLike]],
              out_png: str | os.PathLike, title: str = "",
              reference: str | None = None, smooth_window: int = 5) -> pathlib.Path:
    """Train (solid) and eval (markers) loss against step, one colour per run.

    Args:
      runs: ``{label: workdir}`` or ``(label, workdir)`` pairs (repeated labels are numbered).
      out_png: the PNG written.
      title: the figure's title.
      reference: the label of a run to compare with: a second panel draws every other run's
        train loss minus the reference's (centred moving average over ``smooth_window`` log
        points) and eval loss difference (markers). Ignored when no run has that label.
      smooth_window: points of the moving average of the difference panel.

    Raises:
      FileNotFoundError: a workdir without ``metrics.jsonl`` (checked before drawing).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(runs.items()) if isinstance(runs, Mapping) else list(runs)
    labels = unique_labels([label for label, _ in pairs])
    records = [read_metrics(workdir) for _, workdir in pairs]
    ref = labels.index(reference) if reference in labels else None
    panels = 1 if ref is None or len(labels) < 2 else 2
    fig, axes = plt.subplots(panels, 1, figsize=(7, 4.5 * panels), squeeze=False)
    ax = axes[0, 0]
    for i, (label, recs) in enumerate(zip(labels, records, strict=True)):
        color = f"C{i}"
        train, evals = _series(recs, "loss"), _series(recs, "eval/loss")
        if train:
            ax.plot(*zip(*train, strict=True), color=color, lw=1.2, label=f"{label} train")
        if evals:
            ax.plot(*zip(*evals, strict=True), color=color, ls="--", marker="o", ms=4,
                    label=f"{label} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if panels == 2:
        _difference_panel(axes[1, 0], labels, records, ref, smooth_window)
    out = pathlib.Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _difference_panel(ax, labels: list[str], records: list[list[dict]], ref: int,
                      window: int) -> None:
    """Each run's loss minus the reference run's: smoothed train (solid), eval (markers)."""
    ref_train, ref_eval = _series(records[ref], "loss"), _series(records[ref], "eval/loss")
    for i, (label, recs) in enumerate(zip(labels, records, strict=True)):
        if i == ref:
            continue
        color = f"C{i}"
        train = difference_to(ref_train, _series(recs, "loss"))
        evals = difference_to(ref_eval, _series(recs, "eval/loss"))
        if train:
            steps, diffs = zip(*train, strict=True)
            ax.plot(steps, smooth(diffs, window), color=color, lw=1.2,
                    label=f"{label} train (moving average of {window})")
        if evals:
            ax.plot(*zip(*evals, strict=True), color=color, ls="none", marker="o", ms=4,
                    label=f"{label} eval")
    ax.axhline(0.0, color=f"C{ref}", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss − {labels[ref]} loss (nats)")
    ax.set_title(f"difference to {labels[ref]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
