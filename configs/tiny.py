"""Tiny byte-level Llama for CPU demos and tests: 857,216 parameters.

4 blocks, d_model 128, 4 heads (head_dim 32), SwiGLU d_ff 344, vocab 256 (bytes), sequences of
128 tokens, AdamW 3e-3 with 30 warmup steps and cosine decay over 300 steps on the bundled
Shakespeare text, 8 sequences per step. Trains in one to two minutes on two CPU cores.
"""

import pathlib
import runpy

import ml_collections

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _BASE["get_config"]()

    config.model.vocab_size = 256  # byte-level tokens
    config.model.d_model = 128  # residual width
    config.model.num_layers = 4  # blocks
    config.model.num_heads = 4  # head_dim 32
    config.model.d_ff = 344  # ≈ 8/3 · d_model, SwiGLU
    config.model.max_seq_len = 128  # = train.seq_len

    config.optimizer.name = "adamw"  # Adam with decoupled weight decay
    config.optimizer.learning_rate = 3e-3  # peak
    config.optimizer.final_learning_rate = 3e-4  # end of the cosine
    config.optimizer.warmup_steps = 30  # 10% of the run
    config.optimizer.warmup_fraction = 0.1  # shorter runs warm up over their first 10%

    config.train.global_batch_size = 8  # 1024 tokens per step (divisible by 8 replicas)
    config.train.seq_len = 128  # tokens per sequence
    config.train.num_steps = 300  # ≈ 0.3 CPU-s per step: 1–2 minutes on 2 CPU cores

    config.plumage.rank = 32  # a quarter of d_model: every attention/MLP kernel is projected
    config.plumage.refresh_every = 50  # several refreshes in a demo-length run

    config.data.source = "shakespeare"  # bundled corpus
    return config
