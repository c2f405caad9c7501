"""Reducing inside the backward pass (:mod:`gift_jax.comm.overlap`): the in-backward train step
is bit for bit the step that reduces the same groups after the backward, scanned layers reduce
inside the backward loop, the groups go in reverse layer order, and the settings refuse what is
not built."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_kit import FAST, assert_trees_equal, small_config

from gift_jax.comm.layer_groups import LayerGroups
from gift_jax.comm.overlap import warn_if_one_bucket
from gift_jax.comm.stage import allreduce
from gift_jax.lowrank import scale_by_plumage
from gift_jax.training import ConfigError, complete_config, make_mesh
from gift_jax.training.config import validate_config
from gift_jax.training.program import Program
from gift_jax.training.step import TrainStep
from gift_jax.utils.tree_paths import leaf_path

BUCKET = 3000  # elements: one test model's layer (10k) is over it, so one group each


def _programs(codec: str, scan: bool, accum: int, **extra):
    """The in-backward program and its after-backward twin (same grouped stage)."""
    config = complete_config(small_config("fp8", **{
        "comm.codec": codec, "comm.reduce_in": "backward", "model.scan_layers": scan,
        "model.num_layers": 2, "train.grad_accum_steps": accum, "comm.bucket_elems": BUCKET,
        **extra}))
    program = Program(config, make_mesh(fsdp=config.mesh.fsdp, tensor=config.mesh.tensor), FAST)
    step = program.step
    after = TrainStep(program.model_def, dataclasses.replace(program.optimizer, in_backward=False),
                      program.mesh, *step.abstract_args()[:2], global_batch=16, seq_len=16,
                      accum_steps=accum, compiler_options=FAST, layout=step.layout)
    return program, after


def _two_steps(step, params, opt_state):
    """Two steps, each waited for: XLA:CPU can deadlock when the 8 simulated devices start
    two programs with collectives in different orders (seen here: 7 devices waiting in an
    all-reduce of one step while the 8th waits to launch it behind another program)."""
    placed = jax.tree.map(lambda a: a.sharding, step.abstract_args()[:2])
    params, opt_state = jax.block_until_ready(jax.device_put(
        jax.tree.map(jnp.copy, (params, opt_state)), placed))
    for i in range(2):
        tokens = np.random.RandomState(i).randint(0, 256, (16, 17)).astype(np.int32)
        params, opt_state, metrics = jax.block_until_ready(step(
            params, opt_state, jax.device_put(tokens, step.batch_sharding),
            step.refresh_due(i, opt_state)))
    return params, opt_state, metrics


# stochastic rounding with error feedback unrolled: the GIFT, PLUMAGE and FSDP cases
@pytest.mark.parametrize("codec,scan,accum,extra", [
    ("fp8_e4m3", True, 2, {"comm.error_feedback": True, "comm.stochastic_rounding": True,
                           "model.dtype": "bfloat16"}),
    ("nvfp4", True, 1, {"mesh.intra_size": 2}),
    ("int8", True, 1, {"comm.exchange": "permute", "comm.scaling": "block",
                       "comm.block_size": 32}),
    ("fp8_e4m3", False, 1, {"comm.method": "gift", "gift.refresh_every": 2,
                            "comm.error_feedback": True, "comm.stochastic_rounding": True}),
    ("fp8_e4m3", False, 1, {"comm.method": "gift", "gift.refresh_every": 2,
                            "gift.route_frame": "adam", "gift.two_sided": True}),
    ("fp8_e4m3", False, 1, {"comm.method": "plumage", "comm.error_feedback": True,
                            "comm.stochastic_rounding": True}),
    ("fp8_e4m3", False, 2, {"mesh.fsdp": 2, "comm.stochastic_rounding": True,
                            "comm.error_feedback": True}),
    ("fp8_e4m3", True, 1, {"mesh.fsdp": 2, "mesh.tensor": 2, "comm.error_feedback": True}),
    ("fp8_e4m3", False, 1, {"mesh.fsdp": 2, "comm.method": "gift"}),
], ids=["fp8_sr_ef_scanned_accum_bf16", "nvfp4_hierarchical_scanned",
        "int8_block_permute_scanned", "gift_sr_ef_unrolled",
        "gift_routed_two_sided_unrolled", "plumage_sr_ef_unrolled",
        "fsdp_fp8_sr_ef_unrolled_accum", "fsdp_tensor_fp8_ef_scanned", "fsdp_gift_unrolled"])
@pytest.mark.slow
def test_in_backward_step_is_bit_identical_to_after_backward(codec, scan, accum, extra):
    """Two steps (GIFT: a refresh step, which reduces after the backward, then an ordinary
    step with the new factors, reduced inside it). A bf16 model's scanned weights enter the
    layer loop cast once; the hooks reduce their bf16 cotangents in fp32 through slots."""
    program, after = _programs(codec, scan, accum, **extra)
    params, opt_state = program.init()
    inside = _two_steps(program.step, params, opt_state)
    outside = _two_steps(after, params, opt_state)
    assert_trees_equal(inside, outside)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, inside[0]))
    assert all(moved)  # two real steps


@pytest.mark.parametrize("codec,scan,accum,extra", [
    ("fp32", True, 1, {}),
    ("fp32", False, 2, {}),
    ("fp8_e4m3", True, 2, {"comm.method": "gift", "gift.refresh_every": 2}),
    ("fp8_e4m3", True, 2, {"comm.method": "plumage", "model.dtype": "bfloat16"}),
    ("fp8_e4m3", False, 1, {"mesh.fsdp": 2, "comm.method": "plumage"}),
], ids=["fp32_scanned", "fp32_unrolled_accum", "gift_scanned_accum", "plumage_scanned_accum_bf16",
        "fsdp_plumage_unrolled"])
@pytest.mark.slow
def test_in_backward_step_agrees_to_rounding_where_not_bit_identical(codec, scan, accum, extra):
    """The fp32 codec (a plain psum, whose fusion with the accumulation XLA:CPU may round
    differently in the two graphs), scanned layers with GIFT or PLUMAGE (jax 0.12); PLUMAGE on an
    FSDP mesh (GSPMD sums the projection's partial products over ``fsdp`` in another order in
    the two graphs): the two steps differ in the last bits of some leaves (the CPU compiler
    rounds the two graphs' gradients differently; a stochastic rounding can then flip), never
    by more than fp32 rounding here."""
    program, after = _programs(codec, scan, accum, **extra)
    params, opt_state = program.init()
    inside, outside = (_two_steps(s, params, opt_state)[0] for s in (program.step, after))
    for a, b in zip(jax.tree.leaves(inside), jax.tree.leaves(outside), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _loop_bodies(hlo: str) -> list[str]:
    """The text of every while loop's body computation."""
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    out = []
    for name in bodies:
        m = re.search(rf"^%?{re.escape(name)} [^\n]*\{{\n(.*?)\n\}}", hlo, re.S | re.M)
        if m:
            out.append(m.group(1))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "plumage"])
