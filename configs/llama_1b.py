"""GaLore/PLUMAGE Llama-1B recipe (C4, GaLore's scripts): 1,339,082,752 parameters.

24 blocks, d_model 2048, 32 heads (head_dim 64), SwiGLU d_ff 5461, vocab 32000,
untied head, sequences of 256 tokens; rank 512 (the paper; GaLore's script uses 1024); 100000
steps with 10000 warmup steps. Everything else (lr 0.01, galore scale 0.25, refresh every 200
steps, global batch 512, cosine to 0.1 × lr) comes from llama_60m.py.
"""

import pathlib
import runpy

import ml_collections

_LLAMA_60M = runpy.run_path(str(pathlib.Path(__file__).with_name("llama_60m.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _LLAMA_60M["get_config"]()

    config.model.d_model = 2048  # residual width
    config.model.num_layers = 24  # blocks
    # pod-realistic compute: bf16 matmuls (fp32 master weights and Adam moments), blocks
    # stacked and scanned (compile time flat in depth), each block recomputed in the backward,
    # flash attention where the target has it
    config.model.dtype = "bfloat16"
    config.model.scan_layers = True
    config.model.remat = True
    config.model.remat_policy = "nothing_saveable"
    config.model.attention_impl = "flash"  # Pallas TPU kernel / cuDNN; the reference on CPU
    config.model.num_heads = 32  # head_dim 64
    config.model.d_ff = 5461  # SwiGLU hidden width

    config.optimizer.warmup_steps = 10000  # linear warmup (10% of the run)
    config.train.num_steps = 100000  # optimizer steps
    config.plumage.rank = 512  # projection rank
    # GIFT's rank-32 factor of A (n = d_ff for down_proj) by warm-started subspace iteration,
    # O(n²r) per refresh, instead of an O(n³) eigh of every stacked layer's n × n statistic
    config.gift.eig_method = "subspace"

    # ~21 GB of fp32 parameters and Adam moments: pure data parallelism fits an 80 GB GPU.
    # On a pod, split each replica over a node: --config.mesh.fsdp=8 (or fsdp=4 tensor=2 with
    # --config.mesh.rules.mlp='': GaLore's d_ff=5461 is odd, so the MLP hidden dimension cannot
    # be split over tensor)
    config.mesh.data = -1
    config.mesh.fsdp = 1
    config.mesh.tensor = 1
    return config
