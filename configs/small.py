"""Small byte-level Llama, the precision frontier's larger model: 4,877,568 parameters.

6 blocks, d_model 256, 4 heads (head_dim 64), SwiGLU d_ff 688, vocab 256 (bytes), sequences
of 128 tokens, 8 sequences per step, AdamW 2e-3 with 30 warmup steps and cosine decay — the
tiny config (configs/tiny.py) with 5.7× its parameters, still trainable for a few hundred
steps on two CPU cores (about 4× tiny's step time there).
"""

import pathlib
import runpy

import ml_collections

_TINY = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _TINY["get_config"]()
    config.model.d_model = 256  # residual width
    config.model.num_layers = 6  # blocks
    config.model.num_heads = 4  # head_dim 64
    config.model.d_ff = 688  # ≈ 8/3 · d_model, SwiGLU
    config.optimizer.learning_rate = 2e-3  # peak (a wider model, a smaller step)
    config.optimizer.final_learning_rate = 2e-4  # end of the cosine
    config.plumage.rank = 64  # a quarter of d_model, as tiny
    return config
