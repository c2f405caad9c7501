"""Round-trip fidelity of GIFT on real gradients (arXiv 2607.07494, Tables I/II) and the
factor-staleness ablation.

Pipeline (everything on one device, fp32):

1. **Train** a small Llama (``configs/<name>.py``, default ``tiny``) with AdamW for a short run
   with the library's trainer (:class:`Trainer` drives :class:`gift_jax.training.Trainer`:
   the same step, schedule and data order as ``scripts/train.py``), on the configured corpus
   (:func:`gift_jax.data.get_source`).
2. **Per-replica gradients** (:func:`make_replica_fn`): a global batch is split into R local
   batches — R simulated data-parallel replicas.  For each, the local kernel gradient ``G_r``
   of every selected ``nnx.Linear``, its local input second moment ``A_r = E[x xᵀ]``
   (:func:`gift_jax.whitening.capture.with_input_stats`) and, for the two-sided K-FAC row, the local
   output-gradient second moment ``B_r = E[g gᵀ]`` with ``g = ∂ℓ_t/∂y_t`` the per-token gradient
   of the layer output (captured by adding a zero "probe" to each layer's output and
   differentiating with respect to it).  The factors are built from the replica means
   ``Ā = mean_r A_r`` (what the GIFT stage's ``pmean`` gives), so every replica would hold the
   same factor.
3. **Simulated quantized all-reduce** over the R replicas (:func:`simulate_allreduce`), with the
   codec functions of :mod:`gift_jax.comm.codecs` (per-tensor fp8 scales):

   * ``accumulate="fp32"`` (the library default): every replica quantizes ``x_r`` with its own
     scale ``amax(x_r)/fmax`` (or a shared one with ``global_scale``), the decoded values are
     summed in fp32 in replica order, the mean is re-quantized with its own scale and decoded
     — ``Q(mean_r Q(x_r))``.  The real collective (:func:`gift_jax.quantized_psum`) scales
     each reduce-scatter *shard* of the mean separately; with ``global_scale=True`` the shard
     scales are ``pmax``-shared and the two agree (checked in the tests).
   * ``accumulate="fp8"`` (the artifact's NCCL FP8 ring): one shared scale
     ``max_r amax(x_r)/fmax``; the running sum is rounded back to the wire format after every
     hop, ``acc ← Q(acc + Q(x_r))`` (no headroom: a sum beyond ``fmax`` saturates), then
     ``/R`` and the all-gather re-quantization — the same arithmetic as
     ``gift_jax.comm.collectives._fp8_ring_sum``.
   * error feedback (optional): each replica adds its previous local quantization error
     ``x_r − Q(x_r)`` to the next step's input, and the re-quantization error of the mean is
     added back before the next re-quantization (the library's two buffers).  With GIFT the
     buffers live in the whitened frame, which is fixed within a refresh window.

4. **Frames** (rows of Table I/II): Euclidean; output-side only (full ``B``); input-side full
   ``A`` (Cholesky, the artifact); two-sided full (``A ⊗ B``); diagonal ``A``; block-128 ``A``;
   rank-r ``A`` (top-r eigenpairs + diagonal remainder by default, as the artifact).
   ``G → W·G → all-reduce → W⁻¹·``, compared with the exact fp32 mean of the ``G_r``.
5. **Metrics** (:mod:`gift_jax.whitening.fidelity`): relative L2, cosine, max |error|, the
   whitened-frame error ``‖W_A(Ĝ − G)‖/‖W_A G‖`` (always in the frame of the full input-side
   factor of the step's own ``Ā`` — the same yardstick for every row), the Adam-normalised
   update error (``G/(|G|+ε)``) and the Muon-orthogonalised update error (``polar(G)`` by
   Muon's 5-step Newton–Schulz).  L2 metrics are pooled over the layers of a group (the error of the
   concatenated gradient); max |error| is the max over layers; the Muon error is the mean over
   layers.

A float format's per-element relative error does not depend on the frame, so whitening is not
expected to shrink the Euclidean relative L2 by itself; where it helps is the geometry-aware
error (whitened frame, optimizer updates) and when the range of the format is the problem
(saturation, underflow, FP8 accumulation).  We report every frame as measured.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from gift_jax import whitening as wh
from gift_jax.comm.codecs import abs_max, decode_rows, encode_rows, get_codec, leaf_scale_from_amax
from gift_jax.models import model_config_of, next_token_loss
from gift_jax.training.config import complete_config
from gift_jax.training.loop import Trainer as TrainingRun
from gift_jax.utils.linalg import map_matrices
from gift_jax.utils.tree_paths import flat_paths, matches
from gift_jax.whitening.capture import find_linear_layers, kfac_value_and_grad, with_input_stats
from gift_jax.whitening.fidelity import adam_normalise, polar

__all__ = [
    "DEFAULT_GROUPS",
    "DEFAULT_METHODS",
    "Method",
    "Trainer",
    "build_factors",
    "capture_replicas",
    "evaluate_method",
    "iter_captures",
    "make_replica_fn",
    "markdown_table",
    "plot_refresh_schedules",
    "refresh_schedule_experiment",
    "refresh_schedule_markdown",
    "replica_sweep_experiment",
    "replica_sweep_markdown",
    "roundtrip_experiment",
    "simulate_allreduce",
    "staleness_experiment",
    "tensor_quantize",
    "transport_markdown",
    "transport_study",
]

#: Layer groups of the tables: inputs of width d_model, and the MLP down-projection (input d_ff).
DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {
    "d_model-input (q,k,v,o,gate,up)": (
        "*/attn/q_proj", "*/attn/k_proj", "*/attn/v_proj", "*/attn/o_proj",
        "*/mlp/gate_proj", "*/mlp/up_proj",
    ),
    "down_proj (input d_ff)": ("*/mlp/down_proj",),
}


# ============================================================================================
# Config, model, training
# ============================================================================================


class Trainer:
    """The trainer's own loop (:class:`gift_jax.training.Trainer`, no output files) on the
    config's corpus, for experiments that measure between steps.

    Training is the library's: the config's AdamW (or Muon), its warmup + decay schedule over
    ``schedule_steps`` (default ``train.num_steps``), clipping, the data-parallel step over
    all devices with ``comm.codec``/``comm.method`` as configured (``fp32``/``none`` in the
    experiments' configs: exact gradients).  ``seed`` sets both the initialisation and the
    data order.  :meth:`batch` gives batches of any size (deterministic in ``(seed, step,
    stream)``) so that the replica captures can use a larger batch than the optimizer steps.
    """

    def __init__(self, config, *, schedule_steps: int | None = None, seed: int | None = None,
                 data: str | None = None, log_every: int = 50):
        config = complete_config(config)
        self.seed = int(config.train.seed if seed is None else seed)
        with config.unlocked():
            config.train.num_steps = int(schedule_steps or config.train.num_steps)
            config.train.seed = config.data.shuffle_seed = self.seed
            config.train.log_every = max(int(log_every), 1)
            config.train.eval_every = config.train.diagnostics_every = 0
            config.train.workdir = ""  # no output files
            if data:
                config.data.source = data
        self.config = config
        self.model_config = model_config_of(config.model)
        self.seq_len = int(config.train.seq_len)
        self.global_batch = int(config.train.global_batch_size)
        self.run = TrainingRun(config, workdir=None)
        self.graphdef = self.run.program.model_def.graphdef
        self._source = None

    @property
    def step(self) -> int:
        return self.run.step

    @property
    def params(self):
        """The current parameters on one device, outside the trainer's mesh (the captures run
        there)."""
        return jax.device_put(jax.device_get(self.run.params), jax.devices()[0])

    @property
    def losses(self) -> list[float]:
        """Mean training loss of every logged window so far."""
        return [r["loss"] for r in self.run.history if "loss" in r]

    @property
    def source(self):
        if self._source is None:
            from gift_jax.data import get_source

            self._source = get_source(self.config.data.source,
                                      tokenizer=self.config.data.tokenizer)
        return self._source

    def batch(self, global_batch: int, step: int, stream: int = 0) -> np.ndarray:
        """int32 [global_batch, seq_len + 1] training batch ``step`` of stream ``stream``
        (stream 0 at the training batch size is the batch the trainer steps on).

        Args:
          global_batch: sequences in the batch.
          step: the batch's index in its stream.
          stream: 0: the training order; any other value offsets the data seed by
            ``7919·stream`` (another order, e.g. the replica captures' stream 1).

        Returns:
          The token windows, ``seq_len + 1`` tokens each (inputs and next-token targets).
        """
        from gift_jax.data import batch_iterator

        it = batch_iterator(self.source, "train", global_batch, self.seq_len,
                            seed=self.seed + 7919 * stream, start_step=step)
        return np.asarray(next(it), np.int32)

    def advance(self, steps: int, verbose: bool = False) -> None:
        """Run ``steps`` optimizer steps (never past ``schedule_steps``).

        Args:
          steps: the number of steps; ``<= 0`` does nothing.
          verbose: print the loss of every step that is a multiple of ``log_every``.
        """
        if steps <= 0:
            return
        logged = len(self.run.history)
        self.run.run(steps)
        if verbose:
            for r in self.run.history[logged:]:
                if "loss" in r and r["step"] % self.config.train.log_every == 0:
                    print(f"  step {r['step']}: loss {r['loss']:.4f}", flush=True)

    def close(self) -> None:
        self.run.close()


# ============================================================================================
# Per-replica gradients and statistics
# ============================================================================================

class ReplicaCapture(NamedTuple):
    """Per-replica quantities of one step; paths are kernel paths (``…/kernel``)."""

    loss: jax.Array  # (R,) local losses
    grads: dict[str, jax.Array]  # path -> (R, n, m) local kernel gradients
    a: dict[str, jax.Array]  # path -> (R, n, n) local E[x xᵀ]
    b: dict[str, jax.Array]  # path -> (R, m, m) local E[g gᵀ] (empty without output stats)


def make_replica_fn(graphdef, layers: Sequence[str], replicas: int, *,
                    output_stats: bool = False) -> Callable:
    """Jitted ``fn(params, tokens[R·b, T+1]) → ReplicaCapture`` (R simulated replicas).

    Per replica: ``A_r`` from :func:`gift_jax.whitening.capture.with_input_stats`; with
    ``output_stats`` both sides from :func:`gift_jax.whitening.capture.kfac_value_and_grad` in
    one backward pass, ``B_r`` the per-token ``N·Σ_t δ_t δ_tᵀ`` of the local mean loss over its
    N = b·T tokens.

    Args:
      graphdef: the model's ``nnx`` graph definition (:attr:`Trainer.graphdef`).
      layers: patterns of the captured ``nnx.Linear`` layers.
      replicas: R; the token batch is split into R equal local batches, in order.
      output_stats: also capture ``B_r`` (``ReplicaCapture.b``, empty otherwise).

    Returns:
      The jitted function; it raises ``ValueError`` (at trace time) for a batch whose size
      is not a multiple of R.
    """
    layers = tuple(layers)

    def local(params, tokens):
        model = nnx.merge(graphdef, params)
        paths = list(find_linear_layers(model, layers))
        if output_stats:
            (loss, (stats, bstats)), g = kfac_value_and_grad(next_token_loss, layers)(
                model, tokens)
        else:
            fn = with_input_stats(next_token_loss, layers)
            (loss, stats), g = jax.value_and_grad(
                lambda p: fn(nnx.merge(graphdef, p), tokens), has_aux=True)(params)
            bstats = {}
        flat = flat_paths(g)
        grads = {p: flat[p] for p in paths}
        return loss, grads, stats, bstats

    @jax.jit
    def fn(params, tokens):
        if tokens.shape[0] % replicas:
            raise ValueError(f"global batch {tokens.shape[0]} not divisible by R={replicas}")
        tok = tokens.reshape(replicas, -1, tokens.shape[-1])
        loss, grads, a, b = jax.vmap(local, in_axes=(None, 0))(params, tok)
        return ReplicaCapture(loss, grads, a, b)

    return fn


def capture_replicas(trainer: Trainer, fn: Callable, global_batch: int,
                     stream: int = 1) -> ReplicaCapture:
    """Run ``fn`` (from :func:`make_replica_fn`) on capture batch ``trainer.step``.

    Args:
      trainer: the experiment trainer (its current step and parameters).
      fn: from :func:`make_replica_fn`.
      global_batch: ``R · local batch`` sequences.
      stream: the batch stream (:meth:`Trainer.batch`); the default 1 is independent of the
        training batches.

    Returns:
      The :class:`ReplicaCapture`, computed (blocked on).
    """
    tokens = trainer.batch(global_batch, trainer.step, stream=stream)
    return jax.block_until_ready(fn(trainer.params, jnp.asarray(tokens)))


# ============================================================================================
# Simulated quantized all-reduce
# ============================================================================================


def tensor_scale(x: jax.Array, codec) -> jax.Array:
    """Per-tensor scale ``amax(x)/fmax`` (1 for zero, NaN for non-finite), as the codec.

    Args:
      x: the tensor, any shape.
      codec: a codec name or :class:`~gift_jax.comm.codecs.Codec`.

    Returns:
      The fp32 scale.
    """
    codec = get_codec(codec)
    return leaf_scale_from_amax(abs_max(x.reshape(-1)), codec)


def tensor_quantize(x: jax.Array, codec, scale: jax.Array) -> jax.Array:
    """Decode(encode(x)) with one given fp32 scale for the whole tensor (saturating).

    Args:
      x: the tensor, any shape.
      codec: a codec name or :class:`~gift_jax.comm.codecs.Codec`.
      scale: the scale of every element (a scalar).

    Returns:
      The decoded fp32 values, of ``x``'s shape.
    """
    codec = get_codec(codec)
    flat = x.astype(jnp.float32).reshape(-1)
    b = codec.row_size
    rows = -(-flat.shape[0] // b)
    padded = jnp.pad(flat, (0, rows * b - flat.shape[0])).reshape(rows, b)
    leaf = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (rows, 1))
    payload, wire = encode_rows(padded, codec, leaf)
    return decode_rows(payload, wire, codec, leaf).reshape(-1)[: flat.shape[0]].reshape(x.shape)


class AllReduceResult(NamedTuple):
    mean: jax.Array  # decoded mean, identical on every replica
    local_err: jax.Array  # (R, …) x_r − Q(x_r) (error-feedback buffer 1)
    shard_err: jax.Array  # (…) mean − Q(mean) (error-feedback buffer 2)


#: FP8 accumulation algorithms of :func:`simulate_allreduce` (``accumulate="fp8"``), every
#: partial sum stored in the wire format with one shared per-tensor scale, added in fp32:
#:
#: * ``"sequential"``: the whole tensor's running sum passes the replicas in order (R − 1
#:   roundings), then ``/R`` and the mean re-quantized with its own scale (the studies' ring
#:   until issue #46; ``gift_jax.comm.collectives._fp8_ring_sum`` is its per-shard form);
#: * ``"nccl"``: NCCL's ring all-reduce: the tensor in R chunks, chunk ``c``'s partial sum
#:   starting at replica ``c + 1`` and passing the others in ring order (R − 1 roundings,
#:   each chunk in its own order), the owner's FP8 sum all-gathered as it is (no further
#:   rounding), then ``/R``;
#: * ``"tree"``: a binary reduction tree (log₂ R levels of pairwise sums, each rounded), the
#:   root's FP8 sum broadcast as it is, then ``/R``;
#: * ``"nccl_headroom"``, ``"tree_headroom"``: the same with the shared scale ``R`` times
#:   larger (a sum of R values never saturates; every value is coarser).
RINGS = ("sequential", "nccl", "nccl_headroom", "tree", "tree_headroom")


def _fp8_sum(q: jax.Array, codec, scale: jax.Array, ring: str) -> jax.Array:
    """The FP8-accumulated sum over the leading axis of the decoded values ``q`` (R, …), every
    partial sum re-encoded with ``scale`` (see :data:`RINGS`)."""
    r = q.shape[0]
    requant = lambda x: tensor_quantize(x, codec, scale)
    if ring == "sequential":
        total = q[0]
        for i in range(1, r):
            total = requant(total + q[i])
        return total
    if ring.startswith("tree"):
        vals = q
        while vals.shape[0] > 1:
            k = vals.shape[0] // 2
            pairs = requant(vals[:k] + vals[k:2 * k])
            vals = pairs if vals.shape[0] % 2 == 0 else jnp.concatenate(
                [pairs, vals[2 * k:]])  # an odd one out joins the next level as it is
        return vals[0]
    # the NCCL ring: chunk c's sum starts at replica (c + 1) % R and ends at its owner c
    shape = q.shape[1:]
    flat = q.reshape(r, -1)
    n = flat.shape[1]
    per = -(-n // r)
    flat = jnp.pad(flat, ((0, 0), (0, per * r - n))).reshape(r, r, per)  # (replica, chunk, …)
    chunks = jnp.arange(r)
    order = (chunks[None, :] + 1 + jnp.arange(r)[:, None]) % r  # (hop, chunk) → replica
    hops = flat[order, chunks[None, :]]  # (hop, chunk, per)
    total = hops[0]
    for h in range(1, r):
        total = requant(total + hops[h])  # every hop of every chunk: one shared scale
    return total.reshape(-1)[:n].reshape(shape)


@functools.partial(jax.jit, static_argnames=("codec", "accumulate", "global_scale", "ring"))
def simulate_allreduce(xs: jax.Array, codec: str = "fp8_e4m3", accumulate: str = "fp32",
                       global_scale: bool = False, local_err: jax.Array | None = None,
                       shard_err: jax.Array | None = None,
                       scales: jax.Array | None = None,
                       ring: str = "sequential") -> AllReduceResult:
    """Quantized mean over the leading (replica) axis of ``xs`` (R, …); see the module doc.

    ``scales`` (R,) overrides the senders' scales (e.g. stale synced scales); ``local_err`` /
    ``shard_err`` are the error-feedback buffers of the previous step (or None).

    A deliberately independent oracle of the *reduction*, sharing the *element math*: every
    quantization is the codecs' own (:func:`tensor_scale`, :func:`tensor_quantize` call
    ``abs_max``, ``leaf_scale_from_amax``, ``encode_rows`` and ``decode_rows`` of
    :mod:`gift_jax.comm.codecs`), while the reduction is written out on one device without
    buckets, shards or collectives: the mean is re-quantized as one tensor (the collective
    scales each shard), and the FP8 ring is a plain loop over replicas. So it checks the
    collectives' structure rather than repeating it, and the figures of docs/gift_results.md
    do not depend on the bucket layout. ``tests/test_experiments_gift.py`` compares it with
    :func:`gift_jax.quantized_psum` in ``jax.shard_map`` (``global_scale=True``, both
    ``accumulate`` modes): equal up to the fp32 summation order.

    Args:
      xs: the replicas' values, (R, …).
      codec: the wire format's name.
      accumulate: ``"fp32"`` (the decoded values summed in fp32) or ``"fp8"`` (the ring: the
        running sum re-quantized after every hop with one shared scale).
      global_scale: one sender scale for every replica (the max of theirs), as ``"fp8"``
        always has.
      local_err: (R, …) error-feedback buffer, added to ``xs`` first; ``None``: none.
      shard_err: (…) error-feedback buffer, added to the mean before it is re-quantized;
        ``None``: none.
      scales: (R,) the senders' scales, in place of the computed ones (and of
        ``global_scale``); ``None``: computed from ``xs``.
      ring: with ``accumulate="fp8"``, the accumulation algorithm (one of :data:`RINGS`);
        the variants other than ``"sequential"`` keep no shard error (zeros: no owner
        re-quantizes the mean).

    Returns:
      :class:`AllReduceResult`: ``mean`` (the decoded mean), ``local_err`` (``x_r − Q(x_r)``
      of the inputs with the previous buffer added) and ``shard_err`` (``mean − Q(mean)``),
      the next step's buffers.

    Raises:
      ValueError: ``accumulate`` other than ``"fp32"`` or ``"fp8"``.
    """
    if accumulate not in ("fp32", "fp8"):
        raise ValueError(f"accumulate must be 'fp32' or 'fp8', got {accumulate!r}")
    if ring not in RINGS:
        raise ValueError(f"ring must be one of {RINGS}, got {ring!r}")
    xs = xs.astype(jnp.float32)
    r = xs.shape[0]
    if local_err is not None:
        xs = xs + local_err
    if scales is None:
        scales = jax.vmap(lambda x: tensor_scale(x, codec))(xs)
        if global_scale or accumulate == "fp8":
            scales = jnp.broadcast_to(jnp.max(scales), (r,))
        if accumulate == "fp8" and ring.endswith("headroom"):
            scales = scales * r
    q = jax.vmap(lambda x, s: tensor_quantize(x, codec, s))(xs, scales)
    if accumulate == "fp32":
        total = q[0]
        for i in range(1, r):
            total = total + q[i]
    else:  # the partial sums travel in the wire format with the shared scale
        total = _fp8_sum(q, codec, scales[0], ring)
        if ring != "sequential":  # the reduced FP8 sum is gathered as it is
            mean = total / r
            return AllReduceResult(mean, xs - q, jnp.zeros_like(mean))
    mean = total / r
    if shard_err is not None:
        mean = mean + shard_err
    s_out = tensor_scale(mean, codec)
    out = tensor_quantize(mean, codec, s_out)
    return AllReduceResult(out, xs - q, mean - out)


# ============================================================================================
# Frames (rows of Table I/II)
# ============================================================================================


@dataclasses.dataclass(frozen=True)
class Method:
    """One row: which factor whitens the gradient before the all-reduce."""

    name: str
    kind: str  # "euclidean" | "output" | "input" | "two_sided"
    factor: str = "full_cholesky"  # whitening.FACTOR_KINDS for the input side
    rank: int = 32
    block_size: int = 128


def default_methods(ranks: Iterable[int] = (8, 16, 32, 64),
                    remainder: str = "diag") -> tuple[Method, ...]:
    """The frames of Table I/II (:data:`DEFAULT_METHODS` with the default arguments).

    Args:
      ranks: the ranks r of the low-rank rows, one row each.
      remainder: ``"diag"``: top-r eigenpairs + diagonal remainder (``lowrank_diag``, the
        artifact's); anything else: isotropic remainder (``lowrank_isotropic``).

    Returns:
      Euclidean, output-side only, input-side full, two-sided full, diagonal, block-128, and
      the rank-r rows, in this order.
    """
    lr = "lowrank_diag" if remainder == "diag" else "lowrank_isotropic"
    return (
        Method("Euclidean", "euclidean"),
        Method("output-side only (full B)", "output"),
        Method("input-side full A", "input", "full_cholesky"),
        Method("two-sided full (A⊗B)", "two_sided"),
        Method("diagonal A", "input", "diag"),
        Method("block-128 A", "input", "block_diag", block_size=128),
        *(Method(f"rank-{r} A", "input", lr, rank=r) for r in ranks),
    )


DEFAULT_METHODS = default_methods()


def _stack(d: dict[str, jax.Array], paths: Sequence[str]) -> jax.Array:
    return jnp.stack([d[p] for p in paths])


@functools.partial(jax.jit, static_argnames=("method", "damping", "damping_mode"))
def build_factors(method: Method, a: jax.Array | None, b: jax.Array | None, *,
                  damping: float = 1e-3, damping_mode: str = "relative") -> Any:
    """Stacked factor (leading layer axis) of ``method`` from stacked means ``a`` (L, n, n) and
    ``b`` (L, m, m); ``None`` for the Euclidean frame.

    Args:
      method: the frame (static).
      a: (L, n, n) mean input second moments (only their shape for ``"output"``; may be
        ``None`` for ``"euclidean"``).
      b: (L, m, m) mean output-gradient second moments, read by ``"output"`` and
        ``"two_sided"`` only.
      damping: ε, relative to tr/n (``damping_mode="relative"``) or absolute.
      damping_mode: ``"relative"`` or ``"absolute"``.

    Returns:
      ``None`` (``"euclidean"``), the input-side factor of ``method.factor`` (``"input"``),
      or a :class:`~gift_jax.whitening.KroneckerFactor` of the input side (the identity for
      ``"output"``) and the full Cholesky factor of ``b``.
    """
    kw = dict(damping=damping, damping_mode=damping_mode)

    def one(mat, kind, rank=32, block=128):
        return map_matrices(
            lambda x: wh.make_factor(x, kind, rank=rank, block_size=block, **kw)[0], mat)

    if method.kind == "euclidean":
        return None
    if method.kind == "output":
        fb = one(b, "full_cholesky")
        ident = wh.DiagFactor(jnp.ones(a.shape[:2], jnp.float32))
        return wh.KroneckerFactor(ident, fb)
    fa = one(a, method.factor, method.rank, method.block_size)
    if method.kind == "two_sided":
        return wh.KroneckerFactor(fa, one(b, "full_cholesky"))
    return fa


@jax.jit
def _whiten_stack(factor, g):  # factor (L,…), g (L, R, n, m)
    return jax.vmap(lambda f, x: jax.vmap(lambda y: wh.whiten(f, y))(x))(factor, g)


@jax.jit
def _unwhiten_stack(factor, g):  # g (L, n, m)
    return jax.vmap(wh.unwhiten)(factor, g)


@functools.partial(jax.jit, static_argnames=("codec", "accumulate", "global_scale"))
def _allreduce_stack(xs, codec, accumulate, global_scale, local_err, shard_err):
    return jax.vmap(lambda x, le, se: simulate_allreduce(
        x, codec, accumulate, global_scale, le, se))(xs, local_err, shard_err)


@jax.jit
def _layer_metrics(approx, ref, metric_factor):
    """Per-layer pooled-metric ingredients for stacked (L, n, m) arrays."""

    def one(a, r, f):
        e = a - r
        na, nr = adam_normalise(a), adam_normalise(r)
        we, wr = wh.whiten(f, e), wh.whiten(f, r)
        # Muon's own orthogonalisation (quintic Newton–Schulz, 5 steps): matmuls only, cheap
        # on CPU and well defined for any finite input (LAPACK's SVD is slow to run here)
        pa, pr = polar(a, "newton_schulz"), polar(r, "newton_schulz")
        return dict(
            err2=jnp.sum(e * e), ref2=jnp.sum(r * r), dot=jnp.vdot(a, r), app2=jnp.sum(a * a),
            maxabs=jnp.max(jnp.abs(e)), refmax=jnp.max(jnp.abs(r)),
            werr2=jnp.sum(we * we), wref2=jnp.sum(wr * wr),
            aerr2=jnp.sum((na - nr) ** 2), aref2=jnp.sum(nr * nr),
            muon=jnp.linalg.norm(pa - pr) / jnp.linalg.norm(pr),
        )

    return jax.vmap(one)(approx, ref, metric_factor)


METRICS = ("rel_l2", "cosine", "max_abs", "whitened", "adam", "muon")
METRIC_TITLES = {
    "rel_l2": "rel. L2", "cosine": "cosine", "max_abs": "max abs", "whitened": "whitened-frame",
    "adam": "Adam update", "muon": "Muon update", "cum_rel_l2": "cum. rel. L2 (Σ steps)",
}


def pool(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
    """Pool per-layer ingredients (dicts of (L,) arrays, one per layer stack) into metrics.

    Args:
      parts: one step's ingredient dicts (``err2``, ``ref2``, ``dot``, ``app2``, ``maxabs``,
        ``werr2``, ``wref2``, ``aerr2``, ``aref2``, ``muon``), one per layer stack.

    Returns:
      The :data:`METRICS`: ``rel_l2``, ``cosine``, ``whitened`` and ``adam`` pooled over
      every layer (ratios of summed squares), ``max_abs`` the max over the layers, ``muon``
      the mean over the layers.
    """
    cat = {k: np.concatenate([np.asarray(p[k], np.float64) for p in parts]) for k in parts[0]}
    return {
        "rel_l2": math.sqrt(cat["err2"].sum() / cat["ref2"].sum()),
        "cosine": cat["dot"].sum() / math.sqrt(cat["app2"].sum() * cat["ref2"].sum()),
        "max_abs": float(cat["maxabs"].max()),
        "whitened": math.sqrt(cat["werr2"].sum() / cat["wref2"].sum()),
        "adam": math.sqrt(cat["aerr2"].sum() / cat["aref2"].sum()),
        "muon": float(cat["muon"].mean()),
    }


# ============================================================================================
# One configuration over consecutive steps
# ============================================================================================


def _shape_groups(paths: Sequence[str], grads: dict[str, jax.Array]) -> list[list[str]]:
    by: dict[tuple, list[str]] = {}
    for p in paths:
        by.setdefault(tuple(grads[p].shape[1:]), []).append(p)
    return list(by.values())


_FACTOR_CACHE: dict[tuple, Any] = {}


def _cached_factor(method: Method, cap: ReplicaCapture, grp: Sequence[str], damping: float):
    """Factors depend on (method, step, layers) only: build them once per experiment (each
    entry holds its capture, so the experiments drop the cache when they return:
    :func:`_drops_factor_cache`)."""
    key = (method, id(cap), tuple(grp), damping)
    hit = _FACTOR_CACHE.get(key)
    if hit is not None and hit[0] is cap:
        return hit[1]
    a = jnp.mean(_stack(cap.a, grp), axis=1)
    b = jnp.mean(_stack(cap.b, grp), axis=1) if method.kind in ("output", "two_sided") else None
    f = build_factors(method, a, b, damping=damping)
    if len(_FACTOR_CACHE) > 512:
        _FACTOR_CACHE.clear()
    _FACTOR_CACHE[key] = (cap, f)
    return f


def _drops_factor_cache(experiment: Callable) -> Callable:
    """Empties :func:`_cached_factor`'s cache when ``experiment`` returns: its entries hold
    their captures (2 GB each for ``configs/small.py`` at R = 64), which would otherwise stay
    in memory after the experiment, up to 512 of them."""

    @functools.wraps(experiment)
    def run(*args, **kwargs):
        try:
            return experiment(*args, **kwargs)
        finally:
            _FACTOR_CACHE.clear()

    return run


def evaluate_method(
    captures: Sequence[ReplicaCapture],
    paths: Sequence[str],
    method: Method,
    *,
    codec: str = "fp8_e4m3",
    accumulate: str = "fp32",
    global_scale: bool = False,
    error_feedback: bool = False,
    factor_step: int = 0,
    damping: float = 1e-3,
) -> dict[str, Any]:
    """Metrics of one frame over consecutive captured steps.

    The factor is built from the capture at index ``factor_step`` (a refresh) and reused for
    every step; the metric frame of each step is the full input-side factor of that step's own
    ``Ā``.

    Args:
      captures: the captured steps, consecutive, with the same layers.
      paths: the kernel paths measured (layers of one shape are stacked).
      method: the frame.
      codec: the wire format.
      accumulate: ``"fp32"`` or ``"fp8"`` (:func:`simulate_allreduce`).
      global_scale: one shared sender scale (with fp32 accumulation).
      error_feedback: carry both error-feedback buffers from step to step (in the frame's
        coordinates).
      factor_step: the index in ``captures`` of the capture the factor is built from.
      damping: the relative damping of the frame's and of the metric frame's factors.

    Returns:
      ``{"steps": [metrics per step], "mean": metrics averaged over steps,
      "cum_rel_l2": ‖Σ_t(Ĝ_t − G_t)‖/‖Σ_t G_t‖}``, the metrics those of :func:`pool`.
    """
    groups = _shape_groups(paths, captures[0].grads)
    ref_cap = captures[factor_step]
    facts = [_cached_factor(method, ref_cap, grp, damping) for grp in groups]
    metric = Method("metric", "input", "full_cholesky")
    metric_facts = [[_cached_factor(metric, cap, grp, damping) for grp in groups]
                    for cap in captures]
    ef = [None] * len(groups)
    per_step = []
    cum_err = [0.0] * len(groups)
    cum_ref = [0.0] * len(groups)
    for t, cap in enumerate(captures):
        parts = []
        for gi, grp in enumerate(groups):
            g = _stack(cap.grads, grp)  # (L, R, n, m)
            x = g if facts[gi] is None else _whiten_stack(facts[gi], g)
            le, se = ef[gi] if (error_feedback and ef[gi] is not None) else (
                jnp.zeros_like(x), jnp.zeros_like(x[:, 0]))
            res = _allreduce_stack(x, codec, accumulate, global_scale, le, se)
            if error_feedback:
                ef[gi] = (res.local_err, res.shard_err)
            approx = res.mean if facts[gi] is None else _unwhiten_stack(facts[gi], res.mean)
            ref = jnp.mean(g, axis=1)
            cum_err[gi] = cum_err[gi] + (approx - ref)
            cum_ref[gi] = cum_ref[gi] + ref
            parts.append(jax.device_get(_layer_metrics(approx, ref, metric_facts[t][gi])))
        per_step.append(pool(parts))
    mean = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
    cum = math.sqrt(sum(float(jnp.sum(e * e)) for e in cum_err)
                    / sum(float(jnp.sum(r * r)) for r in cum_ref))
    return {"steps": per_step, "mean": mean, "cum_rel_l2": cum}


def group_paths(capture: ReplicaCapture, patterns: Sequence[str]) -> list[str]:
    """The kernel paths of a capture that match ``patterns``.

    Args:
      capture: a :class:`ReplicaCapture`.
      patterns: layer patterns (:func:`gift_jax.utils.tree_paths.matches`).

    Returns:
      The matching paths, in the capture's order.
    """
    return [p for p in capture.grads if matches(p, patterns)]


# ============================================================================================
# Experiments
# ============================================================================================


def _fmt(x: float) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1):
        return str(int(x))
    if x != x:
        return "nan"
    return f"{x:.4f}" if 0.01 <= abs(x) < 100 else f"{x:.3e}"


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
                   titles: dict[str, str] | None = None) -> str:
    """A markdown table; numbers as integers where integral (and ≥ 1 in magnitude), with 4
    decimals in [0.01, 100), else in scientific notation; strings as they are.

    Args:
      rows: one dict per row, holding every column.
      columns: the keys shown, in order.
      titles: the header of a key; ``None`` or a missing key: the key itself.

    Returns:
      The table, without a trailing newline.
    """
    titles = titles or {}
    head = "| " + " | ".join(titles.get(c, c) for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def train_and_capture(
    config: ml_collections.ConfigDict,
    *,
    train_steps: int = 200,
    capture_steps: int = 4,
    replicas: int = 8,
    local_batch: int = 2,
    layers: Sequence[str] = ("*/attn/*_proj", "*/mlp/*_proj"),
    output_stats: bool = True,
    seed: int | None = None,
    log_every: int = 50,
    schedule_steps: int | None = None,
    trainer: Trainer | None = None,
) -> tuple[Trainer, list[ReplicaCapture]]:
    """Train ``train_steps`` steps, then capture ``capture_steps`` consecutive steps of R
    replicas (the optimizer keeps stepping with the exact gradient in between).

    Args:
      config: the training config (e.g. ``configs/tiny.py``).
      train_steps: the optimizer steps before the first capture.
      capture_steps: the number of consecutive captured steps.
      replicas: R.
      local_batch: sequences per replica.
      layers: patterns of the captured layers.
      output_stats: also capture the output side ``B_r`` (:func:`make_replica_fn`).
      seed: the init and data-order seed; ``None``: the config's ``train.seed``.
      log_every: the trainer's log interval; the logged losses are printed when > 0.
      schedule_steps: the learning-rate schedule's length; ``None``: the larger of
        ``train_steps + capture_steps`` and the config's ``train.num_steps``.
      trainer: a trainer to continue from its current step (``config``, ``seed`` and
        ``schedule_steps`` are then unused); ``None``: a new one.

    Returns:
      ``(trainer, captures)``: the trainer at the last captured step and one
      :class:`ReplicaCapture` per captured step.
    """
    if trainer is None:
        trainer = Trainer(config, seed=seed, log_every=log_every,
                          schedule_steps=schedule_steps or max(train_steps + capture_steps,
                                                               config.train.num_steps))
    trainer.advance(train_steps, verbose=log_every > 0)
    return trainer, list(iter_captures(trainer, capture_steps, replicas=replicas,
                                       local_batch=local_batch, layers=layers,
                                       output_stats=output_stats))


def iter_captures(trainer: Trainer, capture_steps: int, *, replicas: int, local_batch: int,
                  layers: Sequence[str] = ("*/attn/*_proj", "*/mlp/*_proj"),
                  output_stats: bool = True) -> Iterator[ReplicaCapture]:
    """Capture ``capture_steps`` consecutive steps of R replicas from the trainer's current
    step, one at a time (the optimizer steps with the exact gradient in between).

    A capture holds ``R·n·m`` gradient floats and ``R·n²`` factor floats per layer (and
    ``R·m²`` with ``output_stats``): 2 GB for the 4.9M-parameter ``configs/small.py`` at R = 64.
    Consuming them one by one (:func:`replica_sweep_experiment` does) keeps one in memory
    instead of ``capture_steps``.

    Args:
      trainer: the experiment trainer; it ends at the last captured step.
      capture_steps: the number of consecutive captured steps.
      replicas, local_batch, layers, output_stats: as :func:`train_and_capture`.

    Yields:
      One :class:`ReplicaCapture` per captured step.
    """
    fn = make_replica_fn(trainer.graphdef, layers, replicas, output_stats=output_stats)
    for i in range(capture_steps):
        if i:
            trainer.advance(1)
        yield capture_replicas(trainer, fn, replicas * local_batch)


@_drops_factor_cache
def roundtrip_experiment(
    captures: Sequence[ReplicaCapture],
    groups: dict[str, Sequence[str]] | None = None,
    methods: Sequence[Method] = DEFAULT_METHODS,
    codecs: Sequence[str] = ("fp8_e4m3", "fp8_e5m2"),
    accumulations: Sequence[str] = ("fp32", "fp8"),
    error_feedback: Sequence[bool] = (False, True),
    damping: float = 1e-3,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """Every (group, codec, accumulation, error feedback, method) → one result row.

    Rows carry the step-0 metrics (the one-step round trip of Table I/II: no error feedback
    can act yet) under ``"step0"``, the mean over the captured steps under ``"mean"`` and the
    cumulative error of the sum over the steps under ``"cum_rel_l2"``.

    Args:
      captures: consecutive captured steps (:func:`train_and_capture`); the factors are
        built from the first.
      groups: ``{group name: layer patterns}``; ``None``: :data:`DEFAULT_GROUPS`.
      methods: the frames.
      codecs: the wire formats.
      accumulations: ``"fp32"`` and/or ``"fp8"``.
      error_feedback: the error-feedback settings; ``True`` is skipped with a single capture.
      damping: the relative damping of the factors.
      verbose: print the time of each (group, codec, accumulation, error feedback).

    Returns:
      One row per combination: ``group``, ``codec``, ``accumulate``, ``error_feedback``,
      ``method`` (its name), ``layers`` (their number), ``step0`` and ``mean`` (metrics of
      :func:`pool`) and ``cum_rel_l2``.
    """
    groups = dict(groups or DEFAULT_GROUPS)
    rows = []
    for gname, pats in groups.items():
        paths = group_paths(captures[0], pats)
        for codec in codecs:
            for acc in accumulations:
                for ef in error_feedback:
                    if ef and len(captures) < 2:
                        continue
                    t0 = time.perf_counter()
                    for m in methods:
                        res = evaluate_method(captures, paths, m, codec=codec, accumulate=acc,
                                              error_feedback=ef, damping=damping)
                        rows.append(dict(group=gname, codec=codec, accumulate=acc,
                                         error_feedback=ef, method=m.name, layers=len(paths),
                                         step0=res["steps"][0], mean=res["mean"],
                                         cum_rel_l2=res["cum_rel_l2"]))
                    if verbose:
                        print(f"  {gname} | {codec} | acc {acc} | EF {ef}: "
                              f"{time.perf_counter() - t0:.1f}s", flush=True)
    return rows


def first_replicas(capture: ReplicaCapture, replicas: int) -> ReplicaCapture:
    """The capture as if only its first ``replicas`` replicas had run (same local batch).

    Args:
      capture: a :class:`ReplicaCapture` of R replicas.
      replicas: how many to keep, in ``[1, R]``.

    Returns:
      The truncated :class:`ReplicaCapture`.

    Raises:
      ValueError: ``replicas`` outside ``[1, R]``.
    """
    if not 1 <= replicas <= capture.loss.shape[0]:
        raise ValueError(f"replicas={replicas} must lie in [1, {capture.loss.shape[0]}] (the "
                         "captured replicas)")
    first = lambda d: {p: x[:replicas] for p, x in d.items()}
    return ReplicaCapture(capture.loss[:replicas], first(capture.grads), first(capture.a),
                          first(capture.b))


#: The frames of the replica sweep (#23): Euclidean, the artifact's full input factor, and
#: GIFT's rank-32 factor.
SWEEP_METHODS = ("Euclidean", "input-side full A", "rank-32 A")


def replica_sweep_experiment(
    captures: Iterable[ReplicaCapture],
    replica_counts: Sequence[int],
    methods: Sequence[Method] | None = None,
    codecs: Sequence[str] = ("fp8_e4m3", "fp8_e5m2"),
    accumulations: Sequence[str] = ("fp32", "fp8"),
    damping: float = 1e-3,
    verbose: bool = True,
    groups: dict[str, Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """The one-step round trip at each replica count ``R`` (the first ``R`` replicas of the
    captures: the same local batch, a global batch that grows with ``R``, as when GPUs are
    added). An FP8 ring rounds ``R − 1`` partial sums, so its error grows with ``R``. Each
    captured step is a separate round trip with its own fresh factor; the rows hold the mean
    of their metrics over the steps (``"step0"``, named like :func:`roundtrip_experiment`'s)
    and each step's (``"per_step"``).

    Args:
      captures: from :func:`train_and_capture` or :func:`iter_captures` (consumed one at a
        time), with at least ``max(replica_counts)`` replicas.
      replica_counts: the ``R`` values.
      methods: the frames (default: :data:`SWEEP_METHODS` of :func:`default_methods`).
      codecs, accumulations, damping, groups: as :func:`roundtrip_experiment`.

    Returns:
      :func:`roundtrip_experiment`'s rows (no error feedback), each with ``"replicas"``.
    """
    if methods is None:
        methods = [m for m in default_methods((32,)) if m.name in SWEEP_METHODS]
    parts = {r: [] for r in replica_counts}  # R -> one row list per captured step
    for i, capture in enumerate(captures):
        for r in replica_counts:
            t0 = time.perf_counter()
            parts[r].append(roundtrip_experiment(
                [first_replicas(capture, r)], groups, methods=methods, codecs=codecs,
                accumulations=accumulations, error_feedback=(False,), damping=damping,
                verbose=False))
            if verbose:
                print(f"  step {i}, R={r}: {time.perf_counter() - t0:.1f}s", flush=True)
        del capture  # before the next one is captured
    rows = []
    for r in replica_counts:
        for steps in zip(*parts[r], strict=True):
            per_step = [row["step0"] for row in steps]
            mean = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
            rows.append(dict(steps[0], replicas=r, step0=mean, per_step=per_step,
                             mean=mean, cum_rel_l2=None))
    return rows


def replica_sweep_markdown(rows: Sequence[dict[str, Any]],
                           metrics: Sequence[str] = ("rel_l2", "whitened", "adam")) -> str:
    """Per (group, codec, accumulation): each frame's step-0 error at every ``R``, and the
    change against Euclidean at the same ``R``.

    Args:
      rows: :func:`replica_sweep_experiment`'s rows.
      metrics: keys of the step-0 metrics (:data:`METRICS`); one table line per frame and
        metric.

    Returns:
      One heading and table per (group, codec, accumulation), ending in a newline.
    """
    counts = sorted({r["replicas"] for r in rows})
    out = []
    keys = sorted({(r["group"], r["codec"], r["accumulate"]) for r in rows})
    for g, c, acc in keys:
        sel = [r for r in rows if (r["group"], r["codec"], r["accumulate"]) == (g, c, acc)]
        acc_name = "fp32 accumulation" if acc == "fp32" else "FP8 ring accumulation"
        out.append(f"\n#### {g}, {c}, {acc_name}\n")
        out.append("| frame | metric | " + " | ".join(f"R = {n}" for n in counts) + " |")
        out.append("|---|---|" + "---:|" * len(counts))
        for metric in metrics:
            base = {r["replicas"]: r["step0"][metric] for r in sel if r["method"] == "Euclidean"}
            for name in dict.fromkeys(r["method"] for r in sel):
                vals = {r["replicas"]: r["step0"][metric] for r in sel if r["method"] == name}
                cells = []
                for n in counts:
                    v = vals.get(n)
                    if v is None:
                        cells.append("")
                    elif name == "Euclidean" or not base.get(n):
                        cells.append(_fmt(v))
                    else:
                        cells.append(f"{_fmt(v)} ({100 * (v / base[n] - 1):+.0f} %)")
                out.append(f"| {name} | {METRIC_TITLES[metric]} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot_replica_sweep(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Relative L2 error against ``R`` (log-log), one panel per (group, codec), a line per
    (frame, accumulation): a colour per frame, solid for the FP8 ring, dashed for fp32 sums.

    Args:
      rows: :func:`replica_sweep_experiment`'s rows.
      path: the image file (format from its suffix).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["group"], r["codec"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (g, c) in zip(axes[0], panels, strict=True):
        for acc, style in (("fp32", "--"), ("fp8", "-")):
            for color, name in enumerate(dict.fromkeys(r["method"] for r in rows)):
                sel = sorted((r["replicas"], r["step0"]["rel_l2"]) for r in rows
                             if (r["group"], r["codec"], r["accumulate"], r["method"])
                             == (g, c, acc, name))
                if sel:
                    ax.plot(*zip(*sel, strict=True), style, marker="o", ms=3,
                            color=f"C{color}",
                            label=f"{name}, {'FP8 ring' if acc == 'fp8' else 'fp32 sums'}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas R")
        ax.set_title(f"{g}\n{c}", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("relative L2 error of the mean")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@_drops_factor_cache
def staleness_experiment(
    trainer: Trainer,
    *,
    offsets: Sequence[int] = (0, 1, 2, 4, 6, 8, 12, 16, 20, 24, 30, 36, 42, 49, 60, 70, 80,
                              90, 99),
    windows: Sequence[int] = (10, 25, 50, 100),
    replicas: int = 8,
    local_batch: int = 2,
    patterns: Sequence[str] = ("*/mlp/down_proj",),
    methods: Sequence[Method] | None = None,
    codec: str = "fp8_e4m3",
    accumulate: str = "fp32",
    damping: float = 1e-3,
    verbose: bool = True,
) -> dict[str, Any]:
    """Error vs steps since the factor refresh: the factor is built at the first offset
    (``trainer.step`` now) and reused at ``step + k``; the same step with a fresh factor is the
    reference.  ``windows`` K: mean stale error over the offsets ``k < K`` (a refresh every K
    steps sees k = 0..K−1).

    Args:
      trainer: the experiment trainer; it is advanced to ``trainer.step + max(offsets)``.
      offsets: the sampled k, ints >= 0 that include 0 (the refresh step itself); sorted,
        repeats dropped.
      windows: the refresh intervals K of the summary.
      replicas: R.
      local_batch: sequences per replica.
      patterns: the measured layers.
      methods: the frames; ``None`` (or empty): Euclidean, rank-32 A (``lowrank_diag``) and
        input-side full A.
      codec: the wire format.
      accumulate: ``"fp32"`` or ``"fp8"``.
      damping: the relative damping of the factors.
      verbose: print the progress at each offset.

    Returns:
      ``offsets`` (the sampled k), ``curves`` (per method name, the per-offset metrics
      ``"stale"`` and ``"fresh"``), ``summary`` (per method and K: ``points`` and the means
      over the offsets k < K of ``<metric>_stale`` and ``<metric>_fresh`` for ``rel_l2``,
      ``whitened``, ``adam`` and ``muon``), ``start_step``, ``codec``, ``accumulate`` and
      ``layers``.

    Raises:
      ValueError: ``offsets`` with a negative or non-int entry, or without 0 (the curves'
        k would not be the steps since the refresh).
    """
    bad = [k for k in offsets
           if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0]
    if bad or 0 not in offsets:
        raise ValueError(
            f"staleness_experiment: offsets={tuple(offsets)!r} must be ints >= 0 that include "
            f"0 (the refresh step; k counts the steps since it)"
            + (f"; invalid entries: {bad}" if bad else ""))
    methods = methods or (Method("Euclidean", "euclidean"),
                          Method("rank-32 A", "input", "lowrank_diag", rank=32),
                          Method("input-side full A", "input", "full_cholesky"))
    fn = make_replica_fn(trainer.graphdef, patterns, replicas)
    start = trainer.step
    refresh_cap = None
    curves = {m.name: {"stale": [], "fresh": []} for m in methods}
    done = []
    t0 = time.perf_counter()
    for k in sorted(set(offsets)):
        trainer.advance(start + k - trainer.step)
        cap = capture_replicas(trainer, fn, replicas * local_batch)
        if refresh_cap is None:
            refresh_cap = cap
        paths = group_paths(cap, patterns)
        for m in methods:
            stale = evaluate_method([refresh_cap, cap], paths, m, codec=codec,
                                    accumulate=accumulate, factor_step=0, damping=damping)
            fresh = evaluate_method([cap], paths, m, codec=codec, accumulate=accumulate,
                                    damping=damping)
            curves[m.name]["stale"].append(stale["steps"][1])
            curves[m.name]["fresh"].append(fresh["steps"][0])
        done.append(k)
        if verbose:
            print(f"  staleness k={k} (step {trainer.step}) "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    summary = []
    for m in methods:
        for kk in windows:
            idx = [i for i, k in enumerate(done) if k < kk]
            if not idx:
                continue
            row = dict(method=m.name, K=kk, points=len(idx))
            for metric in ("rel_l2", "whitened", "adam", "muon"):
                st = np.mean([curves[m.name]["stale"][i][metric] for i in idx])
                fr = np.mean([curves[m.name]["fresh"][i][metric] for i in idx])
                row[f"{metric}_stale"], row[f"{metric}_fresh"] = float(st), float(fr)
            summary.append(row)
    return {"offsets": done, "curves": curves, "summary": summary, "start_step": start,
            "codec": codec, "accumulate": accumulate, "layers": len(paths)}


def _coverage(factor, a_mean: jax.Array) -> np.ndarray:
    """Per-layer :func:`gift_jax.whitening.stage.input_coverage` of a stacked factor on the
    stacked mean input second moment (L, n, n): the adaptive refresh's staleness signal."""
    from gift_jax.whitening.stage import input_coverage

    return np.asarray(jax.vmap(input_coverage)(factor, a_mean))


def _gradient_coverage(factor, g_mean: jax.Array) -> np.ndarray:
    """Per-layer ``‖BᵀSG‖²/‖SG‖²`` of the stacked mean gradient (L, n, m): the gradient-based
    staleness signal the library first used, kept here only to compare with the input one."""
    from gift_jax.whitening.stage import coverage_basis

    def one(f, g):
        basis, scale = coverage_basis(f)
        sg = scale[:, None] * g
        return jnp.sum(jnp.matmul(basis.T, sg, precision="highest") ** 2) / jnp.sum(sg**2)

    return np.asarray(jax.vmap(one)(factor, g_mean))


def _signal_correlations(errors, fresh, signals) -> dict[str, dict[str, float]]:
    """Per fixed-K schedule and signal: Pearson correlation over the steps between the
    schedule's excess error (``error / fresh − 1``) and the signal's ratio to its value at the
    schedule's last refresh (a good staleness signal: strongly negative)."""
    out = {}
    for n, by_signal in signals.items():
        excess = np.asarray(errors[n]) / fresh - 1.0
        out[n] = {k: float(np.corrcoef(excess, v)[0, 1]) for k, v in by_signal.items()}
    return out


@_drops_factor_cache
def refresh_schedule_experiment(
    trainer: Trainer,
    *,
    steps: int = 100,
    fixed: Sequence[int] = (10, 50),
    thresholds: Sequence[float] = (0.97, 0.975, 0.98),
    min_every: int = 5,
    max_every: int = 200,
    rank: int = 32,
    replicas: int = 8,
    local_batch: int = 2,
    patterns: Sequence[str] = ("*/mlp/down_proj",),
    codec: str = "fp8_e4m3",
    accumulate: str = "fp32",
    damping: float = 1e-3,
    verbose: bool = True,
) -> dict[str, Any]:
    """Whitened-frame error of the rank-``rank`` factor under refresh schedules, step by step.

    Over ``steps`` consecutive training steps (the trainer keeps stepping with the exact
    gradient), every step's replica gradients are sent through the simulated all-reduce with
    the factor each schedule holds at that step:

    * ``fresh``: rebuilt from this step's ``Ā`` (a refresh every step, the yardstick);
    * ``K=k`` for k in ``fixed``: rebuilt every k steps;
    * ``adaptive τ`` for τ in ``thresholds``: the library's rule
      (:func:`gift_jax.whitening.stage.refresh_due_adaptive`): refresh at the first step, after
      ``max_every`` steps, or after at least ``min_every`` steps once the coverage ratio
      ``c_{t−1}/c_ref < τ``, where ``c = tr(BᵀSĀSB)/tr(SĀS)`` is the input coverage of the
      previous step's inputs (all ``T = local_batch · seq_len`` tokens of each replica; the
      training step's own measurement, :func:`~gift_jax.whitening.capture.with_input_coverage`,
      takes every ``max(1, ⌊T / 256⌋)``-th row, so the two see the same rows while ``T < 512``)
      with the factor then in use, ``c_ref`` its value on the last refresh step, and the ratio
      the minimum over the layers.

    Signals compared (``correlations``): on each fixed-K schedule, the correlation over the
    steps of its excess error with the input coverage ratio and with the gradient coverage
    ratio ``‖BᵀSG‖²/‖SG‖²`` of the step's mean gradient (:func:`_gradient_coverage`).

    Args:
      trainer: the experiment trainer; it advances ``steps − 1`` steps.
      steps: the number of measured steps.
      fixed: the fixed intervals K.
      thresholds: the adaptive rule's thresholds τ.
      min_every, max_every: the adaptive rule's interval bounds.
      rank: r of the ``lowrank_diag`` factor.
      replicas: R.
      local_batch: sequences per replica.
      patterns: the measured layers.
      codec: the wire format.
      accumulate: ``"fp32"`` or ``"fp8"``.
      damping: the relative damping of the factors.
      verbose: print every schedule's error every 10 steps.

    Returns:
      The per-step whitened error of every schedule, its refresh steps, and per schedule
      ``mean`` (mean whitened error), ``ratio`` (mean / fresh's mean), ``worst_ratio`` (max
      over steps of error / fresh's error) and ``refreshes``: the keys ``errors`` and
      ``refresh_steps`` (by schedule name: ``fresh``, ``K=k``, ``adaptive τ``), ``summary``
      (one row per schedule), ``correlations`` (per fixed-K schedule, ``input`` and
      ``gradient``), and ``start_step``, ``steps``, ``codec``, ``accumulate``, ``rank``,
      ``min_every``, ``max_every``, ``layers``.
    """
    method = Method(f"rank-{rank} A", "input", "lowrank_diag", rank=rank)
    fn = make_replica_fn(trainer.graphdef, patterns, replicas)
    names = ["fresh", *(f"K={k}" for k in fixed), *(f"adaptive {t:g}" for t in thresholds)]
    held: dict[str, Any] = {n: None for n in names}  # the capture the factor was built from
    since = {n: 0 for n in names}
    ratio = {n: 1.0 for n in names}  # the adaptive signal of the previous step
    ref_cov: dict[str, np.ndarray] = {}
    signals = {n: {"input": [], "gradient": []} for n in names if n.startswith("K=")}
    ref_sig: dict[tuple[str, str], np.ndarray] = {}
    errors = {n: [] for n in names}
    refresh_steps = {n: [] for n in names}
    start, t0 = trainer.step, time.perf_counter()
    for t in range(steps):
        if t:
            trainer.advance(1)
        cap = capture_replicas(trainer, fn, replicas * local_batch)
        paths = group_paths(cap, patterns)
        a_mean = jnp.mean(_stack(cap.a, paths), axis=1)
        g_mean = jnp.mean(_stack(cap.grads, paths), axis=1)
        for n in names:
            if n == "fresh":
                due = True
            elif n.startswith("K="):
                due = held[n] is None or since[n] >= int(n[2:])
            else:
                tau = float(n.split()[1])
                due = (held[n] is None or since[n] >= max_every
                       or (since[n] >= min_every and ratio[n] < tau))
            if due:
                held[n], since[n] = cap, 0
                refresh_steps[n].append(trainer.step)
            factor = _cached_factor(method, held[n], paths, damping)
            caps = [cap] if held[n] is cap else [held[n], cap]
            res = evaluate_method(caps, paths, method, codec=codec, accumulate=accumulate,
                                  factor_step=0, damping=damping)
            errors[n].append(res["steps"][-1]["whitened"])
            for kind, sig in (signals.get(n) or {}).items():
                v = (_coverage(factor, a_mean) if kind == "input"
                     else _gradient_coverage(factor, g_mean))
                if due:
                    ref_sig[n, kind] = v
                sig.append(float(np.min(v / ref_sig[n, kind])))
            if n.startswith("adaptive"):
                cov = _coverage(factor, a_mean)
                if due:
                    ref_cov[n] = cov
                ratio[n] = float(np.min(np.where(ref_cov[n] > 0, cov / np.where(
                    ref_cov[n] > 0, ref_cov[n], 1.0), 1.0)))
            since[n] += 1
        if verbose and (t % 10 == 0 or t == steps - 1):
            print(f"  schedules step {trainer.step} ({time.perf_counter() - t0:.0f}s): "
                  + ", ".join(f"{n} {errors[n][-1]:.3f}" for n in names), flush=True)
    fresh = np.asarray(errors["fresh"])
    summary = [dict(schedule=n, refreshes=len(refresh_steps[n]), mean=float(np.mean(errors[n])),
                    ratio=float(np.mean(errors[n]) / fresh.mean()),
                    worst_ratio=float(np.max(np.asarray(errors[n]) / fresh)))
               for n in names]
    return {"start_step": start, "steps": steps, "errors": errors,
            "refresh_steps": refresh_steps, "summary": summary, "codec": codec,
            "accumulate": accumulate, "rank": rank, "min_every": min_every,
            "max_every": max_every, "layers": len(paths),
            "correlations": _signal_correlations(errors, fresh, signals)}


def refresh_schedule_markdown(res: dict[str, Any]) -> str:
    """The schedules' table: refreshes, mean whitened-frame error, and its ratio to fresh.

    Args:
      res: :func:`refresh_schedule_experiment`'s output.

    Returns:
      A heading, the table and, when there are fixed-K schedules, the staleness signals'
      correlation table.
    """
    head = (f"\n#### Refresh schedules — rank-{res['rank']} A, steps {res['start_step']}.."
            f"{res['start_step'] + res['steps'] - 1} ({res['layers']} layers, {res['codec']}, "
            f"{res['accumulate']} accumulation; adaptive within [{res['min_every']}, "
            f"{res['max_every']}] steps)\n")
    cols = ["schedule", "refreshes", "mean", "ratio", "worst_ratio"]
    titles = {"mean": "whitened-frame error (mean)", "ratio": "÷ fresh (mean)",
              "worst_ratio": "÷ fresh (worst step)"}
    corr = res.get("correlations") or {}
    lines = [f"| {n} | {c['input']:+.2f} | {c['gradient']:+.2f} |" for n, c in corr.items()]
    signal = ("\nStaleness signals: correlation over the steps of a fixed-K schedule's excess "
              "error (÷ fresh − 1) with each signal's ratio to its value at the last refresh "
              "(strongly negative = a good signal)\n\n| schedule | input coverage "
              "tr(BᵀSĀSB)/tr(SĀS) | gradient coverage ‖BᵀSG‖²/‖SG‖² |\n|---|---|---|\n"
              + "\n".join(lines) + "\n") if lines else ""
    return head + markdown_table(res["summary"], cols, titles) + "\n" + signal


def plot_refresh_schedules(res: dict[str, Any], path: str) -> None:
    """Whitened-frame error per step of every schedule (refreshes marked).

    Args:
      res: :func:`refresh_schedule_experiment`'s output.
      path: the image file (format from its suffix).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(res["start_step"], res["start_step"] + res["steps"])
    for n, e in res["errors"].items():
        (line,) = ax.plot(x, e, lw=1.2 if n != "fresh" else 2.0,
                          color="k" if n == "fresh" else None,
                          label=f"{n} ({len(res['refresh_steps'][n])} refreshes)")
        if n != "fresh":
            ax.plot(res["refresh_steps"][n], [e[s - res["start_step"]]
                                              for s in res["refresh_steps"][n]],
                    ls="none", marker="|", ms=10, color=line.get_color())
    ax.set(xlabel="training step", ylabel="whitened-frame error ‖W(Ĝ−G)‖/‖WG‖",
           title=f"rank-{res['rank']} A, {res['codec']}, refresh schedules")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================================
# Which transport model is the paper's? (issue #46, item 2)
# ============================================================================================

#: The paper's Table I/II (arXiv 2607.07494; one-step round trip, relative L2 error of the
#: reduced gradient), by frame.
PAPER_TABLE = {"Euclidean": 5.28e-2, "input-side full A": 1.77e-2, "rank-32 A": 1.72e-2,
               "diagonal A": 5.26e-2, "block-128 A": 2.43e-2}

#: The transport models compared with the paper (:func:`transport_study`): ``{name:
#: settings}``; ``kind`` ``"allreduce"`` (:func:`simulate_allreduce` with ``accumulate`` and
#: ``ring``), ``"cast_mean"`` (one per-tensor cast of the exact mean, no reduction) or
#: ``"cast_local"`` (one cast of each replica's own gradient, its error against that
#: gradient).
TRANSPORTS: dict[str, dict[str, str]] = {
    "fp32": {"kind": "allreduce", "accumulate": "fp32"},
    "ring_sequential": {"kind": "allreduce", "accumulate": "fp8", "ring": "sequential"},
    "ring_nccl": {"kind": "allreduce", "accumulate": "fp8", "ring": "nccl"},
    "ring_nccl_headroom": {"kind": "allreduce", "accumulate": "fp8", "ring": "nccl_headroom"},
    "tree": {"kind": "allreduce", "accumulate": "fp8", "ring": "tree"},
    "tree_headroom": {"kind": "allreduce", "accumulate": "fp8", "ring": "tree_headroom"},
    "cast_mean": {"kind": "cast_mean"},
    "cast_local": {"kind": "cast_local"},
    "fp32_stale": {"kind": "allreduce", "accumulate": "fp32", "stale": "yes"},
    "ring_nccl_stale": {"kind": "allreduce", "accumulate": "fp8", "ring": "nccl",
                        "stale": "yes"},
}

#: What each transport is, for the tables.
TRANSPORT_TITLES = {
    "fp32": "fp32 sums (each sender its own scale, the mean re-cast: the library's)",
    "ring_sequential": "FP8 ring, whole tensor in sequence + mean re-cast (studies until #46)",
    "ring_nccl": "NCCL FP8 ring (reduce-scatter, FP8 per hop, all-gather), no headroom",
    "ring_nccl_headroom": "NCCL FP8 ring, scale with R× headroom",
    "tree": "FP8 binary tree (FP8 per level), no headroom",
    "tree_headroom": "FP8 binary tree, scale with R× headroom",
    "cast_mean": "one cast of the exact mean (no reduction)",
    "cast_local": "one cast of each replica's gradient (no reduction)",
    "fp32_stale": "fp32 sums, senders' scales synced (pmax) on an earlier step and reused",
    "ring_nccl_stale": "NCCL FP8 ring, the shared scale of an earlier step",
}


@functools.partial(jax.jit, static_argnames=("codec", "transport"))
def _transport_stack(xs: jax.Array, codec: str, transport: str,
                     scales: jax.Array | None = None) -> jax.Array:
    """Transport ``xs`` (L, R, n, m) by :data:`TRANSPORTS` ``[transport]``: (L, n, m) means,
    or (L, R, n, m) for ``"cast_local"``; ``scales`` (L,) the senders' stale shared scales of
    the ``"stale"`` transports."""
    t = TRANSPORTS[transport]
    if t.get("stale"):
        return jax.vmap(lambda x, sc: simulate_allreduce(
            x, codec, t["accumulate"], scales=jnp.broadcast_to(sc, (x.shape[0],)),
            ring=t.get("ring", "sequential")).mean)(xs, scales)
    if t["kind"] == "cast_local":
        return jax.vmap(jax.vmap(lambda x: tensor_quantize(x, codec, tensor_scale(x, codec))))(
            xs)
    if t["kind"] == "cast_mean":
        return jax.vmap(lambda x: tensor_quantize(x, codec, tensor_scale(x, codec)))(
            jnp.mean(xs.astype(jnp.float32), axis=1))
    return jax.vmap(lambda x: simulate_allreduce(x, codec, t["accumulate"],
                                                 ring=t.get("ring", "sequential")).mean)(xs)


@functools.partial(jax.jit, static_argnames="codec")
def _shared_scales(xs: jax.Array, codec: str) -> jax.Array:
    """(L,) the shared (max over the replicas) per-tensor scales of ``xs`` (L, R, …)."""
    return jax.vmap(lambda y: jnp.max(jax.vmap(lambda z: tensor_scale(z, codec))(y)))(xs)


@jax.jit
def _unwhiten_replicas(factor, g):  # g (L, R, n, m)
    return jax.vmap(lambda f, x: jax.vmap(lambda y: wh.unwhiten(f, y))(x))(factor, g)


def transport_study(
    captures: Iterable[ReplicaCapture],
    *,
    transports: Sequence[str] = tuple(TRANSPORTS),
    replica_counts: Sequence[int] = (8, 64),
    codecs: Sequence[str] = ("fp8_e4m3", "fp8_e5m2"),
    patterns: Sequence[str] = ("*/mlp/down_proj",),
    damping: float = 1e-3,
    stale: ReplicaCapture | None = None,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """The Table I/II frames (:data:`PAPER_TABLE`) through every transport model, at every
    replica count, each captured step a fresh one-step round trip (factors of its own ``Ā``).
    The ``"stale"`` transports take the senders' shared scale (the max over the replicas) of
    ``stale``, an earlier captured step, in the same frame (its gradients whitened by the
    step's factor), as the artifact's per-layer scales synced every 50 steps.

    Args:
      captures: the captured steps (consumed one at a time), with at least
        ``max(replica_counts)`` replicas.
      transports: keys of :data:`TRANSPORTS`.
      replica_counts: the R values (the first R replicas of each capture).
      codecs: the wire formats.
      patterns: the layers (default: the MLP down-projections, the paper's fc2).
      damping: the relative damping of the factors.
      stale: the earlier step of the ``"stale"`` transports (with at least
        ``max(replica_counts)`` replicas); ``None``: those transports are skipped.
      verbose: print the time of each captured step.

    Returns:
      One row per (transport, codec, R, frame): ``rel_l2`` (``‖Ĝ − Ḡ‖/‖Ḡ‖``, pooled over the
      layers; for ``cast_local`` ``‖Q(G_r) − G_r‖/‖G_r‖`` pooled over the replicas too) and
      ``rel_l2_local`` (the same error over the replicas' rms gradient norm, ``‖Ĝ −
      Ḡ‖/√(mean_r ‖G_r‖²)``), each the mean over the captured steps, and ``per_step``.

    Raises:
      ValueError: an unknown transport.
    """
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        raise ValueError(f"transports {bad} are not supported; allowed: {tuple(TRANSPORTS)}")
    if stale is None:
        transports = [t for t in transports if not TRANSPORTS[t].get("stale")]
    methods = [m for m in default_methods((32,)) if m.name in PAPER_TABLE]
    acc: dict[tuple, list[tuple[float, float]]] = {}
    try:
        for i, capture in enumerate(captures):
            t0 = time.perf_counter()
            for r in replica_counts:
                cap = first_replicas(capture, r)
                old = None if stale is None else first_replicas(stale, r)
                paths = group_paths(cap, patterns)
                groups = _shape_groups(paths, cap.grads)
                for m in methods:
                    facts = [_cached_factor(m, cap, grp, damping) for grp in groups]
                    for codec in codecs:
                        for name in transports:
                            err2 = ref2 = loc2 = 0.0
                            for f, grp in zip(facts, groups, strict=True):
                                g = _stack(cap.grads, grp)  # (L, R, n, m)
                                x = g if f is None else _whiten_stack(f, g)
                                sc = None
                                if TRANSPORTS[name].get("stale"):
                                    go = _stack(old.grads, grp)
                                    xo = go if f is None else _whiten_stack(f, go)
                                    sc = _shared_scales(xo, codec)
                                out = _transport_stack(x, codec, name, sc)
                                local = name == "cast_local"
                                if f is not None:
                                    out = (_unwhiten_replicas(f, out) if local
                                           else _unwhiten_stack(f, out))
                                ref = g if local else jnp.mean(g, axis=1)
                                err2 += float(jnp.sum((out - ref) ** 2)) / (r if local else 1)
                                ref2 += float(jnp.sum(ref**2)) / (r if local else 1)
                                loc2 += float(jnp.sum(g.astype(jnp.float32) ** 2)) / r
                            acc.setdefault((name, codec, r, m.name), []).append(
                                (math.sqrt(err2 / ref2), math.sqrt(err2 / loc2)))
                del cap
            _FACTOR_CACHE.clear()
            if verbose:
                print(f"  transport study: step {i} in {time.perf_counter() - t0:.0f}s",
                      flush=True)
    finally:
        _FACTOR_CACHE.clear()
    return [dict(transport=k[0], codec=k[1], replicas=k[2], method=k[3],
                 rel_l2=float(np.mean([v[0] for v in vals])),
                 rel_l2_local=float(np.mean([v[1] for v in vals])),
                 per_step=[v[0] for v in vals])
            for k, vals in acc.items()]


def transport_markdown(rows: Sequence[dict[str, Any]], metric: str = "rel_l2",
                       tolerance: float = 0.25) -> str:
    """Per (codec, R): every transport's Table I/II row beside the paper's, the diagonal
    frame's change against Euclidean, and the largest deviation from the paper.

    Args:
      rows: :func:`transport_study`'s rows.
      metric: ``"rel_l2"`` (normalised by the mean's norm) or ``"rel_l2_local"`` (by the
        replicas' rms norm).
      tolerance: an entry within this relative deviation of the paper's counts as
        reproduced.

    Returns:
      The headings and tables, ending in a newline.
    """
    frames = list(PAPER_TABLE)
    out = []
    for codec in sorted({r["codec"] for r in rows}):
        for n in sorted({r["replicas"] for r in rows}):
            sel = {(r["transport"], r["method"]): r[metric] for r in rows
                   if r["codec"] == codec and r["replicas"] == n}
            names = list(dict.fromkeys(r["transport"] for r in rows))
            norm = ("normalised by the mean" if metric == "rel_l2"
                    else "normalised by the replicas' rms gradient")
            out.append(f"\n#### {codec}, R = {n} ({norm})\n")
            out.append("| transport | " + " | ".join(frames)
                       + " | diag vs Eucl. | worst vs paper | all within "
                       f"{tolerance:.0%} |")
            out.append("|---|" + "---:|" * (len(frames) + 3))
            paper = [PAPER_TABLE[f] for f in frames]
            out.append("| **paper** | " + " | ".join(f"{v:.2e}" for v in paper)
                       + f" | {100 * (paper[3] / paper[0] - 1):+.1f} % | | |")
            for t in names:
                vals = [sel.get((t, f)) for f in frames]
                if any(v is None for v in vals):
                    continue
                dev = [v / p - 1 for v, p in zip(vals, paper, strict=True)]
                worst = max(dev, key=abs)
                diag = 100 * (vals[3] / vals[0] - 1)
                ok = all(abs(d) <= tolerance for d in dev) and abs(diag) <= 10
                out.append(f"| {t} | " + " | ".join(f"{v:.2e}" for v in vals)
                           + f" | {diag:+.1f} % | {100 * worst:+.0f} % | "
                           f"{'yes' if ok else 'no'} |")
    return "\n".join(out) + "\n"


# ============================================================================================
# Reports
# ============================================================================================


def roundtrip_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one-step Table I/II per (group, codec) with fp32 accumulation; then the
    accumulation × error-feedback summary (mean over steps, plus the cumulative error).

    Args:
      rows: :func:`roundtrip_experiment`'s rows.

    Returns:
      The headings and tables, ending in a newline.
    """
    out = []
    cols = ["method", *METRICS]
    keys = sorted({(r["group"], r["codec"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for g, c in keys:
        for acc in ("fp32", "fp8"):
            sel = [r for r in rows if r["group"] == g and r["codec"] == c
                   and r["accumulate"] == acc and not r["error_feedback"]]
            if not sel:
                continue
            out.append(f"\n#### One-step round trip — {g}, {sel[0]['layers']} layers, {c}, "
                       f"{'fp32 accumulation' if acc == 'fp32' else 'FP8 ring accumulation'}"
                       "\n")
            out.append(markdown_table([{"method": r["method"], **r["step0"]} for r in sel],
                                      cols, METRIC_TITLES))
    cols2 = ["method", "codec", "accumulate", "error_feedback", "rel_l2", "whitened", "adam",
             "muon", "cum_rel_l2"]
    for g in sorted({r["group"] for r in rows}):
        sel = [dict(method=r["method"], codec=r["codec"], accumulate=r["accumulate"],
                    error_feedback="on" if r["error_feedback"] else "off", **r["mean"],
                    cum_rel_l2=r["cum_rel_l2"]) for r in rows if r["group"] == g]
        out.append(f"\n#### Mean over the captured steps, factor fixed — {g}\n")
        out.append(markdown_table(sel, cols2, METRIC_TITLES))
    return "\n".join(out) + "\n"


def staleness_markdown(res: dict[str, Any]) -> str:
    """Markdown: the staleness summary, stale against fresh error per frame and window K.

    Args:
      res: :func:`staleness_experiment`'s output.

    Returns:
      A heading and the table, ending in a newline.
    """
    cols = ["method", "K", "points"]
    for metric in ("rel_l2", "whitened", "adam", "muon"):
        cols += [f"{metric}_stale", f"{metric}_fresh"]
    titles = {f"{m}_{s}": f"{METRIC_TITLES[m]} ({s})" for m in ("rel_l2", "whitened", "adam",
                                                                "muon")
              for s in ("stale", "fresh")}
    head = (f"\n#### Staleness — factor from step {res['start_step']} reused for k steps "
            f"({res['layers']} layers, {res['codec']}, {res['accumulate']} accumulation; "
            f"mean over the sampled k < K: {res['offsets']})\n")
    return head + markdown_table(res["summary"], cols, titles) + "\n"


def plot_roundtrip(rows: Sequence[dict[str, Any]], path: str, codec: str = "fp8_e4m3") -> None:
    """Bars of the one-step round trip (fp32 accumulation, no error feedback): a row of
    panels per layer group, a panel per metric (relative L2, whitened-frame, Adam, Muon), a
    bar per frame.

    Args:
      rows: :func:`roundtrip_experiment`'s rows.
      path: the image file (format from its suffix).
      codec: the codec whose rows are drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["group"] for r in rows})
    metrics = ("rel_l2", "whitened", "adam", "muon")
    fig, axes = plt.subplots(len(groups), len(metrics), figsize=(4 * len(metrics),
                                                                 3.2 * len(groups)),
                             squeeze=False)
    for gi, g in enumerate(groups):
        sel = [r for r in rows if r["group"] == g and r["codec"] == codec
               and r["accumulate"] == "fp32" and not r["error_feedback"]]
        names = [r["method"] for r in sel]
        for mi, metric in enumerate(metrics):
            ax = axes[gi][mi]
            ax.barh(range(len(sel)), [r["step0"][metric] for r in sel])
            ax.set_yticks(range(len(sel)))
            ax.set_yticklabels(names if mi == 0 else [""] * len(sel), fontsize=7)
            ax.invert_yaxis()
            ax.set_title(f"{METRIC_TITLES[metric]}\n{g}", fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"One-step round trip, {codec}, fp32 accumulation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_staleness(res: dict[str, Any], path: str) -> None:
    """Error against steps since the refresh (relative L2, whitened-frame, Adam update): a
    line per frame with the stale factor, dashed with a fresh one (not for Euclidean).

    Args:
      res: :func:`staleness_experiment`'s output.
      path: the image file (format from its suffix).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("rel_l2", "whitened", "adam")
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.5))
    for ax, metric in zip(axes, metrics, strict=True):
        for name, c in res["curves"].items():
            line, = ax.plot(res["offsets"], [m[metric] for m in c["stale"]], marker="o", ms=3,
                            label=f"{name} (stale)")
            if name != "Euclidean":
                ax.plot(res["offsets"], [m[metric] for m in c["fresh"]], ls="--",
                        color=line.get_color(), label=f"{name} (fresh)")
        ax.set_xlabel("steps since refresh")
        ax.set_title(METRIC_TITLES[metric])
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Factor staleness ({res['codec']}, {res['accumulate']} accumulation)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
