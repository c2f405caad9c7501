"""The precision frontier: which wire format and which transport to use, measured in training.

Every cell of the grid is one way of communicating the gradient — a wire format
(``comm.codec``), a transport around the all-reduce (Euclidean, error feedback, GIFT with a
fixed or adaptive refresh, GIFT + error feedback, PLUMAGE's projected coordinates), an
accumulation (the library's fp32 sums or the emulated FP8 ring, ``comm.fp8_accumulation``)
and an optimizer (AdamW or Muon). Each cell trains the same model with the library's one
training loop (:class:`gift_jax.training.Trainer`, data-parallel over the host's devices)
from the same seeds: seed ``s`` fixes the initialisation, the data order and the sampling keys,
and every run is evaluated on the same validation windows. ``scripts/frontier.py`` is the
thin command line.

What is reported per cell (:func:`summarize`):

* **wire bytes per step per device**, from the compiled HLO of the train step
  (``Trainer.wire``, :func:`gift_jax.comm.wire.wire_bytes`), averaged over ordinary and
  refresh steps by the run's actual refreshes (:func:`wire_per_step`);
* the **paired loss gap** ``d_s = L_cell(s) − L_ref(s)`` of the final eval loss to the same
  seed's fp32 run of the same optimizer (for PLUMAGE: PLUMAGE's fp32 run, so the gap is the
  wire format's, not the projection's), over seeds ``s = 1..n``:

  ``d̄ = (1/n) Σ d_s``,  ``sd = sqrt(Σ (d_s − d̄)² / (n − 1))``,
  95 % interval ``d̄ ± t_{0.975, n−1} · sd / √n``.

  The cell is *distinguishable from seed noise* when that interval excludes 0. Pairing
  removes the seed-to-seed spread of the loss itself (the fp32 runs' spread, reported as
  ``ref_sd``), which is larger than most wire effects at this scale.

:func:`paired_difference` compares two cells the same way, and :func:`transport_comparisons`
every transport pair of :data:`COMPARISONS` at one codec (e.g. GIFT − Euclidean: negative
means GIFT's runs end lower on the same seeds).
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from gift_jax.comm.codecs import CODEC_NAMES, get_codec, low_precision_codecs
from gift_jax.training.config import complete_config, load_config, set_fields
from gift_jax.training.optimizers import OPTIMIZER_NAMES

__all__ = [
    "ACCUMULATIONS",
    "CODECS",
    "COMPARISONS",
    "OPTIMIZERS",
    "SLICES",
    "TRANSPORTS",
    "Cell",
    "FrontierSettings",
    "cross_product",
    "format_comparisons",
    "format_table",
    "load_records",
    "paired_difference",
    "plot_frontier",
    "record_path",
    "run_cell",
    "run_grid",
    "slice_cells",
    "summarize",
    "t_interval",
    "trainer_config",
    "transport_comparisons",
    "wire_per_step",
]

#: Every codec of the library (:data:`gift_jax.comm.codecs.CODEC_NAMES`).
CODECS = CODEC_NAMES
#: How the gradient travels: ``euclidean`` (the codec on the raw gradient), ``ef`` (error
#: feedback), ``gift`` (whitened, refresh every K), ``gift_adaptive`` (refresh when stale),
#: ``gift_routed`` (per-layer routing in the optimizer's frame), ``gift_ef`` (GIFT + error
#: feedback), ``plumage`` (PLUMAGE's projected coordinates, Euclidean).
TRANSPORTS = ("euclidean", "ef", "gift", "gift_adaptive", "gift_routed", "gift_ef", "plumage")
#: ``fp32``: the library's fp32 sums; ``fp8``: the emulated FP8 ring (partial sums rounded to
#: the wire format, one global scale), the artifact's NCCL setting.
ACCUMULATIONS = ("fp32", "fp8")
#: Every optimizer of the registry (:mod:`gift_jax.training.optimizers`).
OPTIMIZERS = OPTIMIZER_NAMES


@dataclasses.dataclass(frozen=True, order=True)
class Cell:
    """One point of the grid (a way of communicating the gradient)."""

    codec: str = "fp32"
    transport: str = "euclidean"
    accumulate: str = "fp32"
    optimizer: str = "adamw"

    def __post_init__(self):
        for name, value, allowed in (("codec", self.codec, CODECS),
                                     ("transport", self.transport, TRANSPORTS),
                                     ("accumulate", self.accumulate, ACCUMULATIONS),
                                     ("optimizer", self.optimizer, OPTIMIZERS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    @property
    def name(self) -> str:
        """``codec/transport/acc-accumulate/optimizer``: the cell's file-name stem."""
        return f"{self.codec}/{self.transport}/acc-{self.accumulate}/{self.optimizer}"

    @property
    def reference(self) -> Cell:
        """The cell's fp32 baseline: fp32 wire, fp32 sums, the same optimizer, and PLUMAGE's
        projection when the cell is PLUMAGE (so the gap is the wire format's alone)."""
        transport = "plumage" if self.transport == "plumage" else "euclidean"
        return Cell("fp32", transport, "fp32", self.optimizer)

    @property
    def is_reference(self) -> bool:
        return self == self.reference

    @classmethod
    def parse(cls, name: str) -> Cell:
        """The cell of a :attr:`name`.

        Args:
          name: ``codec/transport/acc-<accumulate>/optimizer``, e.g.
            ``"fp8_e4m3/gift/acc-fp32/adamw"`` (a record's ``"cell"``).

        Returns:
          The :class:`Cell`.

        Raises:
          ValueError: a name without exactly four ``/``-separated parts, or a part outside
            its allowed values (:data:`CODECS`, :data:`TRANSPORTS`, ...).
        """
        codec, transport, acc, opt = name.split("/")
        return cls(codec, transport, acc.removeprefix("acc-"), opt)


