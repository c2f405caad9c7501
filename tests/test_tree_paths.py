"""One path and selection rule for GIFT, PLUMAGE, capture and the trainer (utils.tree_paths)."""

import jax
import jax.numpy as jnp
from flax import nnx
from nnx_toys import ListModel

from gift_jax.utils import tree_paths as tp


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
