"""Loss curves of several runs in one PNG (used by ``scripts/plot.py`` and the demo)."""

from __future__ import annotations

import json
import os
import pathlib


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``metrics.jsonl``."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {workdir} a training workdir?)")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_runs(workdirs: dict[str, str | os.PathLike], out_png: str | os.PathLike,
              title: str = "") -> pathlib.Path:
    """Train (solid) and eval (markers) loss against step, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, workdir) in enumerate(workdirs.items()):
        records = read_metrics(workdir)
        color = f"C{i}"
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval/loss"]) for r in records if "eval/loss" in r]
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
    out = pathlib.Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
