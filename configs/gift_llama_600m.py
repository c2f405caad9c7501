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

# Same recipe as the 300M model (optimizer, batch, schedule, GIFT settings): only the
# dimensions, the sequence length and the GIFT layer list differ.
_GIFT_300M = runpy.run_path(str(pathlib.Path(__file__).with_name("gift_llama_300m.py")))

# The artifact's fc2 layers, ranked by the profiler over the first 100 steps.
GIFT_BLOCKS = (17, 20, 14, 30, 13, 2, 12, 7, 15, 0, 4, 9, 24)


def get_config() -> ml_collections.ConfigDict:
    config = _GIFT_300M["get_config"]()

    config.model.d_model = 1280  # residual width
    config.model.num_layers = 32  # blocks
    config.model.num_heads = 20  # head_dim 64
    config.model.d_ff = 3456  # SwiGLU hidden width
    config.model.max_seq_len = 2048  # = train.seq_len
    config.model.remat = True  # recompute block activations

    config.train.seq_len = 2048  # tokens per sequence (1M tokens per step)
    config.gift.layers = tuple(f"layers/{i}/mlp/down_proj" for i in GIFT_BLOCKS)  # artifact list
    return config
