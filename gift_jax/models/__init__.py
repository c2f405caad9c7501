"""Models used by gift_jax's trainer, scripts and tests, and the registry of model families.

``model.family`` in a run's config names a family (:data:`MODELS`); the rest of the ``model``
group is that family's config dataclass. The trainer reads a model only through its
:class:`~gift_jax.models.common.ModelSpec`: :func:`model_spec` (by family name or by config
instance) and :func:`model_config_of` (a ``model`` group → the family's config).

Adding a family: a module with a config dataclass, an ``nnx.Module`` and a ``SPEC`` (see
:mod:`gift_jax.models.gpt`), one entry in :data:`MODELS`, and a config file.
"""

from collections.abc import Mapping
from typing import Any

from gift_jax.models import gpt, llama
from gift_jax.models.common import LOGICAL_AXES, ModelSpec, next_token_loss
from gift_jax.models.gpt import GPT, GPTConfig
from gift_jax.models.llama import (
    MLP,
    Attention,
    Block,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    rope_angles,
)

#: ``model.family`` → the family's spec.
MODELS: dict[str, ModelSpec] = {spec.family: spec for spec in (llama.SPEC, gpt.SPEC)}
#: The family of a ``model`` group without ``family`` (configs written before families).
DEFAULT_FAMILY = "llama"


def model_spec(family_or_config: Any) -> ModelSpec:
    """The spec of a family, given its name (``"llama"``) or one of its config instances.

    Args:
      family_or_config: a family name or a config dataclass instance.

    Returns:
      The family's spec.

    Raises:
      ValueError: an unknown name or config type, naming the known families.
    """
    for spec in MODELS.values():
        if family_or_config == spec.family or isinstance(family_or_config, spec.config_type):
            return spec
    raise ValueError(f"model.family must be one of {sorted(MODELS)}, got {family_or_config!r}.")


def model_config_of(group: Mapping[str, Any]) -> Any:
    """The family config of a ``model`` group (``config.model``): its ``family``
    (default :data:`DEFAULT_FAMILY`) selects the dataclass, the other keys are its fields.

    Args:
      group: a ``model`` group (``config.model``).

    Returns:
      The family's config dataclass.

    Raises:
      ValueError: an unknown family or a setting the family does not have.
    """
    return model_spec(group.get("family", DEFAULT_FAMILY)).config(group)


def param_shapes(config: Any, *, flat: bool = False) -> dict:
    """The parameter shapes of a model of any family (:meth:`ModelSpec.param_shapes`).

    Args:
      config: a family's config dataclass.
      flat: a flat dict keyed by ``/``-joined paths instead of a nested one.

    Returns:
      The parameters as ``jax.ShapeDtypeStruct`` leaves.
    """
    return model_spec(config).param_shapes(config, flat=flat)


def logical_axes(config: Any) -> dict[str, tuple[str, ...]]:
    """The parameters' logical axis names, any family (:meth:`ModelSpec.logical_axes`).

    Args:
      config: a family's config dataclass.

    Returns:
      ``{path: logical axis names}``.
    """
    return model_spec(config).logical_axes(config)


def count_params(config: Any) -> int:
    """The parameter count of a model of any family, from its dimensions.

    Args:
      config: a family's config dataclass.

    Returns:
      The number of parameters.
    """
    return model_spec(config).count_params(config)


__all__ = [
    "DEFAULT_FAMILY",
    "GPT",
    "GPTConfig",
    "LOGICAL_AXES",
    "MODELS",
    "Attention",
    "Block",
    "Llama",
    "LlamaConfig",
    "MLP",
    "ModelSpec",
    "RMSNorm",
    "apply_rope",
    "count_params",
    "logical_axes",
    "model_config_of",
    "model_spec",
    "next_token_loss",
    "param_shapes",
    "rope_angles",
]
