"""The chain's pieces (:mod:`gift_jax.training.optim`): the learning-rate schedule's warmup and
decay end points, a non-finite update skipped with the whole inner state kept (counted), the
recorded norm, and the codec's block scaling taken from the codec itself."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trainer_kit import recipe_of

from gift_jax.comm.codecs import CODEC_NAMES, get_codec
from gift_jax.comm.stage import allreduce_spec
from gift_jax.training.config import set_fields
from gift_jax.training.optim import (
    learning_rate_schedule,
    record_grad_norm,
    skip_nonfinite,
)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays_to_the_final_rate(tiny_config, kind):
    opt = set_fields(tiny_config, {"optimizer.schedule": kind, "optimizer.warmup_steps": 10,
                                   "optimizer.learning_rate": 1e-2,
                                   "optimizer.final_learning_rate": 1e-3}).optimizer
    lr = learning_rate_schedule(opt, 110)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(5e-3)
    assert float(lr(10)) == pytest.approx(1e-2)
    end = 1e-2 if kind == "constant" else 1e-3
    assert float(lr(110)) == pytest.approx(end, rel=1e-5)
    middle = float(lr(60))
    assert middle == pytest.approx({"cosine": 5.5e-3, "linear": 5.5e-3, "constant": 1e-2}[kind],
                                   rel=1e-4)


def test_warmup_fraction_caps_the_warmup_of_a_short_run(tiny_config):
    """tiny (30 warmup steps, warmup_fraction 0.1) validates at 12 steps with a warmup of 1
    step, keeps its 30 steps at 300; the recipe and the schedule agree; a fraction outside
    [0, 1) is one line naming the setting."""
    from gift_jax.training.config import ConfigError, validate_config, warmup_length

    assert tiny_config.optimizer.warmup_fraction == 0.1
    short = set_fields(tiny_config, {"train.num_steps": 12})
    validate_config(short, 8)
    assert warmup_length(short) == 1 and recipe_of(short).optimizer.warmup_steps == 1
    lr = learning_rate_schedule(short.optimizer, 12)
    assert float(lr(0)) == 0.0 and float(lr(1)) == pytest.approx(3e-3)
    assert warmup_length(set_fields(tiny_config, {"train.num_steps": 300})) == 30
    with pytest.raises(ConfigError, match=r"optimizer.warmup_fraction=1 must be in \[0, 1\)"):
        validate_config(set_fields(tiny_config, {"optimizer.warmup_fraction": 1.0}), 8)
    uncapped = set_fields(tiny_config, {"optimizer.warmup_fraction": 0.0,
                                         "train.num_steps": 12})
    with pytest.raises(ConfigError, match=r"warmup_steps=30 must be < train.num_steps=12"):
        validate_config(uncapped, 8)


def test_nonfinite_update_is_skipped_and_the_state_kept():
    tx = skip_nonfinite(optax.chain(record_grad_norm(), optax.adam(0.1)))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    good, state = jax.jit(tx.update)({"w": jnp.array([1.0, 2.0, 2.0])}, state, params)
    assert float(state.inner[0].norm) == 3.0 and int(state.skipped) == 0
    bad, skipped = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, 2.0])}, state, params)
    assert not np.any(np.asarray(bad["w"])) and int(skipped.skipped) == 1
    assert bool(skipped.last_skipped)
    for a, b in zip(jax.tree.leaves(skipped.inner), jax.tree.leaves(state.inner), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # moments, count, norm


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_block_scaling_follows_the_codec(tiny_config, codec):
    block = 64 if get_codec(codec).supports_block_scaling else None
    config = set_fields(tiny_config, {"comm.scaling": "block", "comm.block_size": 64,
                                      "comm.codec": codec})
    spec = allreduce_spec(recipe_of(config).comm.allreduce(("data",)))
    assert getattr(spec.codec, "name", spec.codec) == codec and spec.block_size == block
