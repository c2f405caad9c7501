"""GIFT's Llama-300M recipe (OpenWebText, Megatron artifact): 405,455,872 parameters.

24 blocks, d_model 1024, 16 heads (head_dim 64), SwiGLU d_ff 2736, sequences of 4096 tokens.
"300M" counts the blocks (302,433,280); the untied embedding and head add 2 × 50304 × 1024.
Vocabulary 50304: the GPT-2 tokenizer (50257) padded to a multiple of 128, as Megatron's
OpenWebText runs do (the artifact's exact padding is not stated; this is the Megatron default).
``data.tokenizer`` trains a GPT-2-style byte-level BPE of 50257 ids on the train split (pass
GPT-2's ``tokenizer.json`` instead to use the original; the bundled Shakespeare is too small for
50257 merges, so train it on a larger corpus, e.g. ``--data tfds:openwebtext``).
Optimizer: Muon, lr 5e-4, momentum 0.9, spectral scaling with extra factor 0.2, global batch
512, 6000 warmup steps, cosine to 5e-5 over 60000 steps. The artifact's hard-coded GIFT layer
list is for the 600M model; here every MLP down-projection is a candidate (the profiler picks).
"""

import pathlib
import runpy

import ml_collections

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _BASE["get_config"]()

    config.model.vocab_size = 50304  # GPT-2 BPE (50257) padded to a multiple of 128
    config.model.d_model = 1024  # residual width
    config.model.num_layers = 24  # blocks
    config.model.num_heads = 16  # head_dim 64
    config.model.d_ff = 2736  # SwiGLU hidden width
    config.model.max_seq_len = 4096  # = train.seq_len
    config.model.norm_eps = 1e-5  # Megatron default
    config.model.dtype = "bfloat16"  # bf16 matmuls, fp32 parameters
    config.model.attention_impl = "flash"  # cuDNN flash attention on GPU (T = 4096), Pallas on TPU
    config.model.remat = True  # activations of 4096-token sequences do not fit otherwise

    config.optimizer.name = "muon"  # Muon on matrices (AdamW on embeddings, norms)
    config.optimizer.learning_rate = 5e-4  # peak
    config.optimizer.final_learning_rate = 5e-5  # end of the cosine
    config.optimizer.warmup_steps = 6000  # linear warmup
    config.optimizer.schedule = "cosine"  # decay over the remaining steps
    config.optimizer.momentum = 0.9  # Muon momentum
    config.optimizer.muon_scale_mode = "spectral"  # artifact setting
    config.optimizer.muon_extra_scale_factor = 0.2  # artifact setting

    config.data.tokenizer = "bpe:50257"  # GPT-2-sized BPE trained on the train split
    # documents tokenized in worker processes as training consumes them: no pass over C4
    config.data.pipeline = "stream"

    config.train.global_batch_size = 512  # sequences per step
    config.train.seq_len = 4096  # tokens per sequence (2.1M tokens per step)
    config.train.num_steps = 60000  # optimizer steps
    config.train.eval_every = 1000  # steps between evaluations
    config.train.checkpoint_every = 5000  # steps between checkpoints

    config.comm.codec = "fp8_e5m2"  # the artifact's format
    config.comm.method = "gift"  # the paper's method
    config.gift.layers = ("*/mlp/down_proj",)  # candidates: every fc2 (= down_proj)
    config.gift.rank = 32  # rank of A
    config.gift.refresh_every = 50  # K
    return config
