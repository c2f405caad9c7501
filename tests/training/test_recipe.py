"""The front door (:mod:`gift_jax.training.recipe`): a checked config as typed, frozen parts —
every setting of the optimizer, GIFT and PLUMAGE groups carried (a new setting cannot be
dropped on the way), the all-reduce's options resolved against the codec, the route frame
resolved through the optimizer, the model through its family's spec, bad settings refused."""

import copy
import dataclasses

import pytest
from trainer_kit import recipe_of

from gift_jax.comm.codecs import CODEC_NAMES, get_codec
from gift_jax.models import GPTConfig, LlamaConfig
from gift_jax.training.config import ConfigError, set_fields
from gift_jax.training.defaults import default_config
from gift_jax.training.method import GiftPlan, PlumagePlan
from gift_jax.training.recipe import GiftOptions, OptimizerOptions, PlumageOptions, Recipe


@pytest.mark.parametrize("cls,group", [(OptimizerOptions, "optimizer"), (GiftOptions, "gift"),
                                       (PlumageOptions, "plumage")])
def test_typed_groups_carry_every_setting(cls, group):
    assert {f.name for f in dataclasses.fields(cls)} == set(default_config()[group])


def test_parts_are_typed_and_frozen(tiny_config):
    r = recipe_of(set_fields(tiny_config, {"comm.codec": "fp8_e5m2", "comm.method": "gift",
                                           "optimizer.name": "muon",
                                           "gift.route_frame": "optimizer"}))
    assert isinstance(r, Recipe) and isinstance(r.model_config, LlamaConfig)
    assert r.model.family == "llama" and r.comm.codec.name == "fp8_e5m2"
    assert r.optimizer.entry.name == "muon" and r.gift.route_frame == "muon"
    assert isinstance(r.method, GiftPlan) and r.method.gift_layers == r.gift.layers
    assert r.optimizer.schedule_steps == tiny_config.train.num_steps
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.comm.seed = 1


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_comm_options_follow_the_codec(tiny_config, codec):
    """Block scales only where the codec supports them; stochastic rounding and error
    feedback only where it quantizes (asked of the codec: every codec, a new one included)."""
    facts = get_codec(codec)
    block = 64 if facts.supports_block_scaling else None
    rounding = not facts.is_exact
    r = recipe_of(set_fields(tiny_config, {
        "comm.codec": codec, "comm.scaling": "block", "comm.block_size": 64,
        "comm.stochastic_rounding": True, "comm.error_feedback": True}))
    assert r.comm.block_size == block
    assert r.comm.stochastic_rounding is rounding and r.comm.error_feedback is rounding


def test_other_family_and_plumage(tiny_config):
    config = set_fields(tiny_config, {"comm.method": "plumage", "plumage.gift": True,
                                      "optimizer.schedule_steps": 500})
    with config.unlocked():
        config.model = {"family": "gpt", "d_model": 64, "num_heads": 2}
    r = recipe_of(config)
    assert r.model_config == GPTConfig(d_model=64, num_heads=2) and r.model.family == "gpt"
    assert isinstance(r.method, PlumagePlan) and r.method.gift_layers == ("*/mlp/down_proj",)
    assert r.optimizer.schedule_steps == 500


def test_bad_settings_are_refused_at_the_door(tiny_config):
    with pytest.raises(ConfigError, match="comm.codec='fp7' is not supported"):
        recipe_of(set_fields(copy.deepcopy(tiny_config), {"comm.codec": "fp7"}))
    with pytest.raises(ConfigError, match="train.global_batch_size=8 must be divisible"):
        recipe_of(tiny_config, num_devices=3)
