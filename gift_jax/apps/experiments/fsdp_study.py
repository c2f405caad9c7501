"""Does quantizing the fsdp collectives cost loss? The same runs with XLA's fsdp collectives,
the gradients' reduce-scatter in a codec (``comm.fsdp_codec``) and the weights' gather in one
as well (``comm.fsdp_weight_codec``), paired over seeds against fp32.

Each variant is a :mod:`~gift_jax.apps.experiments.frontier` grid (the same trainer, data,
evaluation and records) on a ``(data, fsdp, tensor)`` mesh, in its own folder
``out/<variant>``; the reference is the fp32 cell with XLA's collectives, and every other
run's final eval loss is compared with it seed by seed (a paired t interval).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from gift_jax.apps.experiments import frontier as F

#: ``{variant: comm fields}``: how the blocks' weights cross ``fsdp``.
VARIANTS: dict[str, dict[str, str]] = {
    "xla": {},
    "grads_fp8": {"comm.fsdp_codec": "fp8_e4m3"},
    "grads_weights_fp8": {"comm.fsdp_codec": "fp8_e4m3", "comm.fsdp_weight_codec": "fp8_e4m3"},
}

#: The data axis's codec in every variant's runs: fp32 (the fsdp codec's effect alone) and
#: fp8 (what a run quantizing everything sends).
CELLS = (F.Cell("fp32", "euclidean", "fp32", "adamw"),
         F.Cell("fp8_e4m3", "euclidean", "fp32", "adamw"))


def variant_settings(s: F.FrontierSettings, mesh: tuple[int, int, int],
                     variant: str) -> F.FrontierSettings:
    """``s`` on ``mesh`` (data, fsdp, tensor) with ``variant``'s fields (they win).

    Args:
      s: the shared settings.
      mesh: the mesh sizes.
      variant: a key of :data:`VARIANTS`.

    Returns:
      The variant's settings.
    """
    sizes = {"mesh.data": mesh[0], "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2]}
    return dataclasses.replace(s, train=(*s.train, *sizes.items(),
                                         *VARIANTS[variant].items()))


def run_study(out: str, seeds: Sequence[int], s: F.FrontierSettings,
              mesh: tuple[int, int, int], variants: Sequence[str] = tuple(VARIANTS), *,
              source=None, base_config=None, configs_dir: str | None = None,
              log: Callable[[str], None] | None = print) -> dict[str, list[dict]]:
    """Every variant's grid of :data:`CELLS` × ``seeds`` (resumable, as
    :func:`~gift_jax.apps.experiments.frontier.run_grid`).

    Args:
      out: the output folder (a grid per variant in ``out/<variant>``).
      seeds: the seeds.
      s: the shared settings (model, steps, evaluation).
      mesh: ``(data, fsdp, tensor)``; ``fsdp`` > 1.
      variants: keys of :data:`VARIANTS`.
      source, base_config, configs_dir: as :func:`~gift_jax.apps.experiments.frontier.
        run_grid`'s.
      log: one progress line per run, or ``None``.

    Returns:
      ``{variant: records}``.
    """
    return {v: F.run_grid(CELLS, seeds, variant_settings(s, mesh, v), str(pathlib.Path(out, v)),
                          source=source, base_config=base_config, configs_dir=configs_dir,
                          log=log) for v in variants}


def load_study(out: str, s: F.FrontierSettings, mesh: tuple[int, int, int],
               variants: Sequence[str] = tuple(VARIANTS)) -> dict[str, list[dict]]:
    """The records :func:`run_study` wrote with these settings (variants without any left
    out).

    Args:
      out, s, mesh, variants: as :func:`run_study`.

    Returns:
      ``{variant: records}``.
    """
    found = {v: F.load_records(pathlib.Path(out, v), variant_settings(s, mesh, v))
             for v in variants}
    return {v: recs for v, recs in found.items() if recs}


def summarize(records: dict[str, list[dict]], level: float = 0.95) -> list[dict]:
    """Each (variant, cell)'s final eval loss and its paired gap to the reference (``xla``'s
    fp32 cell), over the seeds both ran.

    Args:
      records: :func:`run_study`'s result (or records loaded per variant).
      level: the intervals' confidence level.

    Returns:
      Rows: ``variant``, ``cell``, ``eval`` (mean), ``eval_sd``, ``wire_bytes`` (per step per
      device, across ``data``), ``gap``, ``gap_sd``, ``lo``, ``hi``, ``n``.
    """
    reference = {r["seed"]: r["final_eval"] for r in records.get("xla", [])
                 if r["cell"] == CELLS[0].name}
    rows = []
    for variant, recs in records.items():
        for cell in CELLS:
            mine = {r["seed"]: r for r in recs if r["cell"] == cell.name}
            if not mine:
                continue
            evals = np.array([r["final_eval"] for r in mine.values()])
            seeds = sorted(set(mine) & set(reference))
            is_reference = variant == "xla" and cell == CELLS[0]
            gap = (float("nan"),) * 4 if is_reference or not seeds else F.t_interval(
                [mine[k]["final_eval"] - reference[k] for k in seeds], level)
            rows.append({"variant": variant, "cell": cell.name, "eval": float(evals.mean()),
                         "eval_sd": float(evals.std(ddof=1)) if evals.size > 1 else math.nan,
                         "wire_bytes": float(np.mean([r["wire_bytes"] for r in mine.values()])),
                         "gap": gap[0], "gap_sd": gap[1], "lo": gap[2], "hi": gap[3],
                         "n": len(seeds) if not is_reference else len(mine)})
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """:func:`summarize`'s rows as a markdown table.

    Args:
      rows: :func:`summarize`'s rows.

    Returns:
      The table: one row per (variant, data codec), the reference first.
    """
    lines = ["| fsdp collectives | data codec | final eval loss | gap to fp32 (mean ± sd) "
             "| paired 95% interval | beyond seed noise? | n |",
             "|---|---|---|---|---|---|---:|"]
    for r in rows:
        codec = r["cell"].split("/")[0]
        if math.isnan(r["gap"]):
            gap, interval, beyond = "0 (reference)", "—", "—"
        else:
            gap = f"{r['gap']:+.4f} ± {r['gap_sd']:.4f}"
            interval = f"[{r['lo']:+.4f}, {r['hi']:+.4f}]"
            beyond = "**yes**" if r["lo"] > 0 or r["hi"] < 0 else "no"
        lines.append(f"| {r['variant']} | {codec} | {r['eval']:.4f} ± {r['eval_sd']:.4f} | "
                     f"{gap} | {interval} | {beyond} | {r['n']} |")
    return "\n".join(lines)
