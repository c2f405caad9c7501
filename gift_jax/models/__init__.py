"""Models used by gift_jax's scripts and tests."""

from gift_jax.models.llama import (
    MLP,
    Attention,
    Block,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    count_params,
    next_token_loss,
    param_shapes,
    rope_angles,
)

__all__ = [
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "MLP",
    "RMSNorm",
    "apply_rope",
    "count_params",
    "next_token_loss",
    "param_shapes",
    "rope_angles",
]
