"""Sharded training on a (data, fsdp, tensor) mesh of 8 simulated devices.

The sharded step must train the same model as pure data parallelism (fp32: the same losses up
to reduction order), keep the data replicas bit-identical with every low-precision method,
hold 1/(fsdp·tensor) of the state per device, reduce only each device's local shard across
``data`` (from the HLO), and resume onto another mesh shape.
"""

import json
import math
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from trainer_kit import (
    FAST,
    assert_replicas_identical,
    assert_trees_equal,
    run,
    script_env,
    small_config,
    synthetic_batches,
)

from gift_jax import parse_hlo
from gift_jax.comm.codecs import get_codec
from gift_jax.models import LlamaConfig
from gift_jax.training import Trainer
from gift_jax.training.config import (
    ConfigError,
    complete_config,
    load_config,
    set_fields,
    validate_config,
)
from gift_jax.training.mesh import mesh_from_config
from gift_jax.training.program import program_for
from gift_jax.training.sharding import DEFAULT_RULES, ParamLayout, param_specs
from gift_jax.training.step import loss_for, replica_map

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]


def on_mesh(config, shape):
    return set_fields(config, {"mesh.data": shape[0], "mesh.fsdp": shape[1],
                               "mesh.tensor": shape[2]})


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of ``tree`` (abstract arrays) under ``shardings``."""
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))


# ---- layout and one-line errors (no compile) ------------------------------------------------


def test_parameters_follow_the_logical_axis_rules():
    cfg = LlamaConfig(d_model=64, num_layers=1, num_heads=4, num_kv_heads=2, d_ff=128)
    specs = param_specs(cfg, {"data": 2, "fsdp": 2, "tensor": 2})
    assert specs["layers/0/attn/q_proj/kernel"] == P("fsdp", "tensor")
    assert specs["layers/0/attn/k_proj/kernel"] == P("fsdp", "tensor")
    assert specs["layers/0/attn/o_proj/kernel"] == P("tensor", "fsdp")
    assert specs["layers/0/mlp/down_proj/kernel"] == P("tensor", "fsdp")
    assert specs["embed/embedding"] == P("tensor", "fsdp")
    assert specs["lm_head/kernel"] == P("fsdp", "tensor")
    assert specs["layers/0/attn_norm/scale"] == P(None)
    # axes of size 1 are dropped; a rule of '' replicates
    specs = param_specs(cfg, {"data": 8, "fsdp": 1, "tensor": 1})
    assert all(s == P(*([None] * len(s))) for s in specs.values())
    rules = {"vocab": "", "embed": "fsdp", "heads": "tensor", "kv_heads": "tensor",
             "mlp": "tensor", "norm": ""}
    assert param_specs(cfg, {"fsdp": 4}, rules)["embed/embedding"] == P(None, "fsdp")


def test_optimizer_state_follows_its_parameter():
    cfg = LlamaConfig(d_model=64, num_layers=1, num_heads=4, d_ff=128)
    layout = ParamLayout.of(cfg, {"data": 2, "fsdp": 2, "tensor": 2})
    key = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey(0),
           jax.tree_util.DictKey("mlp"), jax.tree_util.DictKey("up_proj"),
           jax.tree_util.DictKey("kernel"))
    mu = (jax.tree_util.GetAttrKey("mu"), *key)
    assert layout.spec_at(mu, (64, 128)) == P("fsdp", "tensor")  # a moment
    assert layout.spec_at(mu, (8, 128)) == P(None, "tensor")  # PLUMAGE (k, N) coordinates
    assert layout.spec_at(mu, (1, 128, 8)) == P(None, "tensor", None)  # a (N, k) projector
    assert layout.spec_at(mu, (64, 8)) == P("fsdp", None)  # a GIFT factor (n, r)
    assert layout.spec_at(mu, ()) == P()  # a per-layer scalar
    gift_key = (jax.tree_util.DictKey("layers/0/mlp/up_proj/kernel"),)  # GIFT's dict keys
    assert layout.spec_at(gift_key, (1, 64, 8)) == P(None, "fsdp", None)
    assert layout.spec_at((jax.tree_util.GetAttrKey("count"),), ()) is None
    # GIFT's statistics A = E[xxᵀ] (n = 64 on fsdp): split over tensor as well, where it divides
    whitened = (jax.tree_util.GetAttrKey("whitened"), *gift_key)  # GiftState.whitened[path]
    stats = (*whitened, jax.tree_util.GetAttrKey("stats"))
    assert layout.spec_at(stats, (1, 64, 64)) == P(None, "fsdp", "tensor")
    # no unsplit dimension divides: stacked on one that is split, where the product divides
    assert layout.spec_at(stats, (1, 64, 63)) == P(None, ("fsdp", "tensor"), None)
    assert layout.spec_at(stats, (1, 62, 63)) == P(None, "fsdp", None)  # nothing divides
    for member in ("basis", "factor"):  # everything else of GIFT's follows the parameter
        assert layout.spec_at((*whitened, jax.tree_util.GetAttrKey(member)), (1, 64, 8)) == P(
            None, "fsdp", None)
    # PLUMAGE's projector (batch, M, k) of up_proj (M = 128 on tensor) is split over fsdp as
    # well, on M or the layer axis, never on the rank k
    leaves = (jax.tree_util.GetAttrKey("leaves"), *key)  # PlumageState.leaves
    projector = (*leaves, jax.tree_util.GetAttrKey("projector"))
    assert layout.spec_at(projector, (1, 128, 8)) == P(None, ("tensor", "fsdp"), None)
    assert layout.spec_at(projector, (4, 128, 8)) == P("fsdp", "tensor", None)
    assert layout.spec_at(projector, (1, 128, 6)) == P(None, ("tensor", "fsdp"), None)
    on_fsdp = ParamLayout.of(cfg, {"data": 4, "fsdp": 2, "tensor": 1})
    assert on_fsdp.spec_at(projector, (1, 128, 8)) == P(None, "fsdp", None)  # was replicated
    assert on_fsdp.spec_at(projector, (3, 128, 8)) == P(None, "fsdp", None)
    # its moments (batch, k, N) too (N = 64 on fsdp here: over tensor as well)
    assert layout.spec_at((*leaves, jax.tree_util.GetAttrKey("mu")), (1, 8, 64)) == P(
        None, None, ("fsdp", "tensor"))


@pytest.mark.parametrize("fields, needle", [
    ({"mesh.data": 3, "mesh.fsdp": 2}, "multiply to 6, not to the number of devices (8)"),
    ({"mesh.data": -1, "mesh.fsdp": -1}, "only one of mesh.data/fsdp/tensor may be -1"),
    ({"mesh.fsdp": 3}, "the fixed sizes (3) must divide the number of devices (8)"),
    ({"mesh.fsdp": 0}, "mesh.fsdp=0 must be a positive int or -1"),
    ({"mesh.fsdp": 2, "mesh.intra_size": 3}, "mesh.intra_size=3 must divide the number of "
                                              "data-parallel replicas (4)"),
    ({"mesh.fsdp": 2, "mesh.tensor": 2, "train.global_batch_size": 6},
     "must be divisible by the batch split mesh.data x mesh.fsdp = 4"),
])
def test_bad_mesh_settings_are_one_line_errors(fields, needle):
    config = set_fields(small_config(), fields)
    with pytest.raises(ConfigError) as err:
        validate_config(config, 8)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("model, mesh, rules, needle", [
    (dict(d_ff=100), {"tensor": 8}, {"heads": "", "kv_heads": ""},
     "parameter layers/0/mlp/down_proj/kernel (100, 64): its mlp dimension (100) is not "
     "divisible by mesh.tensor=8"),
    (dict(num_kv_heads=2), {"tensor": 4}, {},
     "mesh.tensor=4 must divide model.num_kv_heads=2"),
    (dict(), {"tensor": 8}, {}, "mesh.tensor=8 must divide model.num_heads=4"),
    (dict(), {"fsdp": 2}, {"mlp": "data"}, "mesh.rules.mlp='data' must be one of"),
    (dict(), {"fsdp": 2}, {"mlp": "fsdp"},
     "map two dimensions of layers/0/mlp/down_proj/kernel (128, 64) (mlp, embed)"),
    (dict(), {"fsdp": 2}, {"hidden": "fsdp"}, "mesh.rules has unknown logical axes"),
])
def test_bad_sharding_is_one_line_error_naming_the_parameter(model, mesh, rules, needle):
    cfg = LlamaConfig(**{"d_model": 64, "num_layers": 1, "num_heads": 4, "d_ff": 128, **model})
    with pytest.raises(ConfigError) as err:
        param_specs(cfg, mesh, {**DEFAULT_RULES, **rules})
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name, method, fsdp, tensor, bound", [
    ("tiny", "none", 2, 2, 1.1), ("tiny", "none", 8, 1, 1.1), ("llama_60m", "none", 4, 2, 1.1),
    # PLUMAGE's projectors (M, k) and GIFT's input statistics A (n, n) are split over every
    # model axis (sharding.spread)
    ("llama_60m", "plumage", 4, 2, 1.1), ("tiny", "plumage", 4, 1, 1.1),
    ("tiny", "gift", 2, 2, 1.1), ("tiny", "gift", 4, 1, 1.1)])
def test_per_device_state_is_a_shard_of_the_replicated_state(name, method, fsdp, tensor, bound):
    """Parameters + optimizer state per device ≤ bound × replicated / (fsdp·tensor), read from
    the shardings of the abstract state (nothing is allocated)."""
    sizes = {}
    for shape in [(8, 1, 1), (8 // (fsdp * tensor), fsdp, tensor)]:
        config = on_mesh(complete_config(load_config(f"configs/{name}.py")), shape)
        config = set_fields(config, {"comm.method": method, "comm.codec": "fp8_e4m3"})
        program = program_for(config, mesh_from_config(config.mesh))
        params = jax.eval_shape(program.init_params)
        state = jax.eval_shape(program.init_opt_state, params)
        sizes[shape] = (per_device_bytes(params, program.step.param_shardings)
                        + per_device_bytes(state, program.step.opt_shardings))
    replicated, sharded = sizes[(8, 1, 1)], sizes[(8 // (fsdp * tensor), fsdp, tensor)]
    assert sharded <= bound * replicated / (fsdp * tensor), (replicated, sharded)


# ---- compiled: the wire -----------------------------------------------------------------------


@pytest.mark.slow
def test_cross_data_reduction_moves_only_the_local_shard_in_uint8():
    config = on_mesh(small_config("fp8"), (2, 2, 2))
    program = program_for(config, mesh_from_config(config.mesh), FAST)
    report = program.step.wire_report()
    across = report.over("data")
    big = [op for op in across.ops if op.buffer_bytes > 64]
    assert big and all(set(op.dtypes) == {"u8"} for op in big), across.table()
    # what a device exchanges across data: its local shard's fp8 bytes (+ scales, padding)
    params = jax.eval_shape(program.init_params)
    local = sum(math.prod(s.shard_shape(x.shape)) for x, s in
                zip(jax.tree.leaves(params), jax.tree.leaves(program.step.param_shardings),
                    strict=True))
    whole = sum(x.size for x in jax.tree.leaves(params))
    u8 = sum(op.wire_bytes for op in big)  # P = 2: a reduce-scatter + all-gather = S bytes
    assert local <= u8 <= 1.1 * local + 4096, (u8, local)
    assert u8 < 0.3 * whole  # a quarter of the unsharded fp8 bytes (fsdp·tensor = 4)
    # nothing is gathered over the model axes beyond what the model's forward/backward
    # gathers: the reference is the same gradient computation without any reduction
    def grad(params, tokens):
        loss = loss_for(program.model_def, program.mesh)
        return jax.grad(lambda q: loss(program.model_def.merge(q), tokens))(params)

    reference = jax.jit(replica_map(grad, program.mesh, (P(), P("data")), P()),
                        in_shardings=(program.step.param_shardings, program.step.batch_sharding),
                        out_shardings=program.step.param_shardings)
    batch = jax.ShapeDtypeStruct((16, 17), np.int32, sharding=program.step.batch_sharding)
    compiled = reference.lower(params, batch).compile(FAST)
    gathered = lambda r: sum(op.buffer_bytes for op in r.within(("fsdp", "tensor")).ops
                             if op.kind == "all-gather")
    assert gathered(report) <= gathered(parse_hlo(compiled.as_text(), mesh=program.mesh))


# ---- trained: equivalence, bit-identity, resume ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, shapes", [("adamw", SHAPES),
                                               ("muon", [(8, 1, 1), (2, 2, 2)])])
def test_fp32_losses_equal_on_every_mesh_shape(optimizer, shapes):
    """AdamW, and Muon's Newton–Schulz on split matrices (GSPMD): the same run."""
    losses = {}
    for shape in shapes:
        config = on_mesh(small_config("fp32", optimizer, **{"train.log_every": 1}), shape)
        result = run(config, stop_after=6)
        losses[shape] = [h["loss"] for h in result.history if "loss" in h]
    for shape in shapes[1:]:
        np.testing.assert_allclose(losses[shape], losses[(8, 1, 1)], rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode, extra", [
    ("fp8", {"comm.error_feedback": True, "comm.stochastic_rounding": True}),
    ("gift_fp8", {"comm.error_feedback": True, "gift.route_frame": "optimizer"}),
    ("plumage", {}),
])
def test_low_precision_replicas_stay_identical_on_a_sharded_mesh(mode, extra):
    losses = {}
    for shape in [(8, 1, 1), (2, 2, 2)]:
        config = on_mesh(small_config(mode, **{"train.log_every": 1, **extra}), shape)
        trainer = Trainer(config, batches=synthetic_batches, compiler_options=FAST)
        trainer.run(6)
        losses[shape] = [h["loss"] for h in trainer.history if "loss" in h]
        assert_replicas_identical(trainer.params)
        trainer.finish()
    np.testing.assert_allclose(losses[(2, 2, 2)], losses[(8, 1, 1)], atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp32", "gift_fp8", "plumage"])  # GIFT: fp8 on other leaves
def test_hierarchical_reduction_on_a_sharded_mesh(mode):
    """mesh ('data', 'intra', 'fsdp', 'tensor') = (2, 2, 2, 1), as two slices of two replicas:
    each device's shard is summed over 'intra' in fp32 first, and only the quantized
    reduction of half of it crosses 'data' (half the uint8 bytes of the flat reduction over
    4 replicas); replicas stay bit-identical and the run is the data-parallel one."""
    losses, across = {}, {}
    exact = get_codec(small_config(mode).comm.codec).is_exact
    for intra in (1, 2):
        config = set_fields(on_mesh(small_config(mode, **{"train.log_every": 1}), (4, 2, 1)),
                            {"mesh.intra_size": intra})
        trainer = Trainer(config, batches=synthetic_batches, compiler_options=FAST)
        assert trainer.program.mesh.axis_names == (("data", "intra", "fsdp", "tensor")
                                                   if intra > 1 else ("data", "fsdp", "tensor"))
        report = trainer.program.step.wire_report()
        across[intra] = sum(op.wire_bytes for op in report.over("data").ops
                            if "intra" not in op.axes)
        if intra > 1 and not exact:
            ops = [op for op in report.over("data").ops if op.buffer_bytes > 64
                   and "intra" not in op.axes]
            assert ops and all(set(op.dtypes) == {"u8"} for op in ops), report.table()
        trainer.run(4)
        losses[intra] = [h["loss"] for h in trainer.history if "loss" in h]
        assert_replicas_identical(trainer.params)
        trainer.finish()
    if exact:
        np.testing.assert_allclose(losses[2], losses[1], rtol=2e-5)
    else:
        np.testing.assert_allclose(losses[2], losses[1], atol=0.05)
        assert across[2] < 0.6 * across[1], across


@pytest.mark.slow
def test_resume_onto_another_mesh_shape(tmp_path):
    extra = {"train.log_every": 1, "comm.error_feedback": True, "train.checkpoint_every": 3}
    config = on_mesh(small_config("fp8", **extra), (2, 2, 2))
    straight = run(config, stop_after=6)
    straight_losses = [h["loss"] for h in straight.history if "loss" in h]
    first = Trainer(config, str(tmp_path / "run"), batches=synthetic_batches,
                    compiler_options=FAST)
    first.run(3)
    first.save()
    first.finish()
    for shape in [(2, 2, 2), (8, 1, 1), (2, 4, 1)]:
        workdir = tmp_path / f"resume_{shape}"
        shutil.copytree(tmp_path / "run", workdir)
        resumed = Trainer(on_mesh(small_config("fp8", **extra), shape), str(workdir),
                          resume=True, batches=synthetic_batches, compiler_options=FAST)
        assert resumed.step == 3
        resumed.run(3)
        losses = [h["loss"] for h in resumed.history if "loss" in h]
        if shape == (2, 2, 2):  # the same mesh: bit-exact
            assert losses == straight_losses[3:]
            assert_trees_equal(resumed.params, straight.params)
        else:
            np.testing.assert_allclose(losses, straight_losses[3:], atol=0.02)
        resumed.finish()


@pytest.mark.slow
def test_pod_compile_script_smoke(tmp_path):
    """scripts/compile_pod.py on 16 simulated devices (its own process): a 2-layer tiny model
    on (2, 4, 2), compiled and never run; fp8 crosses data at a quarter of the fp32 shard."""
    env = script_env(JAX_PLATFORMS=None)
    proc = subprocess.run(
        [sys.executable, "scripts/compile_pod.py", "--config", "tiny", "--devices", "16",
         "--mesh", "2,4,2", "--modes", "fp32,fp8", "--set", "model.num_layers=2",
         "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads((tmp_path / "tiny.json").read_text())}
    assert rows["fp32"]["vs_fp32_shard"] == pytest.approx(1.0, abs=1e-3)
    assert 0.25 <= rows["fp8"]["vs_fp32_shard"] <= 0.27
    # a replica of 2 x 8 devices moves 1/(fsdp·tensor) of what replicated DP over 16 moves
    assert rows["fp32"]["vs_replicated_dp"] == pytest.approx((1 / 8) * (1 / 2) / (15 / 16),
                                                             rel=0.05)
    assert rows["fp8"]["args_GiB"] > 0 and rows["fp8"]["replica_MiB"] > 0
    assert (tmp_path / "tiny.md").read_text().startswith("| compiler | topology | mode |")
    # the fsdp collectives in fp8: a row of its own, saying what is quantized, with fewer
    # bytes inside the replica
    proc = subprocess.run(
        [sys.executable, "scripts/compile_pod.py", "--config", "tiny", "--devices", "16",
         "--mesh", "2,4,2", "--modes", "fp8", "--set", "model.num_layers=2",
         "--set", "comm.fsdp_codec=fp8_e4m3", "--set", "comm.fsdp_weight_codec=fp8_e4m3",
         "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fp8 = {r["reduction"]: r for r in json.loads((tmp_path / "tiny.json").read_text())
           if r["mode"] == "fp8"}
    both = fp8["flat, fsdp grads fp8_e4m3, fsdp weights fp8_e4m3"]
    assert both["quantized"] == "data fp8_e4m3, fsdp grads fp8_e4m3, fsdp weights fp8_e4m3"
    assert both["replica_MiB"] < 0.6 * fp8["flat"]["replica_MiB"]
    assert both["data_MiB"] == pytest.approx(fp8["flat"]["data_MiB"], rel=0.01)
