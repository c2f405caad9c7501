"""The compiled program cache (:mod:`gift_jax.training.program`): one :class:`Program` per
(config minus run control, mesh, compiler options, update rule), so resuming or re-running a
config in one process reuses its compiled steps, and anything that changes the computation
builds a new one; the cache is bounded."""

import copy

import optax
import pytest
from trainer_kit import FAST, small_config

from gift_jax.training import complete_config, make_mesh
from gift_jax.training import program as program_module
from gift_jax.training.config import set_fields as _set_fields
from gift_jax.training.program import program_for


def set_fields(config, fields):
    """A changed copy of ``config`` (``set_fields`` changes its argument)."""
    return _set_fields(copy.deepcopy(config), fields)


@pytest.fixture
def config():
    return complete_config(small_config("fp8"))


def test_same_computation_same_program(config):
    mesh = make_mesh()
    first = program_for(config, mesh, FAST)
    run_control = set_fields(config, {"train.log_every": 5, "train.workdir": "/tmp/elsewhere",
                                      "train.checkpoint_every": 3, "train.eval_every": 2})
    assert program_for(run_control, mesh, FAST) is first
    assert program_for(config, mesh, None) is not first  # other compiler options


@pytest.mark.parametrize("change", [
    {"comm.codec": "fp8_e5m2"}, {"comm.method": "gift"}, {"optimizer.learning_rate": 1e-3},
    {"model.d_ff": 48}, {"train.seed": 1},
])
def test_a_change_of_computation_builds_another_program(config, change):
    mesh = make_mesh()
    assert program_for(set_fields(config, change), mesh, FAST) is not program_for(
        config, mesh, FAST)


def test_update_rule_identity_and_mesh_are_part_of_the_key(config):
    mesh = make_mesh()
    rule = lambda schedule: optax.sgd(schedule)
    with_rule = program_for(config, mesh, FAST, update_rule=rule)
    assert program_for(config, mesh, FAST, update_rule=rule) is with_rule
    assert program_for(config, mesh, FAST, update_rule=lambda s: optax.sgd(s)) is not with_rule
    assert program_for(config, make_mesh(intra_size=2), FAST) is not program_for(
        config, mesh, FAST)


def test_the_cache_is_bounded(config, monkeypatch):
    monkeypatch.setattr(program_module, "_CACHE_SIZE", 2)
    mesh = make_mesh()
    programs = [program_for(set_fields(config, {"train.seed": s}), mesh, FAST)
                for s in range(3)]
    assert len(program_module._CACHE) <= 2
    assert program_for(set_fields(config, {"train.seed": 2}), mesh, FAST) is programs[2]
    assert program_for(set_fields(config, {"train.seed": 0}), mesh, FAST) is not programs[0]