def test_scanned_layers_reduce_inside_the_backward_loop(method):
    """In-backward: the u8 all-to-all of the layers' fp8 reduction (PLUMAGE: of their projected
    coordinates) sits in a loop body that also runs the backward's matmuls; after the backward
    it sits in a loop of its own, without."""
    program, after = _programs("fp8_e4m3", True, 1, **{"comm.method": method})

    def where(step):
        bodies = _loop_bodies(step.compiled(False).as_text())
        reduce = [b for b in bodies if re.search(r"u8\[[^\]]*\][^\n]*all-to-all", b)]
        assert reduce, "no u8 all-to-all in any loop"
        return any(" dot(" in b or "convolution(" in b for b in reduce)

    assert where(program.step)
    assert not where(after)


def _tree(layers: int, scanned: bool):
    block = {"attn": jnp.zeros((8, 8)), "norm": jnp.zeros((8,))}
    if scanned:
        blocks = jax.tree.map(lambda x: jnp.zeros((layers, *x.shape)), block)
    else:
        blocks = {str(i): block for i in range(layers)}
    return {"embed": jnp.zeros((16, 8)), "final_norm": jnp.zeros((8,)), "layers": blocks}


def test_groups_go_in_reverse_layer_order_and_close_when_full():
    tree = _tree(4, scanned=False)
    paths = [leaf_path(p).split("/") for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

    def names(plan):  # the layer indices or module names of each group
        return [sorted({paths[i][1] if paths[i][0] == "layers" else paths[i][0] for i in g})
                for g in plan.loose]

    one_layer = LayerGroups().plan(tree, 72)  # a layer is 72 elements: one per group
    assert names(one_layer) == [["3"], ["2"], ["1"], ["0"], ["embed"], ["final_norm"]]
    two_layers = LayerGroups().plan(tree, 73)  # a group closes once it holds >= 73
    assert names(two_layers)[:2] == [["2", "3"], ["0", "1"]]
    whole = LayerGroups().plan(tree, 10_000)
    assert whole.loose == (tuple(range(len(paths))),) and not whole.stacked
    with pytest.raises(ValueError, match="bucket_elems=0"):
        LayerGroups().plan(tree, 0)


def test_scanned_layers_are_one_group_each():
    plan = LayerGroups(stacked=True).plan(_tree(5, scanned=True), 64)
    assert plan.num_layers == 5 and len(plan.stacked) == 2 and len(plan.loose) == 2
    assert plan.num_groups == 7


def test_bucket_over_the_model_warns_once(caplog):
    tree = _tree(2, scanned=False)
    with caplog.at_level(logging.WARNING):
        assert warn_if_one_bucket(tree, 1 << 24)
        assert not warn_if_one_bucket(tree, 8)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "comm.bucket_elems=16777216" in lines[0]


def test_the_in_backward_step_warns_when_one_bucket_holds_the_gradient(caplog):
    """Checked on what each device reduces (PLUMAGE: the coordinates; a sharded mesh: the
    shards), where the groups are planned."""
    program, _ = _programs("fp8_e4m3", False, 1, **{"comm.method": "plumage",
                                                     "comm.bucket_elems": 1 << 24})
    with caplog.at_level(logging.WARNING, logger="gift_jax.comm.overlap"):
        program.step.compiled(False)
    assert [r for r in caplog.records if "holds the whole gradient" in r.getMessage()]


@pytest.mark.parametrize("fields,match", [
    ({"comm.bucket_elems": 0}, r"comm.bucket_elems=0 must be an int >= 1"),
    ({"comm.reduce_in": "during"}, r"comm.reduce_in='during' is not supported; allowed: after, "
                                   r"backward"),
    ({"comm.method": "plumage", "plumage.gift": True},
     r"comm.reduce_in='backward' with comm.method='plumage' needs plumage.gift=False"),
    ({"comm.method": "gift", "gift.refresh": "adaptive"}, r"needs gift.refresh='fixed'"),
])
def test_settings_refuse_what_is_not_built(fields, match):
    config = complete_config(small_config("fp8", **{"comm.reduce_in": "backward", **fields}))
    with pytest.raises(ConfigError, match=match):
        validate_config(config, 8)


def test_plumage_refuses_coordinates_from_the_backward_where_it_cannot_take_them():
    """A refresh step reduces the full gradient after the backward; a resampling PLUMAGE may
    redraw its projection inside the update, after the coordinates were taken."""
    params = {"w": jnp.ones((16, 8))}
    tx = scale_by_plumage(rank=2, communicate=allreduce("data"))
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs communicate=, plumage_refresh=False"):
        tx.update(params, state, params, plumage_refresh=True,
                  reduced_in_backward=state.comm_state)
    tx = scale_by_plumage(rank=2, resample_every=3, communicate=allreduce("data"))
    with pytest.raises(ValueError, match="resample_every redraws projections"):
        tx.around(allreduce("data")).frame_in_backward(params, tx.init(params))
