"""One path and selection rule for GIFT, PLUMAGE, capture and the trainer (utils.tree_paths)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from nnx_toys import ListModel

from gift_jax.lowrank import mask_excluding
from gift_jax.training.optim import plumage_mask
from gift_jax.utils import tree_paths as tp
from gift_jax.whitening.capture import find_linear_layers
from gift_jax.whitening.stage import GiftDimensionNumbers, select_layers


def test_paths_of_dicts_states_and_variables_agree():
    model = ListModel(rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    from_state = tp.flat_paths(state)
    from_pure = tp.flat_paths(nnx.to_pure_dict(state))
    assert set(from_state) == set(from_pure) and from_state
    assert all(not p.endswith("/value") for p in from_state)
    key = (jax.tree_util.DictKey("layers"), jax.tree_util.SequenceKey(3),
           jax.tree_util.GetAttrKey("kernel"), jax.tree_util.GetAttrKey("value"))
    assert tp.leaf_path(key) == "layers/3/kernel"
    assert tp.join_path(("layers", 3, "mlp")) == "layers/3/mlp"


def test_patterns_select_leaf_or_module_and_report_unmatched():
    assert tp.matches("layers/0/mlp/down_proj/kernel", "*/mlp/down_proj")  # module pattern
    assert tp.matches("layers/0/mlp/down_proj/kernel", ["x", "*/down_proj/kernel"])
    assert not tp.matches("layers/0/mlp/down_proj/bias", "*/mlp/down_proj")  # never a bias
    assert not tp.matches("layers/0/mlp/up_proj/kernel", "*/down_proj")
    paths = ["embed/embedding", "layers/0/mlp/down_proj/kernel"]
    assert tp.unmatched(["*/down_proj", "*/q_proj", "embed/*"], paths) == ["*/q_proj"]
    mask = tp.path_mask({"embed": {"embedding": jnp.zeros(2)}, "w": jnp.zeros(3)}, ["embed/*"])
    assert mask == {"embed": {"embedding": True}, "w": False}


def test_one_unmatched_pattern_error_names_setting_patterns_and_paths():
    paths = [f"layers/{i}/mlp/down_proj/kernel" for i in range(8)]
    tp.require_matches(["*/down_proj"], paths, "gift.layers")  # all matched: no error
    with pytest.raises(tp.UnmatchedPatternError) as err:
        tp.require_matches(["*/down_proj", "*/q_prj"], paths, "gift.layers")
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in msg
    assert msg.startswith("gift.layers: pattern(s) ['*/q_prj'] match no path")
    assert "layers/0/mlp/down_proj/kernel" in msg and msg.endswith(", ...)")
    with pytest.raises(tp.UnmatchedPatternError, match=r"\(available: a\)"):
        tp.require_matches(["b"], ["a", "a/kernel"], "x", examples=["a"])


def test_every_selection_raises_the_one_error():
    """GIFT, capture and the trainer's plumage.layers report a typo alike."""
    model = ListModel(rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with pytest.raises(tp.UnmatchedPatternError, match=r"^gift\.layers: .*\['\*/nope'\]"):
        select_layers(params, ["*/nope"])
    with pytest.raises(tp.UnmatchedPatternError, match=r"^gift\.dimension_numbers: "):
        select_layers(params, ["*/mlp/down_proj"], {"*/nope": GiftDimensionNumbers()})
    with pytest.raises(tp.UnmatchedPatternError, match=r"^capture\.layers: .*/kernel"):
        find_linear_layers(model, ["*/nope"])
    with pytest.raises(tp.UnmatchedPatternError, match=r"^plumage\.layers: .*\['\*/nope'\]"):
        plumage_mask(("*/mlp/*", "*/nope"), 4)(params)


def test_mask_excluding_takes_patterns():
    params = {"embed": {"embedding": jnp.zeros((4, 3))}, "lm_head": {"kernel": jnp.zeros((3, 4))},
              "layers": {"0": {"embedder": {"kernel": jnp.zeros((3, 3))}}},
              "norm": {"scale": jnp.zeros(3)}}
    mask = mask_excluding("embed/*", "lm_head")(params)  # a leaf pattern and a module pattern
    assert mask == {"embed": {"embedding": False}, "lm_head": {"kernel": False},
                    "layers": {"0": {"embedder": {"kernel": True}}}, "norm": {"scale": False}}
