"""Models used by gift_jax's scripts and tests."""

from gift_jax.models.llama import (
    LOGICAL_AXES,
    MLP,
    Attention,
    Block,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    count_params,
    logical_axes,
    next_token_loss,
    param_shapes,
    rope_angles,
)

__all__ = [
    "LOGICAL_AXES",
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "MLP",
    "RMSNorm",
    "apply_rope",
    "count_params",
    "logical_axes",
    "next_token_loss",
    "param_shapes",
    "rope_angles",
]
