"""Every setting of a run and its default: the one table of defaults.

A run is these defaults + a model config (``configs/*.py``, which start from
``configs/base.py``: this function) + experiment overrides + command-line overrides, e.g.
``--config=configs/tiny.py --config.comm.codec=fp8_e4m3 --config.comm.method=gift``. The
``model`` group is ``family`` (a key of :data:`gift_jax.models.MODELS`) plus exactly the fields
of that family's config dataclass (built by :func:`gift_jax.models.model_config_of`); these
defaults are the Llama's, and ``configs/gpt_tiny.py`` shows another family. A config that
lacks a setting (a file written before the setting existed, a checkpoint's stored config)
gets it from here, or for another family from its spec's defaults
(:func:`gift_jax.training.config.complete_config`).

The defaults are the ``tiny`` byte-level model (vocab 256; 857,216 parameters).
"""

import ml_collections

from gift_jax.training.mesh import DEFAULT_RULES


def default_config() -> ml_collections.ConfigDict:
    """Every setting of a run at its default (a fresh copy per call)."""
    config = ml_collections.ConfigDict()

    # ------------------------------------------------------------------ model (LlamaConfig)
    model = config.model = ml_collections.ConfigDict()
    model.family = "llama"  # "llama" | "gpt" (gift_jax/models/__init__.py: MODELS)
    model.vocab_size = 256  # token ids; 256 = byte-level tokenizer
    model.d_model = 128  # residual-stream width
    model.num_layers = 4  # transformer blocks
    model.num_heads = 4  # query heads; must divide d_model, head_dim must be even
    model.num_kv_heads = ml_collections.FieldReference(None, field_type=int)  # None = num_heads
    model.d_ff = 344  # SwiGLU hidden width
    model.max_seq_len = 128  # longest accepted sequence
    model.rope_theta = 10000.0  # base of the rotary frequencies
    model.norm_eps = 1e-5  # RMSNorm epsilon
    model.tie_embeddings = False  # share the embedding matrix with the output head
    model.dtype = "float32"  # compute dtype: "float32" | "bfloat16" | "float16"
    model.param_dtype = "float32"  # parameter storage dtype
    model.init_std = 0.02  # std of the normal init of kernels and embedding
    # "reference" (einsum, fp32 softmax) | "jax" (cuDNN/XLA) | "flash" (Pallas TPU, cuDNN GPU)
    model.attention_impl = "reference"
    model.remat = False  # recompute block activations in the backward pass
    # what a rematerialised block keeps: "nothing_saveable" | "dots_saveable" |
    # "dots_with_no_batch_dims_saveable" | "everything_saveable" (jax.checkpoint_policies)
    model.remat_policy = "nothing_saveable"
    model.scan_layers = False  # stack the blocks and nnx.scan them (compile time flat in depth)

    # ------------------------------------------------------------------ optimizer
    opt = config.optimizer = ml_collections.ConfigDict()
    opt.name = "adamw"  # "adamw" | "muon" | "lion" (gift_jax/training/optimizers.py)
    opt.learning_rate = 3e-3  # peak learning rate (after warmup)
    opt.final_learning_rate = 3e-4  # learning rate at the end of the decay
    opt.warmup_steps = 30  # linear warmup from 0 to the peak (< train.num_steps)
    # > 0: the warmup is at most this share of the schedule (at least 1 step), so a short run
    # of a config (--config.train.num_steps=12) keeps a warmup that fits; 0: no cap
    opt.warmup_fraction = 0.0
    opt.schedule = "cosine"  # decay after warmup: "cosine" | "linear" | "constant"
    opt.weight_decay = 0.0  # decoupled weight decay
    opt.b1 = 0.9  # Adam first-moment decay
    opt.b2 = 0.95  # Adam second-moment decay
    opt.eps = 1e-8  # Adam denominator epsilon
    opt.grad_clip_norm = 1.0  # global-norm clipping after the reduction; 0 disables
    opt.momentum = 0.9  # Muon momentum
    opt.nesterov = True  # Muon Nesterov momentum
    opt.muon_scale_mode = "spectral"  # Muon update scaling (Megatron's "spectral" mode)
    opt.muon_extra_scale_factor = 0.2  # extra factor on the Muon update (artifact: 0.2)
    opt.schedule_steps = 0  # length of the learning-rate schedule; 0: train.num_steps

    # ------------------------------------------------------------------ training loop
    train = config.train = ml_collections.ConfigDict()
    train.seed = 0  # seed of parameter init, data order and sampling keys
    train.global_batch_size = 8  # sequences per step, summed over data-parallel replicas
    train.seq_len = 128  # tokens per training sequence
    train.num_steps = 300  # optimizer steps
    train.log_every = 10  # steps between metric logs
    train.eval_every = 100  # steps between evaluations; 0 disables
    train.eval_batches = 4  # batches per evaluation
    train.checkpoint_every = 100  # steps between checkpoints (with a workdir); 0 disables
    train.keep_checkpoints = 3  # newest checkpoints kept on disk
    train.max_consecutive_skips = 20  # stop (checkpoint kept) after this many skips in a row
    train.skip_warning_fraction = 0.2  # warn when a logged window skips more than this share
    train.grad_accum_steps = 1  # microbatches per optimizer step (one reduction per step)
    train.diagnostics_every = 100  # steps between wire-byte / round-trip fidelity records
    train.workdir = ""  # checkpoints and metrics directory; "" = no output files
    # a resumed run whose train.num_steps changed: "keep" the schedule's length (past its end
    # the learning rate stays at optimizer.final_learning_rate) | "stretch" it to the new
    # train.num_steps (the learning rate jumps at the resumed step)
    train.extend_schedule = "keep"

    # ------------------------------------------------------------------ device mesh
    mesh = config.mesh = ml_collections.ConfigDict()
    # data x fsdp x tensor = the number of devices (one of them may be -1: the rest). data:
    # replicas reducing through the quantized collective (put it across nodes/slices); fsdp:
    # parameters, gradients, optimizer state and batch split within a replica (ZeRO-3);
    # tensor: attention heads and the MLP hidden dimension split (Megatron)
    mesh.data = -1
    mesh.fsdp = 1
    mesh.tensor = 1
    # logical axis -> mesh axis ('' = replicated); see gift_jax/training/sharding.py
    mesh.rules = ml_collections.ConfigDict(dict(DEFAULT_RULES))
    mesh.intra_size = 1  # > 1: a second (intra-node) axis for hierarchical communication

    # ------------------------------------------------------------------ gradient communication
    comm = config.comm = ml_collections.ConfigDict()
    # wire format: "fp32" | "bf16" | "fp8_e4m3" | "fp8_e5m2" | "mxfp8" | "nvfp4" | "int8"
    comm.codec = "fp32"
    # what runs around the all-reduce: "none" | "gift" (gift.*) | "plumage" (plumage.*)
    comm.method = "none"
    comm.scaling = "tensor"  # scale granularity: "tensor" | "block"
    comm.block_size = 128  # elements per scale when scaling == "block"
    comm.stochastic_rounding = False  # unbiased rounding in the quantizer
    comm.error_feedback = False  # carry each replica's quantization error to the next step
    comm.fp8_accumulation = False  # emulate the artifact's FP8 NCCL accumulation (global pmax)
    # per-tensor scales: 1 = fresh every step (each sender its own); K > 1: synced across the
    # replicas (pmax) every K steps and reused in between, values beyond them clipped and
    # counted (the artifact syncs every 50 steps); per-tensor fp8/int8 codecs only
    comm.scale_sync_every = 1
    comm.intra_codec = "fp32"  # codec inside the intra-node axis when mesh.intra_size > 1
    # the blocks' weight gradients reduce-scattered over mesh.fsdp in this codec (qgZ), in a
    # shard_map per block instead of XLA's bf16/fp32 collectives: "" (XLA's) | a comm.codec
    # name; comm.scaling/block_size as the data axis's
    comm.fsdp_codec = ""
    # the blocks' weights all-gathered over mesh.fsdp in this codec for the forward and
    # backward (qwZ; the master weights are never rounded), one scale per shard or as
    # comm.scaling says: "" | fp8_e4m3 | fp8_e5m2 | mxfp8 | nvfp4 | int8; needs comm.fsdp_codec
    comm.fsdp_weight_codec = ""
    comm.distribute_refresh = True  # spread GIFT/PLUMAGE refresh decompositions over replicas
    # when the gradient is reduced: "after" the backward pass (one bucket plan over the tree) |
    # "backward": group by group inside it, in reverse layer order
    comm.reduce_in = "after"
    comm.bucket_elems = 1 << 24  # bucket size in elements (64 MiB of fp32), as Megatron's
    # how quantized bytes cross the data axis: "auto" (ppermutes across TPU slices of a
    # hierarchical mesh; all_to_all on GPUs, one NCCL launch) | "all_to_all" | "permute"
    # (ppermutes, which the TPU compiler overlaps)
    comm.exchange = "auto"
    # how a bucket is packed for the wire: "bytes" (per-tensor fp8/int8: scaled and cast where
    # each gradient lies, only the bytes relaid into rows) | "floats" (f32 rows, row kernels)
    comm.pack = "bytes"

    # ------------------------------------------------------------------ GIFT whitening
    gift = config.gift = ml_collections.ConfigDict()
    gift.layers = ("*/mlp/down_proj",)  # fnmatch patterns of whitened nnx.Linear paths
    gift.rank = 32  # eigenpairs kept in the low-rank input factor A
    gift.refresh_every = 50  # steps between factor refreshes (K)
    gift.damping = 1e-3  # floor of the remainder / Tikhonov damping of A
    # the EMA of A: "bias_corrected" (a per-step EMA of half-life gift.stats_half_life steps,
    # normalised by the weight folded so far; statistics folded every gift.stats_every steps and
    # on refreshes, which rebuild the factors from it) | "artifact" (the public artifact's: EMA
    # gift.ema per refresh, the first statistic unweighted; stats_every/half_life not read)
    gift.ema_scheme = "bias_corrected"
    gift.stats_every = 5  # bias_corrected: capture + fold A every this many steps (>= 1)
    gift.stats_half_life = 10.0  # bias_corrected: steps after which a statistic weighs half
    gift.ema = 0.95  # artifact: EMA decay of A across refreshes
    gift.remainder = "diagonal"  # remainder of A beyond rank r: "diagonal" | "isotropic"
    gift.two_sided = False  # also whiten the output side with B = E[g gᵀ] (two-sided K-FAC)
    # per-layer routing on refreshes: whiten a layer only where its measured FP8 round trip is
    # better in this frame: "optimizer" (adam for AdamW, muon for Muon) | "adam" | "muon" |
    # "whitened" | "euclidean" | "off" (always whiten: the paper's GIFT, configs predating it)
    gift.route_frame = "off"
    # when to refresh: "fixed" (every refresh_every steps) | "adaptive" (when the rank-r basis
    # covers < refresh_threshold of the layer inputs' energy it covered just after the last
    # refresh, measured on a token sample every step, within [min_refresh_every,
    # max_refresh_every] steps of it)
    gift.refresh = "fixed"
    gift.refresh_threshold = 0.975
    gift.min_refresh_every = 5
    gift.max_refresh_every = 200
    # top-r eigenpairs of A on refreshes: "eigh" (exact, O(n³)) | "subspace" (randomized
    # subspace iteration warm-started from the last basis, O(n²r))
    gift.eig_method = "eigh"

    # ------------------------------------------------------------------ PLUMAGE low-rank gradients
    plumage = config.plumage = ml_collections.ConfigDict()
    plumage.layers = ("*/attn/*_proj", "*/mlp/*_proj")  # projected layers (GaLore's targets)
    plumage.projector = "plumage"  # "plumage" | "galore" | "flora"
    plumage.rank = 128  # projection rank k
    plumage.refresh_every = 200  # steps between projection refreshes (tau)
    plumage.scale = 0.25  # scale of the back-projected update (GaLore's alpha)
    plumage.realign_moments = True  # rotate Adam moments when the projection changes
    plumage.gift = False  # GIFT-whiten the projected coordinates of gift.layers

    # ------------------------------------------------------------------ data
    data = config.data = ml_collections.ConfigDict()
    data.source = "shakespeare"  # corpus; "shakespeare" is bundled
    # "byte" | "PATH.model" (SentencePiece) | "PATH/tokenizer.json" (Hugging Face) |
    # "spm:N" / "bpe:N" (trained on the train split); model.vocab_size = N padded to 128
    data.tokenizer = "byte"
    data.shuffle_seed = 0  # seed of the example order
    # "grid": windows of the split's whole token stream (one pass over it before step 1) |
    # "stream": documents read, tokenized and packed as training consumes them (grain workers) |
    # "auto": the pipeline a checkpoint in the workdir was written with; else "grid" for the
    # bundled corpus and text:DIR corpora of at most 16 MB (their pass is short), "stream" for
    # larger text:DIR and every tfds: corpus
    data.pipeline = "auto"
    data.workers = -1  # stream: worker processes that read and tokenize (-1: the host's cores)
    # stream: a local directory where a background process caches the ids per shard of
    # documents while training runs (later epochs and runs read them); "": no cache
    data.id_cache = ""

    return config
