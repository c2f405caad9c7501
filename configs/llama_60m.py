"""GaLore/PLUMAGE Llama-60M recipe (C4, GaLore's scripts): 58,073,600 parameters.

8 blocks, d_model 512, 8 heads (head_dim 64), SwiGLU d_ff 1376, vocab 32000 (T5 tokenizer),
untied head, RMSNorm eps 1e-6, sequences of 256 tokens. GaLore-AdamW: lr 0.01, galore scale
0.25, rank 128, projection refresh every 200 steps, weight decay 0, global batch 512, 1000
warmup steps, cosine to 0.1 × lr over 10000 steps. This file is also the recipe that
llama_130m/350m/1b override. The papers train on C4 with the T5 tokenizer; ``data.source`` keeps
the bundled corpus until a C4 source is configured (``--data tfds:c4/en``), and
``data.tokenizer`` trains a 32000-piece SentencePiece on it (or pass the T5/LLaMA ``.model``).
"""

import pathlib
import runpy

import ml_collections

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config() -> ml_collections.ConfigDict:
    config = _BASE["get_config"]()

    config.model.vocab_size = 32000  # T5/LLaMA sentencepiece vocabulary
    config.model.d_model = 512  # residual width
    config.model.num_layers = 8  # blocks
    config.model.num_heads = 8  # head_dim 64
    config.model.d_ff = 1376  # SwiGLU hidden width
    config.model.max_seq_len = 1024  # GaLore's max_sequence_length (training uses 256)
    config.model.norm_eps = 1e-6  # GaLore's rms_norm_eps
    config.model.dtype = "bfloat16"  # GaLore trains in bf16; we keep fp32 parameters

    config.optimizer.name = "adamw"  # GaLore-AdamW = AdamW on the projected gradients
    config.optimizer.learning_rate = 0.01  # peak
    config.optimizer.final_learning_rate = 1e-3  # GaLore's min_lr_ratio 0.1
    config.optimizer.warmup_steps = 1000  # linear warmup
    config.optimizer.schedule = "cosine"  # decay over the remaining steps
    config.optimizer.weight_decay = 0.0  # GaLore scripts: --weight_decay 0
    config.optimizer.b2 = 0.999  # GaLore's AdamW default betas (0.9, 0.999)
    config.optimizer.eps = 1e-6  # GaLore's AdamW default eps
    config.optimizer.grad_clip_norm = 0.0  # GaLore scripts do not clip below 7B

    config.data.tokenizer = "spm:32000"  # SentencePiece trained on the train split
    # documents tokenized in worker processes as training consumes them: no pass over C4
    config.data.pipeline = "stream"

    config.train.global_batch_size = 512  # sequences per step
    config.train.seq_len = 256  # tokens per sequence (131k tokens per step)
    config.train.num_steps = 10000  # optimizer steps
    config.train.eval_every = 1000  # steps between evaluations
    config.train.checkpoint_every = 2000  # steps between checkpoints

    config.comm.codec = "fp8_e4m3"  # wire format of the projected gradient
    config.comm.method = "plumage"  # communicate the projected gradient
    config.plumage.projector = "plumage"  # "galore" reproduces the baseline
    config.plumage.rank = 128  # projection rank
    config.plumage.refresh_every = 200  # GaLore's update_proj_gap
    config.plumage.scale = 0.25  # GaLore's galore_scale
    return config
