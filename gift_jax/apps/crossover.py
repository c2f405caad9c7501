"""When the quantized reduction pays: the estimated step of the fp8 reduction against XLA's own
bf16 and fp32 steps, by tokens per device and by the network between GPU nodes.

A step's communication is fixed by the model (its gradient bytes) while its compute grows
with the tokens each device processes, and the network sets what the bytes cost. So the
ratio of two steps' times is a curve in tokens per device, one curve per link speed:

1. compile (never run) each model's step for a GPU cluster at several global batch sizes:
   XLA's own step (bf16 compute, its bf16 gradient all-reduce), and the trainer's step with
   an fp32 and an fp8 reduction inside the backward (bf16 compute; the fp32 one is the GIFT
   paper's baseline), reduced hierarchically where a node holds several replicas
   (``scripts/compile_pod.py --gpu ... --hlo DIR``: the scheduled HLO of each);
2. replay each scheduled HLO (:func:`gift_jax.apps.pod_estimate.replay`) on the same GPUs
   joined by networks of 100, 200, 400 and 800 Gb/s per GPU: a link only changes the
   collectives' times, not the program;
3. plot ``fp8 / xla_bf16`` and ``fp8 / fp32`` against tokens per device, with the TPU rows
   of ``docs/pod`` (v5p ICI, v5e across slices) as points of comparison.

Below 1 the fp8 step is the shorter one. ``scripts/when_it_pays.py`` runs the three steps.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterable, Sequence

from gift_jax.apps import pod_estimate

#: The networks the curves are drawn for (keys of :data:`gift_jax.utils.gpu.LINKS`).
LINK_SPEEDS = ("ib100", "ib200", "ib400", "ib800")
#: The steps compared: XLA's own bf16 step, and the fp32 and fp8 reductions inside the
#: backward.
MODES = ("xla_bf16", "fp32", "fp8")


@dataclasses.dataclass(frozen=True)
class Point:
    """One compiled step: a model at a global batch, in one mode, and its scheduled HLO."""

    model: str  # the config's name
    mode: str  # one of MODES
    batch: int  # sequences per step
    tokens_per_device: int
    hlo: pathlib.Path


def hlo_name(model: str, batch: int) -> str:
    """The folder of one (model, global batch)'s compiled HLO texts.

    Args:
      model: the config's name.
      batch: sequences per step.

    Returns:
      ``MODEL_bBATCH``.
    """
    return f"{model}_b{batch}"


def find_points(hlo_root: pathlib.Path, seq_len: dict[str, int], devices: int) -> list[Point]:
    """The compiled steps under ``hlo_root`` (``MODEL_bBATCH/MODE_*.hlo.txt``, as
    ``compile_pod.py --hlo`` writes them).

    Args:
      hlo_root: the folder holding one folder per (model, batch).
      seq_len: tokens per sequence of each model.
      devices: the GPUs each step was compiled for.

    Returns:
      One :class:`Point` per HLO file of a mode in :data:`MODES` (the ordinary step, not a
      refresh variant).
    """
    points = []
    for folder in sorted(p for p in hlo_root.iterdir() if p.is_dir()):
        m = re.fullmatch(r"(?P<model>.+)_b(?P<batch>\d+)", folder.name)
        if not m or m.group("model") not in seq_len:
            continue
        model, batch = m.group("model"), int(m.group("batch"))
        for hlo in sorted(folder.glob("*_ordinary_*.hlo.txt")):
            mode = next((x for x in sorted(MODES, key=len, reverse=True)
                         if hlo.name.startswith(x + "_")), None)
            if mode is not None:
                points.append(Point(model, mode, batch, batch * seq_len[model] // devices, hlo))
    return points


def step_seconds(points: Iterable[Point], cluster: pod_estimate.GpuCluster
                 ) -> dict[tuple[str, int, str], float]:
    """Each point's estimated step time on ``cluster``.

    Args:
      points: the compiled steps.
      cluster: the GPUs and the network to replay them on.

    Returns:
      ``{(model, tokens per device, mode): seconds}``.
    """
    return {(p.model, p.tokens_per_device, p.mode):
            pod_estimate.replay(p.hlo.read_text(), 0.0, cluster, None).step_s for p in points}


def ratios(steps: dict[tuple[str, int, str], float], baseline: str
           ) -> dict[str, list[tuple[int, float]]]:
    """``fp8 / baseline`` per model, sorted by tokens per device.

    Args:
      steps: :func:`step_seconds`' result.
      baseline: ``xla_bf16`` or ``fp32``.

    Returns:
      ``{model: [(tokens per device, ratio), ...]}`` where both steps were compiled.
    """
    out: dict[str, list[tuple[int, float]]] = {}
    for (model, tokens, mode), seconds in steps.items():
        base = steps.get((model, tokens, baseline))
        if mode == "fp8" and base:
            out.setdefault(model, []).append((tokens, seconds / base))
    return {m: sorted(v) for m, v in out.items()}


@dataclasses.dataclass(frozen=True)
class TpuPoint:
    """A TPU row pair of ``docs/pod``: the fp8 step in the backward against XLA's bf16."""

    label: str  # e.g. "Llama-7B v5p-128 (ICI)"
    tokens_per_device: int
    ratio: float


