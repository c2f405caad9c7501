"""The one table of defaults (:mod:`gift_jax.training.defaults`): every setting commented,
``configs/base.py`` is that table, the trainer's fill-in table is derived from it, each call a
fresh copy, and the ``model`` group is the Llama spec's defaults exactly."""

import inspect
import re

from conftest import CONFIGS

from gift_jax.models import MODELS
from gift_jax.training import defaults
from gift_jax.training.config import TRAINER_DEFAULTS, complete_config, load_config


def test_every_setting_has_a_comment():
    lines = inspect.getsource(defaults.default_config).splitlines()
    settings = 0
    for i, line in enumerate(lines):
        m = re.match(r"\s+(model|opt|train|mesh|comm|gift|plumage|data)\.(\w+) = ", line)
        if not m:
            continue
        settings += 1
        j = i - 1  # a comment block covers the uncommented settings right below it
        while "#" not in line and re.match(r"\s+\w+\.\w+ = [^#]*$", lines[j]):
            j -= 1
        commented = "#" in line or lines[j].strip().startswith("#")
        assert commented, f"{m.group(1)}.{m.group(2)} has no comment: {line.strip()}"
    flat = sum(len(group) for group in defaults.default_config().to_dict().values())
    assert settings == flat  # every setting of the table was seen by the scan


def test_base_config_and_trainer_defaults_are_the_table():
    table = defaults.default_config().to_dict()
    assert load_config("base", CONFIGS).to_dict() == table
    assert TRAINER_DEFAULTS == table
    assert table["model"] == MODELS["llama"].defaults()


def test_each_call_is_a_fresh_copy():
    a = defaults.default_config()
    a.optimizer.learning_rate = 1.0
    a.gift.layers = ("x",)
    b = defaults.default_config()
    assert b.optimizer.learning_rate == 3e-3 and b.gift.layers == ("*/mlp/down_proj",)


def test_completion_fills_only_what_is_missing():
    partial = defaults.default_config()
    with partial.unlocked():
        del partial.gift["eig_method"]
        partial.train.num_steps = 7
    full = complete_config(partial)
    assert full.gift.eig_method == "eigh" and full.train.num_steps == 7
    assert "eig_method" not in partial.gift  # a copy: the argument is untouched
