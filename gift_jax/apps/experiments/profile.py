"""Per-layer vulnerability profile (which layers GIFT should whiten) and the GIFT step cost.

Layer profile (:func:`profile_layers`).  For every linear layer's kernel gradient, over a window
of training steps starting at a checkpoint step s, with R simulated replicas
(:func:`gift_jax.apps.experiments.roundtrip.make_replica_fn`):

* the artifact's **stale, synced scales**: one per-tensor scale per layer, computed at step s
  from the replicas' gradients (``max_r amax(G_r)/fmax``, shared by all replicas) and reused
  for steps s … s+window−1 (the artifact syncs its FP8 scales every 50 steps);
* **saturation ratio**: fraction of elements whose code is the format maximum (``|Q(x)| =
  fmax·s``: clipped, or rounded onto it) — meaningful only under stale scales, since a fresh
  per-tensor scale maps the absolute maximum exactly onto ``fmax`` (one code per tensor);
* **underflow fraction**: fraction of non-zero elements flushed to zero, and of elements that
  land on a subnormal code, under the same scales;
* **round-trip error** of the all-reduce (senders quantize with the stale scale, fp32
  accumulation, the mean re-quantized with a fresh scale — :func:`simulate_allreduce` with
  ``scales=``) in each frame: Euclidean relative L2 and the whitened-frame error
  (``‖W(Ĝ−G)‖/‖WG‖``, W the full input-side factor of the step's own A); and the Euclidean
  error of the GIFT transport (rank-r factor and stale whitened-frame scale, both from step s).

* **saturation under the library's stale scales** (``library_saturation``): the same window
  reduced by the library's own all-reduce with ``scale_sync_every`` (``comm.scale_sync_every``
  in the trainer) — every profiled kernel gradient of the R replicas in one tree, the scales
  synced on the window's first step and reused for the rest, run in ``jax.shard_map`` over R
  devices — and each leaf's share of the replicas' elements clipped beyond its stale scale,
  as the all-reduce counts it (``AllReduceState.saturation``); with fewer than R devices the
  column is absent (``scripts/profile_layers.py`` asks for R simulated CPU devices).

Metrics are averaged over the sampled steps of the window (every ``stride`` steps).  Layers are
ranked by saturation ratio (the artifact's score), ties broken by underflow then round-trip
error; the top-n (optionally among ``candidates`` patterns, e.g. ``*/mlp/down_proj`` as in
the artifact) are the selection.  Re-profiling at later checkpoints shows whether the selection
is stable (overlap with the first checkpoint's).

Step cost (:func:`bench_gift_step`): the GIFT stage around the FP8 all-reduce inside
``jax.shard_map`` against the plain FP8 all-reduce in the same run, on ordinary (non-refresh)
steps, and the refresh variant separately (amortised over K); :func:`gift_flops` gives the
added FLOPs analytically.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gift_jax import whitening as wh
from gift_jax.apps.bench import best_time
from gift_jax.apps.experiments.roundtrip import (
    Trainer,
    capture_replicas,
    make_replica_fn,
    markdown_table,
    simulate_allreduce,
    tensor_quantize,
    tensor_scale,
)
from gift_jax.comm.codecs import get_codec
from gift_jax.utils.tree_paths import matches

__all__ = [
    "bench_gift_step",
    "gift_flops",
    "layer_metrics",
    "profile_layers",
    "rank_layers",
    "selection_snippet",
]

ALL_LINEAR = ("*_proj", "lm_head")


@jax.jit
def _rel(a, r):
    return jnp.linalg.norm((a - r).ravel()) / jnp.linalg.norm(r.ravel())


def layer_metrics(g: jax.Array, scale: jax.Array, codec: str, metric_factor: Any,
                  gift_factor: Any = None, gift_scale: jax.Array | None = None) -> dict:
    """Saturation / underflow / round-trip errors of one layer's replica gradients ``g``
    (R, n, m) quantized with the (stale) per-tensor ``scale``.

    Args:
      g: the R replicas' kernel gradients, (R, n, m).
      scale: the stale per-tensor scale every replica quantizes with (a scalar).
      codec: the codec's name (a per-tensor format, e.g. ``fp8_e5m2``).
      metric_factor: the input-side factor of the whitened-frame error (the full factor of
        the step's own A).
      gift_factor: GIFT's factor of the layer; ``None``: no GIFT metrics.
      gift_scale: the stale per-tensor scale of the whitened gradients (needed with
        ``gift_factor``).

    Returns:
      Host scalars ``saturation``, ``flushed``, ``subnormal``, ``rt_euclidean``,
      ``rt_whitened`` and, with ``gift_factor``, ``rt_gift`` and ``gift_saturation``.
    """
    c = get_codec(codec)
    fmax = c.fmax
    tiny = float(ml_dtypes.finfo(c.element_dtype).smallest_normal)
    return jax.device_get(_layer_metrics(g, scale, codec, fmax, tiny, metric_factor,
                                         gift_factor, gift_scale))


@functools.partial(jax.jit, static_argnames=("codec", "fmax", "tiny"))
def _layer_metrics(g, scale, codec, fmax, tiny, metric_factor, gift_factor, gift_scale):
    r = g.shape[0]
    q = jax.vmap(lambda x: tensor_quantize(x, codec, scale))(g)
    code = jnp.abs(q) / scale
    nz = g != 0
    sat = jnp.mean(code >= fmax)
    flushed = jnp.sum((code == 0) & nz) / jnp.maximum(jnp.sum(nz), 1)
    subnormal = jnp.mean((code > 0) & (code < tiny))
    ref = jnp.mean(g, axis=0)
    out = simulate_allreduce(g, codec, "fp32", scales=jnp.broadcast_to(scale, (r,))).mean
    e_w = wh.whiten(metric_factor, out - ref)
    w_ref = wh.whiten(metric_factor, ref)
    res = dict(saturation=sat, flushed=flushed, subnormal=subnormal,
               rt_euclidean=_rel(out, ref),
               rt_whitened=jnp.linalg.norm(e_w) / jnp.linalg.norm(w_ref))
    if gift_factor is not None:
        wg = jax.vmap(lambda x: wh.whiten(gift_factor, x))(g)
        wout = simulate_allreduce(wg, codec, "fp32",
                                  scales=jnp.broadcast_to(gift_scale, (r,))).mean
        res["rt_gift"] = _rel(wh.unwhiten(gift_factor, wout), ref)
        res["gift_saturation"] = jnp.mean(
            jnp.abs(jax.vmap(lambda x: tensor_quantize(x, codec, gift_scale))(wg))
            / gift_scale >= fmax)
    return res


@functools.partial(jax.jit, static_argnames=("kind", "rank", "damping"))
def _factor(a, kind, rank, damping):
    return wh.make_factor(a, kind, rank=rank, damping=damping)[0]


class StaleScaleReduction:
    """The library's all-reduce (``gift_jax.allreduce(codec, scale_sync_every=K)``) over R
    devices of a ``data`` mesh, driven with the replicas' gradients of one window: the first
    call syncs the scales, the next ``K − 1`` reuse them, and :meth:`__call__` returns each
    leaf's share of the replicas' elements clipped (``AllReduceState.saturation[0]``)."""

    def __init__(self, codec: str, calls_per_sync: int, replicas: int):
        """Args:
          codec: a per-tensor codec.
          calls_per_sync: K, in calls (the window's sampled steps).
          replicas: R, the devices of the mesh (the first R devices).
        """
        from jax.sharding import PartitionSpec as P

        from gift_jax.comm.stage import allreduce

        self.mesh = jax.make_mesh((replicas,), ("data",), devices=jax.devices()[:replicas])
        self.tx = allreduce("data", codec, scale_sync_every=max(int(calls_per_sync), 2))

        def body(g, st):
            _, st = self.tx.update(jax.tree.map(lambda x: x[0], g), st)
            return st

        self._step = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("data"), P()),
                                           out_specs=P(), check_vma=False))
        self._init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=P(),
                                           out_specs=P(), check_vma=False))
        self.state = None

    def __call__(self, grads: dict[str, jax.Array]) -> dict[str, float]:
        """One call: ``{path: share of the replicas' elements beyond the stale scale}``.

        Args:
          grads: ``{kernel path: (R, n, m)}`` the replicas' gradients.

        Returns:
          The clipped share per path on this call (0 on the syncing first call).
        """
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if self.state is None:
            self.state = self._init({p: jnp.zeros(jnp.shape(x)[1:], jnp.float32)
                                     for p, x in grads.items()})
        g = jax.device_put(dict(grads), NamedSharding(self.mesh, P("data")))
        self.state = self._step(g, self.state)
        sat = jax.device_get(self.state.saturation)
        return {p: float(v[0]) for p, v in sat.items()}


def profile_layers(
    trainer: Trainer,
    checkpoints: Sequence[int] = (0, 100, 300),
    *,
    window: int = 50,
    stride: int = 5,
    codec: str = "fp8_e5m2",
    replicas: int = 8,
    local_batch: int = 1,
    patterns: Sequence[str] = ALL_LINEAR,
    gift_rank: int = 32,
    damping: float = 1e-3,
    verbose: bool = True,
) -> dict[int, dict[str, dict[str, float]]]:
    """``{checkpoint step: {kernel path: metrics averaged over the window}}``.

    The trainer is advanced (AdamW, exact gradients) to each checkpoint and through each
    window; checkpoints must be increasing and at least ``window`` apart.

    Args:
      trainer: the experiment trainer, at or before the first checkpoint.
      checkpoints: the steps s at which a window starts.
      window: the steps for which step s's synced scales and GIFT factors are reused.
      stride: profile every ``stride``-th step of a window.
      codec: the wire format.
      replicas: R, the simulated replicas.
      local_batch: sequences per replica.
      patterns: the profiled layers (default: every ``*_proj`` and ``lm_head``).
      gift_rank: r of GIFT's ``lowrank_diag`` factor.
      damping: the relative damping of every factor.
      verbose: print each window's time.

    Returns:
      The dict above, the metrics those of :func:`layer_metrics` and, with at least
      ``replicas`` devices, ``library_saturation`` (module docstring).

    Raises:
      ValueError: checkpoints that do not increase by at least ``window``, or a checkpoint
        the trainer has already passed.
    """
    ck = list(checkpoints)
    if any(b - a < window for a, b in zip(ck, ck[1:], strict=False)) or ck != sorted(ck):
        raise ValueError(f"checkpoints {ck} must increase by at least window={window}")
    fn = make_replica_fn(trainer.graphdef, patterns, replicas)
    result = {}
    for s in ck:
        if trainer.step > s:
            raise ValueError(f"trainer is at step {trainer.step}, past checkpoint {s}")
        trainer.advance(s - trainer.step)
        t0 = time.perf_counter()
        acc: dict[str, list[dict]] = {}
        scales = gift_facts = gift_scales = None
        calls = len(range(0, window, stride))
        library = (StaleScaleReduction(codec, calls, replicas)
                   if jax.device_count() >= replicas else None)
        for k in range(0, window, stride):
            trainer.advance(s + k - trainer.step)
            cap = capture_replicas(trainer, fn, replicas * local_batch)
            lib = library(cap.grads) if library is not None else {}
            if scales is None:  # refresh: synced scales and GIFT factors of step s
                scales = {p: jnp.max(jax.vmap(lambda x: tensor_scale(x, codec))(g))
                          for p, g in cap.grads.items()}
                gift_facts = {p: _factor(jnp.mean(cap.a[p], 0), "lowrank_diag", gift_rank,
                                         damping) for p in cap.grads}
                gift_scales = {p: jnp.max(jax.vmap(
                    lambda x, f=gift_facts[p]: tensor_scale(wh.whiten(f, x), codec))(g))
                    for p, g in cap.grads.items()}
            for p, g in cap.grads.items():
                mf = _factor(jnp.mean(cap.a[p], 0), "full_cholesky", 0, damping)
                metrics = layer_metrics(g, scales[p], codec, mf, gift_facts[p], gift_scales[p])
                if p in lib:
                    metrics["library_saturation"] = lib[p]
                acc.setdefault(p, []).append(metrics)
        result[s] = {p: {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}
                     for p, ms in acc.items()}
        if verbose:
            print(f"  profiled steps {s}..{s + window - 1} (every {stride}): "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    return result


def rank_layers(profile: dict[str, dict[str, float]],
                candidates: Sequence[str] | None = None) -> list[str]:
    """Kernel paths sorted by vulnerability: saturation, then underflow, then round-trip error
    (all descending); restricted to paths matching ``candidates`` patterns if given.

    Args:
      profile: one checkpoint's ``{kernel path: metrics}`` (:func:`profile_layers`).
      candidates: path patterns; ``None``: every path.

    Returns:
      The kernel paths, most vulnerable first.
    """
    paths = [p for p in profile if candidates is None or matches(p, candidates)]
    return sorted(paths, key=lambda p: (-profile[p]["saturation"],
                                        -(profile[p]["flushed"] + profile[p]["subnormal"]),
                                        -profile[p]["rt_euclidean"]))


def module_pattern(kernel_path: str) -> str:
    """The module path of a kernel path, as GIFT's ``layers`` patterns name it.

    Args:
      kernel_path: a ``'/'``-joined leaf path.

    Returns:
      The path without a trailing ``/kernel`` (any other path as it is).
    """
    return kernel_path[: -len("/kernel")] if kernel_path.endswith("/kernel") else kernel_path


def selection_snippet(selections: dict[int, list[str]], first: int, codec: str,
                      window: int, command: str = "") -> str:
    """A Python config snippet: ``GIFT_LAYERS`` (the first checkpoint's top-n, as the artifact
    profiles the start of training) and the selection at every checkpoint.

    Args:
      selections: ``{checkpoint step: selected kernel paths}`` (:func:`profile_markdown`).
      first: the checkpoint whose selection becomes ``GIFT_LAYERS``.
      codec: the profiled codec (for a comment).
      window: the steps the synced scales were reused (for a comment).
      command: the command line that made it (for a comment); empty: none.

    Returns:
      The module's source, the selections as module paths (:func:`module_pattern`).
    """
    lines = [
        '"""GIFT layer selection from scripts/profile_layers.py (generated; do not edit)."""',
        "",
        f"# codec {codec}; stale synced scales reused for {window} steps; ranked by saturation",
        f"# command: {command}" if command else "#",
        f"GIFT_LAYERS = {[module_pattern(p) for p in selections[first]]!r}",
        "",
        "GIFT_LAYERS_BY_CHECKPOINT = {",
        *(f"    {s}: {[module_pattern(p) for p in sel]!r}," for s, sel in selections.items()),
        "}",
        "",
    ]
    return "\n".join(lines)


def profile_markdown(result: dict[int, dict[str, dict[str, float]]], top_n: int,
                     candidates: Sequence[str] | None, codec: str) -> tuple[str, dict]:
    """Markdown tables (per checkpoint, ranked) + the selection overlap table.

    Args:
      result: :func:`profile_layers`'s output.
      top_n: the size of each checkpoint's selection.
      candidates: the patterns the selection is restricted to; ``None``: every layer.
      codec: the profiled codec (for the headings).

    Returns:
      ``(markdown, selections)``: the text, ending in a newline, and ``{checkpoint step:
      its top_n kernel paths}``; overlaps are with the first checkpoint's selection.
    """
    out = []
    selections = {}
    cols = ["rank", "layer", "saturation", "flushed", "subnormal", "rt_euclidean",
            "rt_whitened", "rt_gift", "gift_saturation"]
    if all("library_saturation" in m for prof in result.values() for m in prof.values()):
        cols.insert(3, "library_saturation")
    titles = {"saturation": "saturation", "flushed": "flushed to 0", "subnormal": "subnormal",
              "library_saturation": "clipped, library (scale_sync_every)",
              "rt_euclidean": "rt err (Eucl.)", "rt_whitened": "rt err (whitened frame)",
              "rt_gift": "rt err GIFT r32 (Eucl.)", "gift_saturation": "GIFT saturation"}
    for s, prof in result.items():
        order = rank_layers(prof)
        sel = rank_layers(prof, candidates)[:top_n]
        selections[s] = sel
        rows = [dict(rank=str(i + 1), layer=module_pattern(p), **prof[p])
                for i, p in enumerate(order)]
        out.append(f"\n#### Checkpoint step {s} ({codec}), ranked; selected top-{top_n}"
                   f"{' among ' + ', '.join(candidates) if candidates else ''}: "
                   f"{', '.join(module_pattern(p) for p in sel)}\n")
        out.append(markdown_table(rows, cols, titles))
    steps = list(selections)
    first = set(selections[steps[0]])
    ov = [dict(checkpoint=str(s), selected=", ".join(module_pattern(p) for p in selections[s]),
               overlap=f"{len(first & set(selections[s]))}/{top_n}",
               jaccard=len(first & set(selections[s])) / len(first | set(selections[s])))
          for s in steps]
    out.append(f"\n#### Stability of the top-{top_n} selection (overlap with step {steps[0]})\n")
    out.append(markdown_table(ov, ["checkpoint", "selected", "overlap", "jaccard"]))
    return "\n".join(out) + "\n", selections


def plot_profile(result: dict[int, dict[str, dict[str, float]]], path: str) -> None:
    """Bars per layer of the saturation, subnormal fraction and Euclidean round-trip error,
    one bar per checkpoint (layers in the first checkpoint's order).

    Args:
      result: :func:`profile_layers`'s output.
      path: the image file (format from its suffix).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(result)
    paths = list(result[steps[0]])
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.22 * len(paths) + 1.5), sharey=True)
    for ax, metric in zip(axes, ("saturation", "subnormal", "rt_euclidean"), strict=True):
        h = 0.8 / len(steps)
        for i, s in enumerate(steps):
            ax.barh(np.arange(len(paths)) + i * h, [result[s][p][metric] for p in paths],
                    height=h, label=f"step {s}")
        ax.set_title(metric)
    axes[0].set_yticks(np.arange(len(paths)))
    axes[0].set_yticklabels([module_pattern(p) for p in paths], fontsize=6)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================================
# Step cost of the GIFT stage
# ============================================================================================


def bench_gift_step(
    shapes: dict[str, tuple[int, ...]],
    layers: Sequence[str],
    *,
    rank: int = 32,
    codec: str = "fp8_e4m3",
    factor: str = "lowrank_diag",
    eig_method: str = "eigh",
    refresh_every: int = 50,
    repeats: int = 5,
    mesh=None,
    seed: int = 0,
) -> dict[str, float]:
    """Seconds per call of the GIFT-FP8 stage vs the plain FP8 all-reduce, both inside
    ``jax.shard_map`` over the mesh's ``data`` axis, in the same run.

    Args:
      shapes: ``{path: shape}`` of the gradient tree (nested by '/' is not needed: a flat dict
        whose keys are the paths); each device gets its own random gradient (standard
        deviation 1e-3) of every shape, and selected shapes are 2-D (in, out).
      layers: GIFT's layer patterns (:func:`gift_jax.whitening.stage.select_layers`).
      rank: r of the low-rank factors.
      codec: the all-reduce's wire format.
      factor: the factor kind (:data:`gift_jax.whitening.FACTOR_KINDS`).
      eig_method: the refresh's eigensolver, ``"eigh"`` or ``"subspace"``.
      refresh_every: K, over which the refresh step is amortised.
      repeats: calls per variant, best taken; the refresh variant gets ``repeats // 2`` (at
        least 1).
      mesh: a mesh with a ``data`` axis; ``None``: every device on one ``data`` axis.
      seed: key of the random gradients and input statistics.

    Returns:
      ``devices``, ``platform``, the best-of-``repeats`` seconds of the Euclidean step, the
      GIFT ordinary step and the GIFT refresh step (``euclidean_s``, ``gift_s``,
      ``gift_refresh_s``), the ratios ``gift_over_euclidean``, ``refresh_over_euclidean``
      and ``amortised_over_euclidean`` (refresh amortised over ``refresh_every``), and
      ``refresh_every`` itself.

    Raises:
      ValueError: a pattern of ``layers`` that selects no path (from
        :func:`~gift_jax.whitening.stage.select_layers`).
    """
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gift_jax.comm.stage import allreduce
    from gift_jax.whitening.stage import gift, select_layers

    if mesh is None:
        mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    ndev = mesh.shape["data"]
    shard = NamedSharding(mesh, P("data"))
    key = jax.random.key(seed)
    grads = {}
    for i, (p, s) in enumerate(shapes.items()):
        x = jax.random.normal(jax.random.fold_in(key, i), (ndev, *s), jnp.float32) * 1e-3
        grads[p] = jax.device_put(x, shard)
    sel = select_layers({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()},
                        layers)
    stats = {}
    for i, p in enumerate(sel):
        n = shapes[p][0]
        # a realistic spectrum: activations with decaying column scales
        xk = jax.random.normal(jax.random.fold_in(key, 1000 + i), (2 * n, n))
        xk = xk * (jnp.arange(1, n + 1, dtype=jnp.float32) ** -0.7)
        a = xk.T @ xk / (2 * n)
        stats[p] = jax.device_put(jnp.broadcast_to(a, (ndev, n, n)), shard)

    euclid = allreduce("data", codec)
    stage = gift(allreduce("data", codec), layers=tuple(layers), rank=rank,
                 factor=factor, eig_method=eig_method)

    def run(tx, with_stats):
        def body(g, st, *a):
            local = jax.tree.map(lambda x: x[0], g)
            kw = {}
            if with_stats:
                kw["gift_stats"] = jax.tree.map(lambda x: x[0], a[0])
            out, new = tx.update(local, st, None, **kw)
            return jax.tree.map(lambda x: x[None], out), new

        specs = (P("data"), P()) + ((P("data"),) if with_stats else ())
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("data"), P()),
                                     check_vma=False))

    local0 = {p: jnp.zeros(s, jnp.float32) for p, s in shapes.items()}
    st_e = euclid.init(local0)
    st_g = stage.init(local0)
    f_e = run(euclid, False)
    f_g = run(stage, False)
    f_r = run(stage, True)
    # a real refresh first, so the ordinary step runs with non-trivial factors
    _, st_g = jax.block_until_ready(f_r(grads, st_g, stats))
    t_e = best_time(f_e, grads, st_e, repeats=repeats)
    t_g = best_time(f_g, grads, st_g, repeats=repeats)
    t_r = best_time(f_r, grads, st_g, stats, repeats=max(1, repeats // 2))
    del optax
    return {
        "devices": ndev, "platform": jax.default_backend(),
        "euclidean_s": t_e, "gift_s": t_g, "gift_refresh_s": t_r,
        "gift_over_euclidean": t_g / t_e,
        "refresh_over_euclidean": t_r / t_e,
        "amortised_over_euclidean": (t_g + (t_r - t_g) / refresh_every) / t_e,
        "refresh_every": refresh_every,
    }


def gift_flops(
    n: int, m: int, *, rank: int = 32, layers: int = 13, refresh_every: int = 50,
    tokens_per_device: int = 131072, model_params: int | None = None,
    factor: str = "lowrank_diag", oversample: int = 8, iters: int = 2,
) -> dict[str, float]:
    """Added FLOPs of GIFT per device (multiply-add = 2 FLOPs), analytically.

    Per ordinary step and layer (kernel n×m, rank r, ``lowrank_diag``): whiten
    ``W·G = H + Q((1+S)^{-1/2}−1)QᵀH`` with ``H = D^{-1/2}G`` costs ``n·m`` (diagonal) +
    ``2nrm`` (QᵀH) + ``2nrm`` (Q·) + ``2nm`` (scale, add); unwhiten the same, so
    ``≈ 8nrm + 6nm`` in all.  Per refresh and layer: the statistic ``A = XᵀX`` over the local
    tokens (``2·N·n²``, in the forward pass of the refresh step), and the eigensolver: dense
    ``eigh`` ≈ ``9n³`` (tridiagonalisation ``4/3·n³`` + QR iterations and back-transformation
    of the eigenvectors), or subspace iteration ``(iters+2)·2n²(r+p) + (iters+1)·4n(r+p)²``,
    plus the thin SVD of the n×r matrix of the diagonal-remainder form ``≈ 14nr²``.
    ``model_params`` gives the ratio to the training FLOPs ``6·params·tokens``.

    Args:
      n, m: the kernel's input and output widths.
      rank: r of the factor.
      layers: the number of whitened layers (all n×m).
      refresh_every: K, over which a refresh is amortised.
      tokens_per_device: N, the local tokens of a step.
      model_params: the model's parameter count; ``None`` (or 0): no ratios.
      factor: the factor kind; only ``"lowrank_diag"``, whose costs the counts are.
      oversample: p, the subspace iteration's oversampling.
      iters: the subspace iteration's iterations.

    Returns:
      ``step_flops``, ``refresh_stats_flops``, ``refresh_eigh_flops``,
      ``refresh_subspace_flops``, ``amortised_eigh_flops``, ``amortised_subspace_flops`` and,
      with ``model_params``, ``train_flops`` and the ratios ``step_over_train``,
      ``amortised_eigh_over_train`` and ``amortised_subspace_over_train``.

    Raises:
      ValueError: a ``factor`` other than ``"lowrank_diag"`` (the other kinds cost
        differently and are not counted).
    """
    if factor != "lowrank_diag":
        raise ValueError(f"gift_flops: factor={factor!r} is not supported; allowed values: "
                         "('lowrank_diag',) (the only kind whose FLOPs are counted)")
    k = rank + oversample
    step = layers * (8 * n * rank * m + 6 * n * m)
    stats = layers * 2 * tokens_per_device * n * n
    eigh = layers * (9 * n**3 + 14 * n * rank**2)
    sub = layers * ((iters + 2) * 2 * n * n * k + (iters + 1) * 4 * n * k * k + 14 * n * rank**2)
    out = {
        "step_flops": float(step), "refresh_stats_flops": float(stats),
        "refresh_eigh_flops": float(eigh), "refresh_subspace_flops": float(sub),
        "amortised_eigh_flops": float(step + (stats + eigh) / refresh_every),
        "amortised_subspace_flops": float(step + (stats + sub) / refresh_every),
    }
    if model_params:
        train = 6.0 * model_params * tokens_per_device
        out["train_flops"] = train
        for key in ("step_flops", "amortised_eigh_flops", "amortised_subspace_flops"):
            out[key.replace("_flops", "_over_train")] = out[key] / train
    return out


def cost_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of :func:`bench_gift_step`'s results.

    The amortised column names the refresh interval K (``refresh_every``) when every row
    shares one; rows with different K get a ``K`` column instead.

    Args:
      rows: :func:`bench_gift_step`'s dicts, each with a ``case`` label added.

    Returns:
      The table, ending in a newline.

    Raises:
      ValueError: a row without ``refresh_every`` (the K its refresh was amortised over).
    """
    missing = [r.get("case", i) for i, r in enumerate(rows) if "refresh_every" not in r]
    if missing:
        raise ValueError(f"cost_markdown: rows {missing} have no refresh_every (the K their "
                         "refresh was amortised over; bench_gift_step's results hold it)")
    ks = {r["refresh_every"] for r in rows}
    cols = ["case", "devices", "euclidean_s", "gift_s", "gift_refresh_s", "gift_over_euclidean",
            "refresh_over_euclidean", "amortised_over_euclidean"]
    amortised = (f"GIFT / FP8 (refresh amortised, K={next(iter(ks))})" if len(ks) == 1
                 else "GIFT / FP8 (refresh amortised over K)")
    if len(ks) > 1:
        cols.insert(2, "refresh_every")
    titles = {"euclidean_s": "FP8 step (s)", "gift_s": "GIFT-FP8 step (s)",
              "gift_refresh_s": "GIFT refresh step (s)",
              "gift_over_euclidean": "GIFT / FP8 (non-refresh)",
              "refresh_over_euclidean": "refresh / FP8",
              "amortised_over_euclidean": amortised, "refresh_every": "K"}
    return markdown_table([{k: (str(v) if k in ("case", "devices", "refresh_every") else v)
                            for k, v in r.items()} for r in rows], cols, titles) + "\n"