def meaningful(cell: Cell) -> bool:
    """Whether a cell is a distinct, runnable setting: error feedback acts only on a
    low-precision codec (the trainer switches it off for fp32), and the FP8 ring emulation
    takes only the per-tensor FP8 codecs (the all-reduce refuses the others).

    Args:
      cell: the grid point.

    Returns:
      ``False`` for ``ef``/``gift_ef`` on an exact codec (fp32) and for FP8 ring accumulation
      with a codec that does not support it (``Codec.supports_ring_accumulation``); else
      ``True``.
    """
    codec = get_codec(cell.codec)
    if cell.accumulate == "fp8" and not codec.supports_ring_accumulation:
        return False
    return not (cell.transport in ("ef", "gift_ef") and codec.is_exact)


def cross_product(codecs: Iterable[str] = CODECS, transports: Iterable[str] = TRANSPORTS,
                  accumulations: Iterable[str] = ACCUMULATIONS,
                  optimizers: Iterable[str] = OPTIMIZERS) -> list[Cell]:
    """Every meaningful cell of the product (plus each cell's reference), sorted.

    Args:
      codecs: wire formats, from :data:`CODECS`.
      transports: from :data:`TRANSPORTS`.
      accumulations: from :data:`ACCUMULATIONS`.
      optimizers: from :data:`OPTIMIZERS`.

    Returns:
      The :func:`meaningful` cells and their :attr:`Cell.reference` cells, without repeats,
      sorted by (codec, transport, accumulate, optimizer) names.

    Raises:
      ValueError: a value outside its allowed tuple (raised by :class:`Cell`).
    """
    cells = {Cell(*c) for c in itertools.product(codecs, transports, accumulations, optimizers)}
    cells = {c for c in cells if meaningful(c)}
    return sorted(cells | {c.reference for c in cells})


#: The slices of the documented run (docs/frontier_results.md): what two CPU cores afford.
SLICES: dict[str, Callable[[], list[Cell]]] = {
    # every codec Euclidean, the low-precision ones also with GIFT (fixed K); AdamW, fp32 sums
    "primary": lambda: (cross_product(CODECS, ("euclidean",), ("fp32",), ("adamw",))
                        + cross_product(low_precision_codecs(), ("gift",), ("fp32",), ("adamw",))),
    # the harsh wires: FP8 ring accumulation (per-tensor FP8 only) and 4-bit NVFP4, with every
    # transport that could repair them
    "harsh": lambda: (cross_product(("fp8_e4m3",), ("euclidean", "gift", "gift_adaptive", "ef",
                                                    "gift_ef"), ("fp8",), ("adamw",))
                      + cross_product(("nvfp4",), ("gift_adaptive", "ef", "gift_ef"), ("fp32",),
                                      ("adamw",))),
    # Muon (the GIFT paper's optimizer) on the 4-bit wire
    "muon": lambda: cross_product(("nvfp4",), ("euclidean", "gift"), ("fp32",), ("muon",)),
    # Muon on the FP8 ring (not in the documented run: Muon's CPU steps are 2.5x AdamW's)
    "muon_ring": lambda: cross_product(("fp8_e4m3",), ("euclidean", "gift"), ("fp8",),
                                       ("muon",)),
    # PLUMAGE's projected coordinates over a few codecs
    "plumage": lambda: cross_product(("fp8_e4m3", "nvfp4"), ("plumage",), ("fp32",),
                                     ("adamw",)),
    # GIFT's per-layer routing (route_frame='optimizer') on the harsh wires
    "routed": lambda: (cross_product(("nvfp4",), ("gift_routed",), ("fp32",), ("adamw",))
                       + cross_product(("fp8_e4m3",), ("gift_routed",), ("fp8",), ("adamw",))),
}


