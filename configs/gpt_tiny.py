"""Tiny byte-level GPT-2-style model, the second model family: 842,496 parameters.

The ``tiny`` run (configs/tiny.py: data, batch, schedule, AdamW) with a GPT-2 block instead of
Llama's (gift_jax/models/gpt.py): learned positions, pre-LayerNorm, GELU MLP d_ff 512
(4 · d_model), biases, tied embeddings. 4 blocks, d_model 128, 4 heads, vocab 256 (bytes),
sequences of 128 tokens. GIFT's and PLUMAGE's default layer patterns select the same roles as
in the Llama (``*/mlp/down_proj``: GPT-2's MLP c_proj).
"""

import pathlib
import runpy

import ml_collections

from gift_jax.models import MODELS

_TINY = runpy.run_path(str(pathlib.Path(__file__).with_name("tiny.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _TINY["get_config"]()
    config.model = ml_collections.ConfigDict(MODELS["gpt"].defaults())  # family "gpt"
    config.model.vocab_size = 256  # byte-level tokens
    config.model.d_model = 128  # residual width
    config.model.num_layers = 4  # blocks
    config.model.num_heads = 4  # head_dim 32
    config.model.d_ff = 512  # 4 · d_model, GELU (GPT-2)
    config.model.max_seq_len = 128  # rows of the learned position table = train.seq_len
    config.model.tie_embeddings = True  # the head is the token table (GPT-2)
    return config
