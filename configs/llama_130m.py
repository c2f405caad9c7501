"""GaLore/PLUMAGE Llama-130M recipe (C4, GaLore's scripts): 134,105,856 parameters.

12 blocks, d_model 768, 12 heads (head_dim 64), SwiGLU d_ff 2048, vocab 32000,
untied head, sequences of 256 tokens; rank 256; 20000 steps with 2000 warmup steps. Everything
else (lr 0.01, galore scale 0.25, refresh every 200 steps, global batch 512, cosine to 0.1 × lr)
comes from llama_60m.py.
"""

import pathlib
import runpy

import ml_collections

_LLAMA_60M = runpy.run_path(str(pathlib.Path(__file__).with_name("llama_60m.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _LLAMA_60M["get_config"]()

    config.model.d_model = 768  # residual width
    config.model.num_layers = 12  # blocks
    config.model.num_heads = 12  # head_dim 64
    config.model.d_ff = 2048  # SwiGLU hidden width

    config.optimizer.warmup_steps = 2000  # linear warmup (10% of the run)
    config.train.num_steps = 20000  # optimizer steps
    config.plumage.rank = 256  # projection rank
    return config
