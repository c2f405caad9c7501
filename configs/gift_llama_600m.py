"""GIFT's Llama-600M recipe (OpenWebText, Megatron artifact): 763,249,920 parameters.

32 blocks, d_model 1280, 20 heads (head_dim 64), SwiGLU d_ff 3456, sequences of 2048 tokens.
"600M" counts the blocks (634,471,680); the untied embedding and head add 2 × 50304 × 1280.
Vocabulary 50304: the GPT-2 tokenizer (50257) padded to a multiple of 128 (Megatron default;
the artifact's exact padding is not stated). Optimizer as for 300M: Muon lr 5e-4, momentum 0.9,
spectral scaling × 0.2, global batch 512, 6000 warmup steps, cosine to 5e-5 over 60000 steps.
GIFT layers: the 13 fc2 (= mlp/down_proj) layers the artifact hard-codes, in its order.
"""

import pathlib
import runpy

import ml_collections

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))

# The artifact's fc2 layers, ranked by the profiler over the first 100 steps.
GIFT_BLOCKS = (17, 20, 14, 30, 13, 2, 12, 7, 15, 0, 4, 9, 24)


def get_config() -> ml_collections.ConfigDict:
    config = _BASE["get_config"]()

    config.model.vocab_size = 50304  # GPT-2 BPE (50257) padded to a multiple of 128
    config.model.d_model = 1280  # residual width
    config.model.num_layers = 32  # blocks
    config.model.num_heads = 20  # head_dim 64
    config.model.d_ff = 3456  # SwiGLU hidden width
    config.model.max_seq_len = 2048  # = train.seq_len
    config.model.norm_eps = 1e-5  # Megatron default
    config.model.dtype = "bfloat16"  # bf16 matmuls, fp32 parameters
    config.model.attention_impl = "jax"  # cuDNN flash attention on GPU
    config.model.remat = True  # recompute block activations

    config.optimizer.name = "muon"  # Muon on matrices (AdamW on embeddings, norms)
    config.optimizer.learning_rate = 5e-4  # peak
    config.optimizer.final_learning_rate = 5e-5  # end of the cosine
    config.optimizer.warmup_steps = 6000  # linear warmup
    config.optimizer.schedule = "cosine"  # decay over the remaining steps
    config.optimizer.momentum = 0.9  # Muon momentum
    config.optimizer.muon_scale_mode = "spectral"  # artifact setting
    config.optimizer.muon_extra_scale_factor = 0.2  # artifact setting

    config.train.global_batch_size = 512  # sequences per step
    config.train.seq_len = 2048  # tokens per sequence (1M tokens per step)
    config.train.num_steps = 60000  # optimizer steps
    config.train.eval_every = 1000  # steps between evaluations
    config.train.checkpoint_every = 5000  # steps between checkpoints

    config.comm.mode = "gift_fp8"  # the paper's method
    config.comm.codec = "fp8_e5m2"  # the artifact's format
    config.gift.layers = tuple(f"layers/{i}/mlp/down_proj" for i in GIFT_BLOCKS)  # artifact list
    config.gift.rank = 32  # rank of A
    config.gift.refresh_every = 50  # K
    return config
