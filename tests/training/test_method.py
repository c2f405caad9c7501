"""The communication plans (:mod:`gift_jax.training.method`): which plan each ``comm.method``
gets and what it asks of the host (variants, refresh schedule, captured layers, extra update
arguments), and the chain each plan builds around its stage."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from trainer_kit import recipe_of

from gift_jax.training import complete_config
from gift_jax.training.config import ConfigError, set_fields
from gift_jax.training.method import (
    STATS,
    CommPlan,
    GiftPlan,
    PlumagePlan,
    build_optimizer,
    captures,
    is_refresh,
)
from gift_jax.training.recipe import route_frame


def plan_of(config):
    """The communication plan of ``config``'s recipe."""
    return recipe_of(config).method


@pytest.fixture
def config(tiny_config):
    return complete_config(tiny_config)


def test_each_method_gets_its_plan(config):
    none = plan_of(set_fields(config, {"comm.codec": "bf16", "comm.method": "none"}))
    assert type(none) is CommPlan and none.codec == "bf16" and none.variants() == (False,)
    assert none.refresh_fraction() == 0.0 and none.capture_layers(True) == ()
    assert none.update_kwargs(True, {"x": 1}) == {}

    gift = plan_of(set_fields(config, {"comm.codec": "fp8_e4m3", "comm.method": "gift",
                                         "gift.refresh_every": 25}))
    assert isinstance(gift, GiftPlan) and gift.variants() == (False, True)
    assert gift.refresh_fraction() == 1 / 25
    assert [gift.refresh_due(s, None) for s in (0, 1, 24, 25, 50)] == [True, False, False,
                                                                       True, True]
    assert gift.capture_layers(True) == ("*/mlp/down_proj",) and gift.capture_layers(False) == ()
    assert gift.update_kwargs(True, "A") == {"gift_stats": "A"}
    assert gift.update_kwargs(False, None) == {}

    plumage = plan_of(set_fields(config, {"comm.method": "plumage", "plumage.gift": True}))
    assert isinstance(plumage, PlumagePlan) and plumage.gift_layers == ("*/mlp/down_proj",)
    assert plumage.update_kwargs(False, None) == {"plumage_refresh": False}
    assert plumage.update_kwargs(True, "A") == {"plumage_refresh": True, "gift_stats": "A"}


def _plan(config, fields):
    """The plan of a copy of ``config`` with ``fields`` set."""
    return plan_of(set_fields(complete_config(config), fields))


def test_gift_statistics_steps_between_refreshes(config):
    """The bias-corrected EMA folds statistics every gift.stats_every steps (STATS: capture,
    fold with gift_refresh=False) and refreshes every gift.refresh_every; the artifact's folds
    on refreshes only."""
    gift = _plan(config, {"comm.codec": "fp8_e4m3", "comm.method": "gift",
                          "gift.refresh_every": 25, "gift.stats_every": 10})
    assert gift.stats_every == 10 and gift.stats_variant
    assert [gift.refresh_due(s, None) for s in (0, 5, 10, 20, 25, 30, 50)] == [
        True, False, STATS, STATS, True, STATS, True]
    assert not bool(STATS) and int(STATS) == 0 and STATS != False and STATS != True  # noqa: E712
    assert is_refresh(True) and not is_refresh(STATS) and not is_refresh(False)
    assert captures(STATS) and captures(True) and not captures(False)
    assert gift.capture_layers(STATS) == ("*/mlp/down_proj",)
    assert gift.update_kwargs(STATS, "A") == {"gift_stats": "A", "gift_refresh": False}
    assert gift.update_kwargs(True, "A") == {"gift_stats": "A"}
    assert gift.variants() == (False, True)  # STATS compiles on its first step
    every_refresh = _plan(config, {"comm.method": "gift", "gift.refresh_every": 5,
                                   "gift.stats_every": 10})
    assert not every_refresh.stats_variant  # every statistics step is a refresh step
    artifact = _plan(config, {"comm.method": "gift", "gift.refresh_every": 25,
                              "gift.ema_scheme": "artifact"})
    assert artifact.stats_every is None and not artifact.stats_variant
    assert [artifact.refresh_due(s, None) for s in (0, 10, 25)] == [True, False, True]
    for bad, match in (({"gift.stats_every": 0}, r"^gift.stats_every=0 must be an int >= 1$"),
                       ({"gift.stats_half_life": -1.0}, r"^gift.stats_half_life=-1.0 must be "),
                       ({"gift.ema_scheme": "adam"}, r"^gift.ema_scheme='adam' is not "
                                                     r"supported; allowed: bias_corrected, "
                                                     r"artifact$")):
        with pytest.raises(ConfigError, match=match):
            _plan(config, {"comm.method": "gift", **bad})


def test_two_sided_gift_passes_both_statistics(config):
    plan = plan_of(set_fields(config, {"comm.codec": "fp8_e4m3", "comm.method": "gift",
                                         "gift.two_sided": True}))
    assert plan.update_kwargs(True, ("A", "B")) == {"gift_stats": "A", "gift_output_stats": "B"}


def test_unknown_method_and_route_frames(config):
    with pytest.raises(ConfigError, match="comm.method='dgc' is not supported; allowed: "):
        plan_of(set_fields(config, {"comm.method": "dgc"}))
    assert route_frame(set_fields(config, {"gift.route_frame": "optimizer",
                                           "optimizer.name": "muon"})) == "muon"
    assert route_frame(set_fields(config, {"gift.route_frame": "optimizer",
                                           "optimizer.name": "adamw"})) == "adam"
    assert route_frame(set_fields(config, {"gift.route_frame": "whitened"})) == "whitened"


def test_the_chain_reduces_then_clips_then_steps(config):
    """One replica, fp32: the chain is AdamW on the clipped gradient, and the recorded norm is
    the unclipped one (what the logs show)."""
    config = set_fields(config, {"optimizer.grad_clip_norm": 1.0, "optimizer.warmup_steps": 1,
                                 "optimizer.weight_decay": 0.0})
    opt = build_optimizer(recipe_of(config), ("data",))
    params = {"w": jnp.ones((3, 4))}
    grads = {"w": jnp.full((3, 4), 2.0)}  # norm 2·√12 > 1: clipped

    def step(g, p):
        state = opt.tx.init(p)
        return opt.tx.update(g, state, p)

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    spec = jax.sharding.PartitionSpec()
    updates, state = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec),
                                           out_specs=spec, check_vma=False))(grads, params)
    ref = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(opt.schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0))
    want, _ = ref.update(grads, ref.init(params), params)
    np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)
    assert float(opt.plan.grad_norm(state.inner, False)) == pytest.approx(
        float(jnp.linalg.norm(grads["w"])), rel=1e-6)