def tpu_points(pod_dir: pathlib.Path, tokens: dict[str, int]) -> list[TpuPoint]:
    """The TPU comparison points: in each ``docs/pod`` table of a TPU topology, the shortest
    estimated fp8 step reduced inside the backward over XLA's own bf16 step with the same
    flags.

    Args:
      pod_dir: ``docs/pod``.
      tokens: tokens per step of each table's file stem (``llama_7b_v5p-128`` →
        global batch × sequence length); tables not named here are skipped.

    Returns:
      One :class:`TpuPoint` per table with both rows.
    """
    out = []
    for path in sorted(pod_dir.glob("*.json")):
        if path.stem not in tokens:
            continue
        rows = [r for r in json.loads(path.read_text()) if r.get("compiler") == "TPU"
                and r.get("variant") == "ordinary" and r.get("step_ms")]
        pairs = []
        for r in rows:
            if r["mode"] != "fp8" or "in backward" not in r["reduction"]:
                continue
            base = next((b for b in rows if b["mode"] == "xla_bf16"
                         and b["flags"] == r["flags"] and b["mesh"] == r["mesh"]), None)
            if base:
                pairs.append(r["step_ms"] / base["step_ms"])
        if pairs:
            topology = rows[0]["topology"]
            link = "DCN" if " x " in topology else "ICI"
            size = path.stem.split("_")[1].upper()  # llama_7b_v5p-128 -> 7B
            out.append(TpuPoint(f"Llama-{size} {topology} ({link})",
                                tokens[path.stem] // _chips(topology), min(pairs)))
    return out


def _chips(topology: str) -> int:
    """Chips of a Cloud TPU topology label (``v5p-128``: 64; ``2 x v5e-256``: 512)."""
    from gift_jax.utils.tpu import parse_topology

    slices, _, name = topology.rpartition(" x ")
    return parse_topology(name, int(slices) if slices else 1).chips


def plot(curves: dict[str, dict[str, dict[str, list[tuple[int, float]]]]],
         tpu: Sequence[TpuPoint], path: pathlib.Path, title: str) -> None:
    """One panel per model: ``fp8 / baseline`` against tokens per device, a line per link
    (solid: against XLA's bf16 step, dashed: against the fp32 reduction's), TPU points beside.

    Args:
      curves: ``{link: {baseline: {model: [(tokens, ratio), ...]}}}``.
      tpu: the TPU points (drawn in every panel).
      path: the PNG to write.
      title: the figure's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for by_base in curves.values() for by_model in by_base.values()
                     for m in by_model})
    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.6), squeeze=False)
    colors = dict(zip(LINK_SPEEDS, ("#b2182b", "#ef8a62", "#67a9cf", "#2166ac"), strict=True))
    for ax, model in zip(axes[0], models, strict=True):
        for link, by_base in curves.items():
            for baseline, style, name in (("xla_bf16", "-", "XLA's bf16"),
                                          ("fp32", "--", "fp32")):
                points = by_base.get(baseline, {}).get(model, [])
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, marker="o", ms=3.5, color=colors.get(link, "k"),
                            label=f"{link[2:]} Gb/s, vs {name}")
        for p in tpu:
            ax.scatter([p.tokens_per_device], [p.ratio], marker="s", s=28, color="#555555",
                       zorder=3)
            ax.annotate(p.label, (p.tokens_per_device, p.ratio), fontsize=6.5,
                        xytext=(4, 3), textcoords="offset points", color="#555555")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device per step")
        ax.set_ylabel("estimated step: fp8 in the backward / baseline")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
