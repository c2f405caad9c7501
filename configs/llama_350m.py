"""GaLore/PLUMAGE Llama-350M recipe (C4, GaLore's scripts): 367,969,280 parameters.

24 blocks, d_model 1024, 16 heads (head_dim 64), SwiGLU d_ff 2736, vocab 32000,
untied head, sequences of 256 tokens; rank 256; 60000 steps with 6000 warmup steps. Everything
else (lr 0.01, galore scale 0.25, refresh every 200 steps, global batch 512, cosine to 0.1 × lr)
comes from llama_60m.py.
"""

import pathlib
import runpy

import ml_collections

_LLAMA_60M = runpy.run_path(str(pathlib.Path(__file__).with_name("llama_60m.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _LLAMA_60M["get_config"]()

    config.model.d_model = 1024  # residual width
    config.model.num_layers = 24  # blocks
    config.model.num_heads = 16  # head_dim 64
    config.model.d_ff = 2736  # SwiGLU hidden width

    config.optimizer.warmup_steps = 6000  # linear warmup (10% of the run)
    config.train.num_steps = 60000  # optimizer steps
    config.plumage.rank = 256  # projection rank
    return config