def slice_cells(names: Sequence[str]) -> list[Cell]:
    """The cells of the named slices (``all``: every slice), references first, no repeats.

    Args:
      names: keys of :data:`SLICES`; ``"all"`` among them selects every slice.

    Returns:
      The cells: the references (:attr:`Cell.is_reference`) first, then the others, each
      group in the order the slices list them.

    Raises:
      ValueError: a name that is neither a slice nor ``"all"``.
    """
    if "all" in names:
        names = list(SLICES)
    unknown = [n for n in names if n not in SLICES]
    if unknown:
        raise ValueError(f"unknown slice(s) {unknown}; allowed: {sorted(SLICES)} or 'all'")
    cells: list[Cell] = []
    for n in names:
        for c in SLICES[n]():
            if c not in cells:
                cells.append(c)
    return sorted(cells, key=lambda c: (not c.is_reference, cells.index(c)))


# ------------------------------------------------------------------------------- one run


@dataclasses.dataclass(frozen=True)
class FrontierSettings:
    """Settings shared by every cell and seed (over the ``config`` file, e.g. ``tiny``).

    Attributes:
      config: the model config (``configs/<config>.py``); its model, optimizer and batch.
      steps: optimizer steps (the cosine schedule decays over them).
      eval_every: steps between validation evaluations (and the last step).
      eval_batches: validation batches (of the config's global batch) per evaluation, the
        same windows for every seed and cell.
      refresh_every: GIFT's K (fixed refresh).
      min_refresh_every, max_refresh_every: the adaptive refresh's interval bounds.
      model: ``model.*`` overrides (the smoke test's tiny model).
      train: ``train.*`` / ``optimizer.*`` overrides as ``(dotted field, value)`` pairs.
    """

    config: str = "tiny"
    steps: int = 200
    eval_every: int = 50
    eval_batches: int = 8
    refresh_every: int = 50
    min_refresh_every: int = 10
    max_refresh_every: int = 200
    model: tuple[tuple[str, Any], ...] = ()
    train: tuple[tuple[str, Any], ...] = ()

    def asdict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def parse_overrides(texts: Sequence[str]) -> tuple[tuple[tuple[str, Any], ...],
                                                   tuple[tuple[str, Any], ...]]:
    """``--set FIELD=VALUE`` flags as :class:`FrontierSettings`' ``model`` and ``train``
    overrides (values read as Python literals where they parse, else kept as text).

    Args:
      texts: e.g. ``["train.global_batch_size=64", "model.num_layers=2"]``.

    Returns:
      ``(model, train)``: ``model.*`` fields without their prefix, and the rest.

    Raises:
      ValueError: one line, for a flag that is not ``FIELD=VALUE`` of a ``model.*``,
        ``train.*`` or ``optimizer.*`` field.
    """
    model, train = [], []
    for text in texts:
        field, sep, value = text.partition("=")
        if not sep or not field.startswith(("model.", "train.", "optimizer.")):
            raise ValueError(f"--set {text!r}: expected FIELD=VALUE with a model.*, train.* or "
                             "optimizer.* field")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        if field.startswith("model."):
            model.append((field.removeprefix("model."), value))
        else:
            train.append((field, value))
    return tuple(model), tuple(train)


