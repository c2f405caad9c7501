"""GaLore/PLUMAGE Llama-7B recipe (GaLore paper, Table 2's 7B): 6,738,415,616 parameters.

32 blocks, d_model 4096, 32 heads (head_dim 128), SwiGLU d_ff 11008, vocab 32000, untied head,
sequences of 2048 tokens (the GaLore paper's 7B runs); rank 1024. Too big for one accelerator
with Adam (~108 GB of fp32 parameters and moments): the mesh default shards it over 8 devices
per replica (``mesh.fsdp=8``, ~13.5 GB of state per device) with the data-parallel replicas,
which communicate through the quantized reduction, across nodes (``mesh.data=-1``). Add
``--config.mesh.tensor=2`` (and halve fsdp) when activations of 2048-token sequences dominate.
Everything else comes from llama_1b.py / llama_60m.py.
"""

import pathlib
import runpy

import ml_collections

_LLAMA_1B = runpy.run_path(str(pathlib.Path(__file__).with_name("llama_1b.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _LLAMA_1B["get_config"]()

    config.model.d_model = 4096  # residual width
    config.model.num_layers = 32  # blocks
    # bf16 matmuls, scanned and rematerialised blocks, flash attention: llama_1b.py's compute
    config.model.num_heads = 32  # head_dim 128
    config.model.d_ff = 11008  # SwiGLU hidden width
    config.model.max_seq_len = 2048  # GaLore's 7B sequence length

    config.train.seq_len = 2048  # tokens per sequence
    # 512 x 2048 tokens per step: 8 microbatches (one reduction per step), so a device of an
    # fsdp=8 replica holds one 2048-token sequence's activations at a time
    config.train.grad_accum_steps = 8
    config.plumage.rank = 1024  # projection rank

    config.mesh.data = -1  # replicas across nodes: the quantized reduction's axis
    config.mesh.fsdp = 8  # parameters, gradients and Adam moments split over 8 devices
    config.mesh.tensor = 1
    return config
