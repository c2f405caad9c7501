"""Low-rank optimizer experiments: Adam vs GaLore vs FLORA vs PLUMAGE on the project's Llama.

Two kinds of measurement live here (``scripts/lowrank_compare.py`` and
``scripts/bench_lowrank.py`` are thin wrappers):

* **Training comparison** (single device, a plain ``jax.jit`` training loop): every method
  trains the same model from the same initialisation on the same batches; low-rank methods use
  one rank, one refresh interval, one learning rate and GaLore's ``scale`` — so they hold the
  same optimizer-state memory — and differ only in the projector (``strategy``) and whether
  the moments are realigned when the projection changes. Embeddings, the output head and the
  RMSNorm scales stay dense (plain Adam inside the same transformation).
* **Benchmarks**: optimizer-state bytes from ``jax.eval_shape`` of ``init`` on
  :func:`gift_jax.models.param_shapes` (nothing is allocated), and best-of-N wall times of the
  jitted optimizer update on ordinary and on refresh steps.

Methods (:data:`METHODS`): ``adam`` (full-rank Adam), ``galore`` (top-k SVD projector),
``flora`` (Gaussian projector redrawn at each refresh), ``plumage`` (sampled, unbiased,
moments realigned), ``plumage_norealign`` (the same projector, moments kept as they are),
and ``adam_scaled``: full-rank Adam with the low-rank methods' learning rates (``lr_lowrank``
on dense leaves, ``scale · lr_lowrank`` on the matrices that they project) — the ``k → min
side`` limit of GaLore, which separates the effect of the projection from that of the
learning rates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from gift_jax.lowrank import mask_excluding, plumage, refresh_due
from gift_jax.lowrank.views import resolve_layouts
from gift_jax.models import LlamaConfig, model_config_of, param_shapes
from gift_jax.training.config import complete_config, load_config, set_fields
from gift_jax.training.loop import Trainer
from gift_jax.training.optim import learning_rate_schedule
from gift_jax.training.optimizers import DENSE_PATTERNS
from gift_jax.utils.timing import interleaved_times
from gift_jax.utils.tree_paths import leaf_path, matches

__all__ = [
    "METHODS",
    "CompareSettings",
    "RunResult",
    "dense_mask",
    "format_compare_markdown",
    "load_runs",
    "make_optimizer",
    "optax_galore",
    "plot_curves",
    "projection_table",
    "run_comparison",
    "state_bytes",
    "state_memory_table",
    "summarize",
    "time_updates",
    "train_run",
]

METHODS = ("adam", "adam_scaled", "galore", "flora", "plumage", "plumage_norealign")
#: Full-rank baselines the gap closed is measured against.
BASELINES = ("adam", "adam_scaled")
_STRATEGY = {
    "galore": ("galore", True),
    "flora": ("flora", True),
    "plumage": ("plumage", True),
    "plumage_norealign": ("plumage", False),
}
#: The layers every low-rank method projects (attention and MLP kernels; GaLore's targets).
PROJECTED_PATTERNS = ("*/attn/*_proj", "*/mlp/*_proj")


@dataclasses.dataclass(frozen=True)
class CompareSettings:
    """Settings of the training comparison (every method, every seed).

    Attributes:
      model: ``LlamaConfig`` fields (byte-level vocabulary 256).
      steps: optimizer steps per run.
      batch: sequences per step.
      seq_len: tokens per sequence (the model reads ``seq_len`` and predicts the next tokens).
      rank: projection rank ``k`` of every projected matrix (all low-rank methods).
      refresh_every: projection refresh interval τ (all low-rank methods).
      scale: GaLore's α on the back-projected update (all low-rank methods).
      lr_adam: peak learning rate of full-rank Adam.
      lr_lowrank: peak learning rate of the low-rank methods (GaLore style).
      warmup: linear warmup steps; then cosine decay to ``final_lr_ratio`` × peak.
      final_lr_ratio: end of the cosine as a fraction of the peak.
      b1, b2, eps: Adam hyperparameters (shared by every method).
      clip: global-norm clipping of the gradient before the optimizer; 0 disables.
      eval_every: steps between validation evaluations (and at the last step).
      eval_batches: validation batches per evaluation (the same windows every time).
      eval_batch: sequences per validation batch.
      data: ``gift_jax.data.get_source`` spec.
    """

    model: tuple[tuple[str, Any], ...] = (
        ("vocab_size", 256),
        ("d_model", 128),
        ("num_layers", 2),
        ("num_heads", 4),
        ("d_ff", 344),
        ("max_seq_len", 64),
    )
    steps: int = 300
    batch: int = 8
    seq_len: int = 64
    rank: int = 32
    refresh_every: int = 50
    scale: float = 0.25
    lr_adam: float = 1.5e-3
    lr_lowrank: float = 1e-2
    warmup: int = 30
    final_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    eval_batch: int = 16
    data: str = "shakespeare"

    @property
    def model_config(self) -> LlamaConfig:
        return LlamaConfig.from_mapping(dict(self.model))

    def replace(self, **kw) -> CompareSettings:
        """A copy with the given fields replaced (``dataclasses.replace``).

        Args:
          **kw: new field values; ``model`` may be a dict of ``LlamaConfig`` fields, stored as
            its sorted ``(name, value)`` pairs (the settings stay hashable).

        Returns:
          The new :class:`CompareSettings`.
        """
        if "model" in kw and isinstance(kw["model"], dict):
            kw["model"] = tuple(sorted(kw["model"].items()))
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------- optimizers


def dense_mask() -> Callable[[Any], Any]:
    """Projection mask: every ≥2-D leaf except the embedding and the output head (the
    trainer's :data:`~gift_jax.training.optimizers.DENSE_PATTERNS`)."""
    return mask_excluding(*DENSE_PATTERNS)


def projection_table(params: Any, rank: int, mask: Any = None) -> list[dict]:
    """Which leaves a rank-``rank`` low-rank method projects, and how.

    Args:
      params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``, e.g.
        :func:`gift_jax.models.param_shapes`).
      rank: the projection rank ``k`` of every leaf.
      mask: which leaves may be projected: a pytree of bools like ``params`` or a callable
        returning one; ``None``: :func:`dense_mask`.

    Returns:
      One row per leaf: ``path``, ``shape``, ``projected`` (bool), and for projected
      leaves ``side`` (``reduction`` = input axis of the Flax kernel), ``m`` (projected side),
      ``n`` and ``rank``; dense leaves get ``reason`` (``1-D``, ``masked``,
      ``rank >= min side``).
    """
    mask = dense_mask() if mask is None else mask
    layouts = resolve_layouts(params, rank, None, mask)
    mask_tree = mask(params) if callable(mask) else mask
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    lays = jax.tree.structure(params).flatten_up_to(layouts)
    masks = jax.tree.structure(params).flatten_up_to(mask_tree)
    rows = []
    for (path, x), lay, mk in zip(flat, lays, masks, strict=True):
        row = {"path": leaf_path(path), "shape": tuple(x.shape), "projected": lay is not None}
        if lay is not None:
            row.update(side=lay.side, m=lay.m, n=lay.n, rank=lay.rank)
        elif len(x.shape) < 2:
            row["reason"] = "1-D"
        elif not mk:
            row["reason"] = "masked (dense)"
        else:
            row["reason"] = f"rank {rank} >= min side {min(x.shape)}"
        rows.append(row)
    return rows


def _schedule(peak: float, s: CompareSettings) -> optax.Schedule:
    """The trainer's schedule (linear warmup, cosine to ``final_lr_ratio`` × peak)."""
    return learning_rate_schedule(ml_collections.ConfigDict(dict(
        learning_rate=peak, final_learning_rate=s.final_lr_ratio * peak,
        warmup_steps=s.warmup, schedule="cosine")), s.steps)


def adam_scaled(s: CompareSettings) -> Callable[[optax.Schedule], optax.GradientTransformation]:
    """``schedule →`` full-rank Adam whose update is scaled by GaLore's α on the leaves the
    low-rank methods project (the k → min-side limit of GaLore): the trainer's
    ``update_rule`` of method ``adam_scaled``.

    Args:
      s: the settings (``b1``, ``b2``, ``eps`` and ``scale`` are read).

    Returns:
      ``rule(schedule)``: Adam's scaling, ``× s.scale`` on the leaves :func:`dense_mask`
      selects for projection, then the learning rate ``schedule``.
    """

    def rule(schedule: optax.Schedule) -> optax.GradientTransformation:
        return optax.chain(
            optax.scale_by_adam(b1=s.b1, b2=s.b2, eps=s.eps),
            optax.masked(optax.scale(s.scale), dense_mask()),
            optax.scale_by_learning_rate(schedule),
        )

    return rule


def make_optimizer(method: str, s: CompareSettings, seed: int = 0) -> optax.GradientTransformation:
    """The optimizer of ``method`` under settings ``s`` (clipping → method → learning rate).

    Args:
      method: one of :data:`METHODS`.
      s: the settings: the method's peak learning rate and schedule, Adam's hyperparameters,
        ``clip`` (0: no clipping) and, for the low-rank methods, ``rank``,
        ``refresh_every`` and ``scale``.
      seed: the projector's sampling seed (low-rank methods; unused by ``adam`` and
        ``adam_scaled``).

    Returns:
      The chained transformation.

    Raises:
      ValueError: an unknown ``method``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    clip = [optax.clip_by_global_norm(s.clip)] if s.clip > 0 else []
    if method == "adam":
        tx = optax.adam(_schedule(s.lr_adam, s), b1=s.b1, b2=s.b2, eps=s.eps)
    elif method == "adam_scaled":
        tx = adam_scaled(s)(_schedule(s.lr_lowrank, s))
    else:
        strategy, realign = _STRATEGY[method]
        tx = plumage(
            _schedule(s.lr_lowrank, s),
            rank=s.rank,
            refresh_every=s.refresh_every,
            strategy=strategy,
            realign=realign,
            b1=s.b1,
            b2=s.b2,
            eps=s.eps,
            scale=s.scale,
            seed=seed,
            mask=dense_mask(),
        )
    return optax.chain(*clip, tx)


def optax_galore(rank: int, refresh_every: int, scale: float, lr: float = 1.0, b2: float = 0.999):
    """``optax.contrib.galore`` with the same dense leaves as ours (embedding, head, 1-D).

    Args:
      rank: the projection rank.
      refresh_every: ``update_proj_gap``: steps between the projector's SVD refreshes.
      scale: GaLore's α on the back-projected update.
      lr: the (constant) learning rate.
      b2: the second-moment decay of the base ``optax.scale_by_adam`` (its other
        hyperparameters are optax's defaults).

    Returns:
      The transformation; 2-D leaves outside
      :data:`~gift_jax.training.optimizers.DENSE_PATTERNS` are projected with
      ``GaLoreDimensionNumbers(0, 1)``, every other leaf is dense.
    """

    def dims(params):
        def f(path, x):
            dense = x.ndim != 2 or matches(leaf_path(path), DENSE_PATTERNS)
            return None if dense else optax.contrib.GaLoreDimensionNumbers(0, 1)

        return jax.tree_util.tree_map_with_path(f, params)

    return optax.contrib.galore(
        lr,
        rank=rank,
        update_proj_gap=refresh_every,
        scale=scale,
        base_optimizer=optax.scale_by_adam(b2=b2),
        weight_dimension_numbers=dims,
    )


# ------------------------------------------------------------------------------- training


@dataclasses.dataclass
class RunResult:
    """One training run: loss curves and the final validation loss."""

    method: str
    seed: int
    train_steps: list[int]
    train_loss: list[float]
    eval_steps: list[int]
    eval_loss: list[float]
    seconds: float

    @property
    def final_eval(self) -> float:
        return self.eval_loss[-1]


def trainer_config(method: str, s: CompareSettings, seed: int,
                   base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The trainer config of one run: ``base`` (``configs/base.py``) with the settings ``s``,
    ``fp32`` communication, and ``comm.method='plumage'`` (projector, realignment) for the
    low-rank methods. ``seed`` is the parameter init, the data order and the sampling key.

    Args:
      method: one of :data:`METHODS`.
      s: the comparison settings (model, batch, schedule, Adam, clipping, evaluation, data
        source, and the low-rank methods' rank, refresh interval and scale).
      seed: ``train.seed`` and ``data.shuffle_seed``.
      base: the loaded ``configs/base.py`` (completed with the trainer's defaults; not
        modified).

    Returns:
      A new config: AdamW without weight decay at ``s.lr_adam`` (``adam``) or
      ``s.lr_lowrank`` (every other method), a log record every step, no checkpoints,
      diagnostics or output files; the low-rank methods project :data:`PROJECTED_PATTERNS`.
      ``adam_scaled`` also needs :func:`adam_scaled` as the trainer's ``update_rule``
      (:func:`train_run`).

    Raises:
      ValueError: an unknown ``method``, or ``eval_batches · eval_batch`` not a multiple of
        ``batch``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (s.eval_batches * s.eval_batch) % s.batch:
        raise ValueError(f"eval_batches * eval_batch = {s.eval_batches * s.eval_batch} must be "
                         f"a multiple of batch={s.batch} (the trainer evaluates at its batch)")
    config = complete_config(base)
    lr = s.lr_adam if method == "adam" else s.lr_lowrank
    fields = {
        **{f"model.{k}": v for k, v in s.model},
        "optimizer.name": "adamw", "optimizer.learning_rate": lr,
        "optimizer.final_learning_rate": s.final_lr_ratio * lr,
        "optimizer.warmup_steps": s.warmup, "optimizer.schedule": "cosine",
        "optimizer.weight_decay": 0.0, "optimizer.b1": s.b1, "optimizer.b2": s.b2,
        "optimizer.eps": s.eps, "optimizer.grad_clip_norm": s.clip,
        "train.seed": seed, "data.shuffle_seed": seed, "data.source": s.data,
        "train.global_batch_size": s.batch, "train.seq_len": s.seq_len,
        "train.num_steps": s.steps, "train.log_every": 1, "train.eval_every": s.eval_every,
        "train.eval_batches": s.eval_batches * s.eval_batch // s.batch,
        "train.checkpoint_every": 0, "train.diagnostics_every": 0, "train.workdir": "",
        "comm.codec": "fp32", "comm.method": "none",
    }
    if method in _STRATEGY:
        strategy, realign = _STRATEGY[method]
        fields.update({"comm.method": "plumage", "plumage.projector": strategy,
                       "plumage.realign_moments": realign, "plumage.rank": s.rank,
                       "plumage.refresh_every": s.refresh_every, "plumage.scale": s.scale,
                       "plumage.layers": PROJECTED_PATTERNS})
    return set_fields(config, fields)


def _source_batches(source):
    """The trainer's batch function over ``source``: training batches in the seed's order;
    validation windows in corpus order (``loop=False``), the same for every seed."""
    from gift_jax.data import batch_iterator

    def batches(split, global_batch, seq_len, **kwargs):
        if split == "train":
            return batch_iterator(source, split, global_batch, seq_len, **kwargs)
        return batch_iterator(source, split, global_batch, seq_len, loop=False)

    return batches


_RULES: dict = {}


def train_run(
    method: str,
    s: CompareSettings,
    seed: int,
    source,
    *,
    base_config: ml_collections.ConfigDict,
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Trains the Llama of ``s`` with ``method`` on one device with the library's trainer
    (:class:`gift_jax.training.Trainer`: the step, schedule and clipping of
    ``scripts/train.py``); the compiled program is shared by the seeds of a method.

    Args:
      method: one of :data:`METHODS`.
      s: the comparison settings.
      seed: the init, data-order and sampling seed.
      source: the token source (:func:`gift_jax.data.get_source`): training batches in the
        seed's order, validation windows in corpus order.
      base_config: the loaded ``configs/base.py``.
      log: called with one progress line per evaluation; ``None``: silent.

    Returns:
      The :class:`RunResult`: the training loss of every step, the eval loss every
      ``s.eval_every`` steps and at the last step, and the trainer's train + eval seconds.

    Raises:
      ValueError: as :func:`trainer_config`.
      FloatingPointError: a non-finite final eval loss.
    """
    config = trainer_config(method, s, seed, base_config)
    rule = _RULES.setdefault(s, adam_scaled(s)) if method == "adam_scaled" else None
    trainer = Trainer(config, batches=_source_batches(source), eval_split="validation",
                      devices=jax.devices()[:1], update_rule=rule)
    try:
        for _ in range(0, s.steps, s.eval_every):
            trainer.run(s.eval_every)
            if trainer.step % s.eval_every:
                trainer.evaluate()  # the last step, between two evaluation steps
            if log is not None:
                log(f"  {method:18s} seed {seed} step {trainer.step:4d} train "
                    f"{trainer.last_loss:.4f} eval {trainer.eval_loss:.4f}")
    finally:
        trainer.close()
    train = [r for r in trainer.history if "loss" in r]
    evals = [r for r in trainer.history if "eval/loss" in r]
    res = RunResult(method, seed, [r["step"] for r in train], [r["loss"] for r in train],
                    [r["step"] for r in evals], [r["eval/loss"] for r in evals],
                    trainer.watch.get("train") + trainer.watch.get("eval"))
    if not math.isfinite(res.final_eval):
        raise FloatingPointError(f"{method} seed {seed}: non-finite final eval loss")
    return res


def run_comparison(
    s: CompareSettings,
    methods: Sequence[str] = METHODS,
    seeds: Sequence[int] = (0, 1, 2),
    *,
    base_config: ml_collections.ConfigDict,
    source=None,
    log: Callable[[str], None] | None = print,
) -> list[RunResult]:
    """Every method × every seed (``base_config``: ``configs/base.py``, which the settings
    override); returns the runs in that order.

    Args:
      s: the comparison settings.
      methods: from :data:`METHODS`, run in this order.
      seeds: the seeds of every method.
      base_config: the loaded ``configs/base.py``.
      source: the token source; ``None``: ``get_source(s.data)``.
      log: called with progress lines (per evaluation and per run); ``None``: silent.

    Returns:
      The :class:`RunResult` of every (method, seed), method-major.
    """
    if source is None:
        from gift_jax.data import get_source

        source = get_source(s.data)
    results = []
    for method in methods:  # method-major: each method compiles once, its seeds reuse it
        for seed in seeds:
            r = train_run(method, s, seed, source, base_config=base_config, log=log)
            if log is not None:
                log(f"{method} seed {seed}: final eval {r.final_eval:.4f} ({r.seconds:.1f} s)")
            results.append(r)
    return results


def _lr_field(method: str) -> str:
    return "lr_adam" if method == "adam" else "lr_lowrank"


def load_runs(path: str, s: CompareSettings, methods: Sequence[str]) -> list[RunResult]:
    """Runs of ``methods`` from a ``results.json`` written by ``scripts/lowrank_compare.py``.

    Args:
      path: the ``results.json`` file.
      s: the settings the runs must have been made with.
      methods: the methods whose runs are taken.

    Returns:
      Their :class:`RunResult` objects, method by method in the order of ``methods``.

    Raises:
      ValueError: unless the saved settings equal ``s`` in every field that the run
        depends on (all fields but the *other* family's learning rate); or when the file
        holds no run of one of ``methods``.
    """
    import json

    with open(path) as fh:
        saved = json.load(fh)
    mine = dataclasses.asdict(s)
    theirs = saved["settings"]
    theirs["model"] = tuple(tuple(x) for x in theirs["model"])
    mine["model"] = tuple(tuple(x) for x in mine["model"])
    runs = []
    for m in methods:
        other = "lr_lowrank" if _lr_field(m) == "lr_adam" else "lr_adam"
        diff = [k for k in mine if k != other and mine[k] != theirs.get(k)]
        if diff:
            raise ValueError(f"{path}: settings differ for {m} in {diff}")
        found = [RunResult(**r) for r in saved["runs"] if r["method"] == m]
        if not found:
            raise ValueError(f"{path} holds no run of {m}")
        runs += found
    return runs


def summarize(results: Sequence[RunResult]) -> dict:
    """Mean ± std (ddof=1) of the final eval loss per method, and the gap closed.

    ``gap_closed[base][X] = (GaLore − X) / (GaLore − base)`` on the means (and per seed, when
    every seed has all three) for X in plumage, plumage_norealign, flora and each full-rank
    baseline present (``adam``, ``adam_scaled``). It is meaningful only when GaLore is worse
    than the baseline (``galore_minus_base > 0``).

    Args:
      results: runs of any methods and seeds (of two runs with the same method and seed,
        the later one counts).

    Returns:
      A dict with ``"methods"``: ``{method: {"mean", "std", "n", "per_seed"}}`` (``std`` 0
      for a single seed, ``per_seed`` ``{seed: final eval loss}``), and ``"gap_closed"``:
      ``{base: {X: {"of_means", "per_seed", "galore_minus_base"}}}`` (``of_means`` NaN when
      GaLore's mean equals the base's, ``per_seed`` a list of ratios); bases and X without
      runs, or all of them when GaLore has none, are left out of ``gap_closed``.
    """
    by: dict[str, dict[int, float]] = {}
    for r in results:
        by.setdefault(r.method, {})[r.seed] = r.final_eval
    out: dict[str, Any] = {"methods": {}}
    for m, d in by.items():
        v = np.array(list(d.values()))
        std = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        out["methods"][m] = {"mean": float(v.mean()), "std": std, "n": len(v), "per_seed": d}
    gaps: dict[str, dict] = {}
    for base in BASELINES:
        if base not in by or "galore" not in by:
            continue
        a, g = out["methods"][base]["mean"], out["methods"]["galore"]["mean"]
        for m in ("plumage", "plumage_norealign", "flora"):
            if m not in by:
                continue
            p = out["methods"][m]["mean"]
            per = [
                (by["galore"][k] - by[m][k]) / (by["galore"][k] - by[base][k])
                for k in by[m]
                if k in by["galore"] and k in by[base] and by["galore"][k] != by[base][k]
            ]
            gaps.setdefault(base, {})[m] = {
                "of_means": (g - p) / (g - a) if g != a else float("nan"),
                "per_seed": per,
                "galore_minus_base": g - a,
            }
    out["gap_closed"] = gaps
    return out


def format_compare_markdown(summary: dict) -> str:
    """A markdown table of the summary.

    Args:
      summary: :func:`summarize`'s output.

    Returns:
      The per-method table in :data:`METHODS` order, then per full-rank baseline the
      gap-closed table and the GaLore − baseline difference; no trailing newline.
    """
    lines = [
        "| method | final eval loss (mean ± std) | n | per seed |",
        "|---|---|---|---|",
    ]
    for m in METHODS:
        if m not in summary["methods"]:
            continue
        d = summary["methods"][m]
        per = ", ".join(f"{v:.4f}" for _, v in sorted(d["per_seed"].items()))
        lines.append(f"| {m} | {d['mean']:.4f} ± {d['std']:.4f} | {d['n']} | {per} |")
    for base, gaps in summary["gap_closed"].items():
        gb = next(iter(gaps.values()))["galore_minus_base"]
        lines += [
            "",
            f"| X | gap closed (GaLore − X)/(GaLore − {base}), of means | per seed |",
            "|---|---|---|",
        ]
        for m, gc in gaps.items():
            per = ", ".join(f"{x:+.1%}" for x in gc["per_seed"])
            lines.append(f"| {m} | {gc['of_means']:+.1%} | {per} |")
        lines.append(f"\n(GaLore − {base} = {gb:+.4f}" + (
            "; negative: GaLore beats this baseline, so the ratio is not a gap closed)"
            if gb <= 0 else ")"))
    return "\n".join(lines)


def plot_curves(results: Sequence[RunResult], path: str, *, smooth: int = 20) -> None:
    """Train loss (moving average, mean over seeds) and eval loss (mean ± std) per method.

    Args:
      results: the runs; the seeds of a method must share their steps (their curves are
        averaged element by element).
      path: the image file (format from its suffix).
      smooth: the moving average's window, in logged steps (at most the curve's length).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = [m for m in METHODS if any(r.method == m for r in results)]
    for m in methods:
        rs = [r for r in results if r.method == m]
        tr = np.mean([r.train_loss for r in rs], axis=0)
        k = max(1, min(smooth, len(tr)))
        sm = np.convolve(tr, np.ones(k) / k, mode="valid")
        ax1.plot(rs[0].train_steps[k - 1 :], sm, label=m)
        ev = np.array([r.eval_loss for r in rs])
        mu, sd = ev.mean(0), ev.std(0)
        (line,) = ax2.plot(rs[0].eval_steps, mu, marker="o", label=m)
        ax2.fill_between(rs[0].eval_steps, mu - sd, mu + sd, color=line.get_color(), alpha=0.2)
    ax1.set(xlabel="step", ylabel=f"train loss (moving avg {smooth}, mean of seeds)")
    ax2.set(xlabel="step", ylabel="validation loss (mean ± std over seeds)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    tail = [r.eval_loss[-1] for r in results]
    ax2.set_ylim(min(tail) - 0.1, max(tail) + 0.6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------- benchmarks


def _bytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def state_bytes(tx: optax.GradientTransformation, params: Any) -> int:
    """Bytes of ``tx.init(params)`` from ``jax.eval_shape`` (no allocation).

    Args:
      tx: the optimizer.
      params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      The total bytes of the optimizer state's leaves.
    """
    return _bytes(jax.eval_shape(tx.init, params))


def state_memory_table(config_paths: Sequence[str]) -> list[dict]:
    """Optimizer-state bytes of Adam, ours (GaLore/PLUMAGE/FLORA) and optax.contrib.galore.

    Rank, refresh interval and scale are each config's ``plumage`` group; embedding, head and
    1-D leaves dense in every low-rank method. ``params`` counts the fp32 parameter bytes.

    Args:
      config_paths: paths of config files (e.g. ``configs/llama_60m.py``).

    Returns:
      One row per config: ``config`` (the file's stem), ``rank``, ``params``,
      ``projected_leaves``, ``leaves``, and the state bytes ``adam``, ``optax_galore``,
      ``ours_galore``, ``ours_plumage`` and ``ours_flora``.
    """
    rows = []
    for path in config_paths:
        cfg = load_config(path)
        mc = model_config_of(cfg.model)
        shapes = param_shapes(mc)
        rank, tau = cfg.plumage.rank, cfg.plumage.refresh_every
        proj = projection_table(shapes, rank)
        row = {
            "config": path.rsplit("/", 1)[-1].removesuffix(".py"),
            "rank": rank,
            "params": _bytes(shapes),
            "projected_leaves": sum(r["projected"] for r in proj),
            "leaves": len(proj),
            "adam": state_bytes(optax.adam(1e-3), shapes),
            "optax_galore": state_bytes(optax_galore(rank, tau, 0.25), shapes),
        }
        for strat in ("galore", "plumage", "flora"):
            tx = plumage(1e-3, rank, tau, strategy=strat, mask=dense_mask())
            row[f"ours_{strat}"] = state_bytes(tx, shapes)
        rows.append(row)
    return rows


def _block_params(d_model: int, d_ff: int, key: jax.Array) -> dict:
    """One Llama block's matrices (q, k, v, o, gate, up, down) and its two norm scales."""
    shapes = {
        "q_proj": (d_model, d_model),
        "k_proj": (d_model, d_model),
        "v_proj": (d_model, d_model),
        "o_proj": (d_model, d_model),
        "gate_proj": (d_model, d_ff),
        "up_proj": (d_model, d_ff),
        "down_proj": (d_ff, d_model),
        "attn_norm": (d_model,),
        "mlp_norm": (d_model,),
    }
    keys = jax.random.split(key, len(shapes))
    return {n: jax.random.normal(k, s, jnp.float32) for (n, s), k in zip(shapes.items(), keys,
                                                                        strict=True)}


def time_updates(
    d_model: int = 512,
    d_ff: int = 1376,
    layers: int = 1,
    rank: int = 128,
    refresh_every: int = 200,
    repeats: int = 20,
    seed: int = 0,
    strategies: Sequence[str] = ("plumage", "galore", "flora"),
    include_optax: bool = True,
    refresh_repeats: int = 3,
) -> list[dict]:
    """Best-of-N wall time of one jitted optimizer update (updates + new state).

    N is ``repeats`` for ordinary steps and ``refresh_repeats`` for refresh steps (an SVD of
    every projected matrix: seconds on a CPU).

    Params: ``layers`` Llama blocks of ``d_model``/``d_ff`` (7 matrices and 2 norm scales
    each). Variants:

    * ours with the static ``plumage_refresh=False`` (ordinary step: no SVD in the program)
      and ``=True`` (refresh step: SVD of every projected leaf), strategies ``plumage``,
      ``galore`` and ``flora``;
    * ours with the default in-graph ``lax.cond`` schedule (the structure of optax's), timed
      at a count that does not refresh;
    * ``optax.contrib.galore`` at ``count % τ != 0`` (ordinary) and ``count % τ == 0``
      (refresh).

    Args:
      d_model, d_ff: the blocks' widths.
      layers: the number of blocks.
      rank: the projection rank of every optimizer.
      refresh_every: the refresh interval τ of every optimizer.
      repeats: N of the ordinary steps.
      seed: key of the random parameters (the gradients are 1e-3 × the parameters).
      strategies: the projectors of ours (``plumage``, ``galore``, ``flora``); the
        ``lax.cond`` variant is timed for all but ``flora``.
      include_optax: also time ``optax.contrib.galore``.
      refresh_repeats: N of the refresh steps.

    Returns:
      One row per case: ``optimizer`` (e.g. ``ours[plumage]``, ``ours[galore] (lax.cond)``,
      ``optax.contrib.galore``), ``step`` (``ordinary`` or ``refresh``) and ``seconds``
      (best of N).
    """
    key = jax.random.PRNGKey(seed)
    params = {
        f"layer{i}": _block_params(d_model, d_ff, k)
        for i, k in enumerate(jax.random.split(key, layers))
    }
    grads = jax.tree.map(lambda x: 1e-3 * x, params)
    cases = []  # (optimizer, step kind, jitted fn, args, repeats)

    for strat in strategies:
        tx = plumage(1e-3, rank, refresh_every, strategy=strat)
        st = tx.init(params)
        upd = {
            flag: jax.jit(lambda g, s, p, f=flag, t=tx: t.update(g, s, p, plumage_refresh=f))
            for flag in (False, True)
        }
        _, st = upd[True](grads, st, params)  # a realistic (refreshed) state
        cases.append((f"ours[{strat}]", "ordinary", upd[False], (grads, st, params), repeats))
        cases.append((f"ours[{strat}]", "refresh", upd[True], (grads, st, params),
                      refresh_repeats))
        if strat != "flora":
            cond = jax.jit(tx.update)
            _, st1 = cond(grads, tx.init(params), params)  # count 0: refresh inside the cond
            assert not bool(refresh_due(st1))
            cases.append((f"ours[{strat}] (lax.cond)", "ordinary", cond, (grads, st1, params),
                          repeats))
    if include_optax:
        tx = optax_galore(rank, refresh_every, 0.25, lr=1e-3)
        upd = jax.jit(tx.update)
        st0 = tx.init(params)
        _, st1 = upd(grads, st0, params)  # count 1 → ordinary step
        cases.append(("optax.contrib.galore", "ordinary", upd, (grads, st1, params), repeats))
        cases.append(("optax.contrib.galore", "refresh", upd, (grads, st0, params),
                      refresh_repeats))

    # Interleaved rounds (every case once per round, best over rounds): a slow drift of the
    # machine's load then affects every case alike.
    times = interleaved_times(
        {j: (lambda fn=fn, args=args: fn(*args)) for j, (_, _, fn, args, _) in enumerate(cases)},
        {j: c[4] for j, c in enumerate(cases)})
    best = [min(times[j]) for j in range(len(cases))]
    return [{"optimizer": c[0], "step": c[1], "seconds": b} for c, b in zip(cases, best,
                                                                            strict=True)]