def trainer_config(cell: Cell, s: FrontierSettings, seed: int,
                   base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The trainer config of one run: ``base`` (the ``s.config`` file) with the settings,
    the cell's communication fields, and ``seed`` as the init, data-order and sampling seed.

    Transport → fields: ``ef``/``gift_ef`` set ``comm.error_feedback``; ``gift*`` set
    ``comm.method='gift'`` with ``gift.refresh`` (``fixed`` every ``refresh_every`` steps, or
    ``adaptive`` within ``[min_refresh_every, max_refresh_every]``) and ``gift.route_frame``
    (``off``: always whiten, the paper's GIFT; ``optimizer`` for ``gift_routed``);
    ``plumage`` sets ``comm.method='plumage'`` with the config's ``plumage.*``.

    Args:
      cell: the grid point.
      s: the settings shared by every cell; its ``train`` overrides are applied last (they win
        over every other field).
      seed: ``train.seed`` and ``data.shuffle_seed``.
      base: the loaded ``configs/<s.config>.py`` (completed with the trainer's defaults; not
        modified).

    Returns:
      A new config: no checkpoints, diagnostics or output files, a log record every
      ``min(10, s.steps)`` steps, and ``train.seq_len`` following a ``model.max_seq_len``
      override.
    """
    config = complete_config(base)
    t = cell.transport
    fields = {
        **{f"model.{k}": v for k, v in s.model},
        "optimizer.name": cell.optimizer,
        "train.seed": seed, "data.shuffle_seed": seed, "train.num_steps": s.steps,
        "train.log_every": min(10, s.steps), "train.eval_every": s.eval_every,
        "train.eval_batches": s.eval_batches, "train.checkpoint_every": 0,
        "train.diagnostics_every": 0, "train.workdir": "",
        "comm.codec": cell.codec,
        "comm.method": "gift" if t.startswith("gift") else ("plumage" if t == "plumage"
                                                            else "none"),
        "comm.error_feedback": t in ("ef", "gift_ef"),
        "comm.fp8_accumulation": cell.accumulate == "fp8",
        "gift.refresh": "adaptive" if t == "gift_adaptive" else "fixed",
        "gift.refresh_every": s.refresh_every,
        "gift.max_refresh_every": s.max_refresh_every,
        "gift.min_refresh_every": s.min_refresh_every,
        "gift.route_frame": "optimizer" if t == "gift_routed" else "off",
        **dict(s.train),
    }
    if "model.max_seq_len" in fields:
        fields.setdefault("train.seq_len", fields["model.max_seq_len"])
    return set_fields(config, fields)


def _eval_batches(source):
    """The trainer's batch function over ``source``: training batches in the seed's order,
    validation windows in corpus order (the same for every seed and cell)."""
    from gift_jax.data import batch_iterator

    def batches(split, global_batch, seq_len, **kwargs):
        if split == "train":
            return batch_iterator(source, split, global_batch, seq_len, **kwargs)
        return batch_iterator(source, split, global_batch, seq_len, loop=False)

    return batches


def run_cell(cell: Cell, s: FrontierSettings, seed: int, source, *,
             base_config: ml_collections.ConfigDict,
             devices: Sequence[jax.Device] | None = None) -> dict:
    """Trains one cell for one seed with the library's :class:`~gift_jax.training.Trainer`
    (data-parallel over ``devices``, default all) and returns its record (JSON-able):
    ``cell``, ``seed``, the eval curve, the final eval loss, wire bytes per step per device
    (``wire_bytes``: :func:`wire_per_step`; ``wire_bytes_by_variant``), the fp32 ring
    reference, the number of refresh steps, skipped steps and seconds.

    Args:
      cell: the grid point.
      s: the shared settings.
      seed: the init, data-order and sampling seed.
      source: the token source (:func:`gift_jax.data.get_source`): training batches in the
        seed's order, validation windows in corpus order.
      base_config: the loaded ``configs/<s.config>.py`` (:func:`trainer_config`'s ``base``).
      devices: the data-parallel devices; ``None``: all of the host's.

    Returns:
      The record: ``cell``, ``seed``, ``eval_steps``, ``eval_loss`` (every ``s.eval_every``
      steps and at the last step), ``final_eval``, ``wire_bytes``, ``wire_bytes_by_variant``,
      ``wire_fp32_reference``, ``refreshes``, ``skipped_steps``, ``devices``, ``seconds``
      (compile + train + eval) and ``settings`` (``s.asdict()``).

    Raises:
      FloatingPointError: a non-finite final eval loss.
    """
    from gift_jax.training.loop import Trainer

    config = trainer_config(cell, s, seed, base_config)
    trainer = Trainer(config, batches=_eval_batches(source), eval_split="validation",
                      devices=devices)
    try:
        trainer.run()
        if trainer.eval_loss is None or trainer.step % s.eval_every:
            trainer.evaluate()
        summary = trainer.summary()
    finally:
        trainer.close()
    evals = [r for r in trainer.history if "eval/loss" in r]
    final = evals[-1]["eval/loss"]
    if not math.isfinite(final):
        raise FloatingPointError(f"{cell.name} seed {seed}: non-finite final eval loss")
    rec = {
        "cell": cell.name, "seed": seed,
        "eval_steps": [r["step"] for r in evals], "eval_loss": [r["eval/loss"] for r in evals],
        "final_eval": final,
        "wire_bytes_by_variant": summary["wire_bytes_per_step"],
        "wire_fp32_reference": summary["wire_fp32_reference"],
        "refreshes": sum(int(r.get("refreshes", 0)) for r in trainer.history),
        "skipped_steps": summary["skipped_steps"], "devices": summary["devices"],
        "seconds": summary["compile_s"] + summary["train_s"] + summary["eval_s"],
        "settings": s.asdict(),
    }
    rec["wire_bytes"] = wire_per_step(rec)
    return rec


def wire_per_step(record: dict) -> float:
    """Mean wire bytes per step per device of a run from its *actual* refreshes:
    ``ordinary + (refreshes / steps) · (refresh − ordinary)`` with the two variants' HLO bytes
    (the trainer's summary weights them by the nominal ``1/K``, which an adaptive schedule
    does not keep).

    Args:
      record: a :func:`run_cell` record (``wire_bytes_by_variant``, ``refreshes`` and
        ``settings["steps"]`` are read).

    Returns:
      Bytes per step per device; the ordinary variant's bytes when the run has no refresh
      variant.
    """
    by = record["wire_bytes_by_variant"]
    ordinary = by["ordinary"]
    if "refresh" not in by:
        return float(ordinary)
    steps = record["settings"]["steps"]
    return float(ordinary + record["refreshes"] / steps * (by["refresh"] - ordinary))


def record_path(out: str | os.PathLike, cell: Cell, seed: int) -> pathlib.Path:
    """``out/records/<codec>/<transport>/acc-<acc>/<optimizer>/seed<seed>.json``.

    Args:
      out: the grid's output folder.
      cell: the grid point.
      seed: the run's seed.

    Returns:
      The record's path (nothing is created).
    """
    return pathlib.Path(out, "records", cell.name, f"seed{seed}.json")


def run_grid(cells: Sequence[Cell], seeds: Sequence[int], s: FrontierSettings, out: str, *,
             source=None, base_config: ml_collections.ConfigDict | None = None,
             configs_dir: str | os.PathLike | None = None,
             log: Callable[[str], None] | None = print) -> list[dict]:
    """Every cell × seed (references first), each written to :func:`record_path` as soon as
    it finishes; a record already there with the same settings and device count is reused
    (the grid resumes where it stopped). Returns the records.

    Args:
      cells: the grid points; repeats are dropped, the references (:attr:`Cell.is_reference`)
        run first, the others in the given order.
      seeds: the seeds every cell runs with.
      s: the shared settings.
      out: the output folder (records under ``out/records``, written atomically).
      source: the token source; ``None``: ``get_source("shakespeare")``.
      base_config: the base config; ``None``: ``load_config(s.config, configs_dir)``.
      configs_dir: the folder of the config files (read only without ``base_config``).
      log: called with one progress line per run it trains (not for reused records);
        ``None``: silent.

    Returns:
      The records (:func:`run_cell`), cell by cell in run order, each cell's seeds in the
      order of ``seeds``, reused ones included.
    """
    if source is None:
        from gift_jax.data import get_source

        source = get_source("shakespeare")
    if base_config is None:
        base_config = load_config(s.config, configs_dir)
    cells = list(dict.fromkeys(cells))
    cells = sorted(cells, key=lambda c: (not c.is_reference, cells.index(c)))
    records = []
    for i, cell in enumerate(cells):
        for seed in seeds:
            path = record_path(out, cell, seed)
            if path.is_file():
                rec = json.loads(path.read_text())
                if (rec.get("settings") == s.asdict()
                        and rec.get("devices") == jax.device_count()):
                    records.append(rec)
                    continue
            rec = run_cell(cell, s, seed, source, base_config=base_config)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec, indent=1))
            tmp.replace(path)
            records.append(rec)
            if log is not None:
                log(f"[{i + 1}/{len(cells)}] {cell.name} seed {seed}: eval "
                    f"{rec['final_eval']:.4f}, {rec['wire_bytes'] / 1e6:.3f} MB/step, "
                    f"{rec['refreshes']} refreshes, {rec['seconds']:.0f} s")
    return records


def load_records(out: str | os.PathLike, settings: FrontierSettings | None = None) -> list[dict]:
    """Every record under ``out/records`` (with ``settings``: only those run with them).

    Args:
      out: the grid's output folder.
      settings: keep only the records whose ``settings`` equal ``settings.asdict()``;
        ``None``: every record.

    Returns:
      The records, in sorted path order.
    """
    paths = sorted(pathlib.Path(out, "records").rglob("seed*.json"))
    recs = [json.loads(p.read_text()) for p in paths]
    if settings is not None:
        recs = [r for r in recs if r.get("settings") == settings.asdict()]
    return recs


# ------------------------------------------------------------------------------- statistics


def t_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float]:
    """``(mean, sd, lo, hi)`` of paired differences: ``mean ± t_{(1+level)/2, n−1}·sd/√n``
    (``sd`` with ``n − 1``); a single difference gives ``(mean, nan, nan, nan)`` (no interval).

    Args:
      diffs: the paired differences ``d_s`` (at least one).
      level: the interval's confidence level.

    Returns:
      ``(mean, sd, lo, hi)`` as floats; with a single difference ``sd``, ``lo`` and ``hi``
      are NaN.
    """
    from scipy import stats

    d = np.asarray(diffs, dtype=np.float64)
    mean = float(d.mean())
    if d.size < 2:
        return mean, float("nan"), float("nan"), float("nan")
    sd = float(d.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, d.size - 1)) * sd / math.sqrt(d.size)
    return mean, sd, mean - half, mean + half


def _by_seed(records: Sequence[dict], name: str) -> dict[int, dict]:
    return {r["seed"]: r for r in records if r["cell"] == name}


def paired_difference(records: Sequence[dict], a: Cell | str, b: Cell | str,
                      level: float = 0.95) -> dict:
    """``L_a(s) − L_b(s)`` over the seeds both have: ``n``, ``mean``, ``sd``, ``lo``, ``hi``,
    ``distinguishable`` (the interval excludes 0) and ``per_seed``.

    Args:
      records: :func:`run_cell` records (``cell``, ``seed`` and ``final_eval`` are read).
      a, b: the two cells, as :class:`Cell` or :attr:`Cell.name`.
      level: the interval's confidence level (:func:`t_interval`).

    Returns:
      The dict above, ``per_seed`` mapping seed to ``L_a − L_b``; ``{"n": 0}`` when no seed
      has both cells. With one seed ``sd``, ``lo`` and ``hi`` are NaN and ``distinguishable``
      is ``False``.
    """
    a, b = (x.name if isinstance(x, Cell) else x for x in (a, b))
    ra, rb = _by_seed(records, a), _by_seed(records, b)
    seeds = sorted(set(ra) & set(rb))
    d = [ra[k]["final_eval"] - rb[k]["final_eval"] for k in seeds]
    if not d:
        return {"n": 0}
    mean, sd, lo, hi = t_interval(d, level)
    return {"n": len(d), "mean": mean, "sd": sd, "lo": lo, "hi": hi,
            "distinguishable": bool(len(d) > 1 and (lo > 0 or hi < 0)),
            "per_seed": dict(zip(seeds, d, strict=True))}


def summarize(records: Sequence[dict], level: float = 0.95) -> list[dict]:
    """One row per cell: wire bytes per step per device (mean over seeds), its ratio to the
    fp32 ring reference, the final eval loss (mean ± sd), the paired gap to the reference
    cell (:func:`paired_difference`), the reference's own seed spread ``ref_sd`` and the mean
    number of refresh steps. Rows sorted by optimizer, accumulation, transport, then codec.

    Args:
      records: :func:`run_cell` records of any cells and seeds.
      level: the confidence level of the gaps' intervals.

    Returns:
      One dict per cell: ``cell``, the :class:`Cell` fields, ``n`` (seeds), ``wire_bytes``,
      ``wire_ratio``, ``loss``, ``loss_sd`` and ``ref_sd`` (NaN with fewer than two seeds),
      ``refreshes`` and ``gap`` (:func:`paired_difference` to :attr:`Cell.reference`;
      ``{"n": 0}`` when the reference was not run). Sorted by optimizer, accumulation,
      transport (:data:`TRANSPORTS` order), then codec (:data:`CODECS` order); optimizer and
      accumulation sort alphabetically.
    """
    names = sorted({r["cell"] for r in records},
                   key=lambda n: (Cell.parse(n).optimizer, Cell.parse(n).accumulate,
                                  TRANSPORTS.index(Cell.parse(n).transport),
                                  CODECS.index(Cell.parse(n).codec)))
    rows = []
    for name in names:
        cell = Cell.parse(name)
        mine = list(_by_seed(records, name).values())
        losses = np.array([r["final_eval"] for r in mine])
        ref = [r["final_eval"] for r in _by_seed(records, cell.reference.name).values()]
        row = {
            "cell": name, **dataclasses.asdict(cell), "n": len(mine),
            "wire_bytes": float(np.mean([wire_per_step(r) for r in mine])),
            "wire_ratio": float(np.mean([wire_per_step(r) / r["wire_fp32_reference"]
                                         for r in mine])),
            "loss": float(losses.mean()),
            "loss_sd": float(losses.std(ddof=1)) if len(mine) > 1 else float("nan"),
            "ref_sd": float(np.std(ref, ddof=1)) if len(ref) > 1 else float("nan"),
            "refreshes": float(np.mean([r["refreshes"] for r in mine])),
            "gap": paired_difference(records, name, cell.reference.name, level),
        }
        rows.append(row)
    return rows


def _fmt_gap(g: dict) -> tuple[str, str, str]:
    if not g.get("n"):
        return "—", "—", "no reference"
    if g["n"] < 2:
        return f"{g['mean']:+.4f}", "—", "n = 1"
    return (f"{g['mean']:+.4f} ± {g['sd']:.4f}", f"[{g['lo']:+.4f}, {g['hi']:+.4f}]",
            "**yes**" if g["distinguishable"] else "no")


def format_table(rows: Sequence[dict]) -> str:
    """The markdown table of :func:`summarize`'s rows.

    Args:
      rows: :func:`summarize`'s rows.

    Returns:
      The table, without a trailing newline; reference cells show the gap
      ``0 (reference)``.
    """
    lines = [
        "| optimizer | accumulate | transport | codec | wire MB/step/device | × fp32 | "
        "final eval loss | gap to fp32 (mean ± sd) | paired 95% interval | beyond seed noise? "
        "| refreshes | n |",
        "|---|---|---|---|---:|---:|---|---|---|---|---:|---:|",
    ]
    for r in rows:
        mean_sd, ci, sig = _fmt_gap(r["gap"]) if not Cell.parse(r["cell"]).is_reference else (
            "0 (reference)", "—", "—")
        lines.append(
            f"| {r['optimizer']} | {r['accumulate']} | {r['transport']} | {r['codec']} | "
            f"{r['wire_bytes'] / 1e6:.3f} | {r['wire_ratio']:.3f} | "
            f"{r['loss']:.4f} ± {r['loss_sd']:.4f} | {mean_sd} | {ci} | {sig} | "
            f"{r['refreshes']:.0f} | {r['n']} |")
    return "\n".join(lines)


#: Transport pairs compared head to head at one (codec, accumulation, optimizer): ``a − b``.
COMPARISONS = (("gift", "euclidean"), ("gift_adaptive", "gift"), ("gift_routed", "gift"),
               ("ef", "euclidean"), ("gift_ef", "ef"), ("gift_ef", "gift"))


def transport_comparisons(records: Sequence[dict], level: float = 0.95) -> list[dict]:
    """Paired differences ``L_a(s) − L_b(s)`` between transports of :data:`COMPARISONS` at
    the same codec, accumulation and optimizer, wherever both cells were run: negative means
    ``a`` ends lower than ``b`` on the same seeds.

    Args:
      records: :func:`run_cell` records.
      level: the intervals' confidence level.

    Returns:
      One dict per pair found: ``codec``, ``accumulate``, ``optimizer``, ``a``, ``b`` (the
      transports) and :func:`paired_difference`'s keys; ordered by the ``a`` cell's name,
      then by :data:`COMPARISONS`.
    """
    names = {r["cell"] for r in records}
    rows = []
    for name in sorted(names):
        cell = Cell.parse(name)
        for ta, tb in COMPARISONS:
            if cell.transport != ta:
                continue
            other = dataclasses.replace(cell, transport=tb)
            if other.name in names:
                rows.append({"codec": cell.codec, "accumulate": cell.accumulate,
                             "optimizer": cell.optimizer, "a": ta, "b": tb,
                             **paired_difference(records, cell, other, level)})
    return rows


def format_comparisons(rows: Sequence[dict]) -> str:
    """The markdown table of :func:`transport_comparisons`.

    Args:
      rows: :func:`transport_comparisons`'s rows.

    Returns:
      The table, without a trailing newline.
    """
    lines = ["| optimizer | accumulate | codec | a − b | mean ± sd | paired 95% interval | "
             "beyond seed noise? | n |", "|---|---|---|---|---|---|---|---:|"]
    for r in rows:
        mean_sd, ci, sig = _fmt_gap(r)
        lines.append(f"| {r['optimizer']} | {r['accumulate']} | {r['codec']} | "
                     f"{r['a']} − {r['b']} | {mean_sd} | {ci} | {sig} | {r['n']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- plot

_MARKERS = {"euclidean": "o", "ef": "s", "gift": "^", "gift_adaptive": "v", "gift_routed": "P",
            "gift_ef": "D", "plumage": "X"}


def plot_frontier(rows: Sequence[dict], path: str | os.PathLike, title: str = "") -> pathlib.Path:
    """The Pareto plot: x = wire bytes per step per device (log), y = paired loss gap to fp32
    (mean, error bar = the paired 95 % interval), one panel per (optimizer, accumulation),
    marker = transport, colour = codec; filled markers are distinguishable from seed noise.

    Args:
      rows: :func:`summarize`'s rows (cells without a gap to their reference are left out).
      path: the image file (format from its suffix); missing parent folders are created.
      title: the figure's title; empty: none.

    Returns:
      ``path`` as a :class:`pathlib.Path`.
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["optimizer"], r["accumulate"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups) + 1.5, 4.6),
                             squeeze=False, sharey=True, sharex=True, layout="constrained")
    colors = {c: f"C{i}" for i, c in enumerate(CODECS)}
    seen: set = set()
    for ax, (opt, acc) in zip(axes[0], groups, strict=True):
        for r in rows:
            if (r["optimizer"], r["accumulate"]) != (opt, acc) or not r["gap"].get("n"):
                continue
            g = r["gap"]
            has_ci = g["n"] > 1 and math.isfinite(g["lo"])
            yerr = [[g["mean"] - g["lo"]], [g["hi"] - g["mean"]]] if has_ci else None
            fill = colors[r["codec"]] if g.get("distinguishable") else "white"
            seen |= {("codec", r["codec"]), ("transport", r["transport"])}
            # transports at one codec move the same bytes: offset them sideways (2 % a step)
            x = r["wire_bytes"] * 1.02 ** (TRANSPORTS.index(r["transport"]) - 2)
            ax.errorbar([x], [g["mean"]], yerr=yerr, fmt=_MARKERS[r["transport"]],
                        color=colors[r["codec"]], mfc=fill, ms=8, capsize=3)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v / 1e6:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v / 1e6:g}" if round(v / 1e6, 6) in (0.8, 1.5, 2, 3, 4) else ""))
        ax.set(xlabel="wire MB per step per device (HLO; transports offset sideways)",
               title=f"{opt}, {acc} accumulation")
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].set_ylabel("final eval loss − same seed's fp32 (nats)")
    handles = [plt.Line2D([], [], color=colors[c], marker="o", ls="none", label=c)
               for c in CODECS if ("codec", c) in seen]
    handles += [plt.Line2D([], [], color="gray", marker=_MARKERS[t], ls="none", mfc="white",
                           label=t) for t in TRANSPORTS if ("transport", t) in seen]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    if title:
        fig.suptitle(title)
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out
