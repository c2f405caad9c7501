"""The blocks' fsdp collectives in a codec (``comm.fsdp_codec``, ``comm.fsdp_weight_codec``;
:mod:`gift_jax.comm.fsdp`) on 8 simulated devices.

With the fp32 codec the step trains exactly as XLA's own FSDP; with fp8 only bytes cross
``fsdp`` for the blocks' gradients, the replicas stay bit-identical, and the loss stays with
fp32's; bad settings are one line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from trainer_kit import FAST, assert_replicas_identical, run, small_config, synthetic_batches

from gift_jax.comm.codecs import get_codec
from gift_jax.comm.fsdp import FsdpCodecs, gathered
from gift_jax.training import Trainer
from gift_jax.training.config import ConfigError, set_fields, validate_config
from gift_jax.training.mesh import mesh_from_config
from gift_jax.training.program import program_for

SCANNED = {"model.scan_layers": True, "model.num_layers": 2, "model.remat": True}


def config_on(shape, mode="fp32", **fields):
    return small_config(mode, **{"train.log_every": 1, "mesh.data": shape[0],
                                 "mesh.fsdp": shape[1], "mesh.tensor": shape[2], **fields})


def losses_of(config, steps=4):
    return [h["loss"] for h in run(config, stop_after=steps).history if "loss" in h]


@pytest.mark.parametrize("codec, weight", [
    ("fp32", None), ("fp8_e4m3", "fp8_e4m3"), ("int8", "int8"), ("mxfp8", "mxfp8")])
@pytest.mark.parametrize("dim", [0, 1])
def test_gathered_weight_and_its_gradient(codec, weight, dim):
    """Forward: every device gets the same whole weight, within the weight codec's rounding
    of each owner's shard. Backward: each device's slice of Σ_r g_r along ``dim``, exact in
    fp32, else within the codec's rounding of each sender's cotangent."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    codecs = FsdpCodecs("fsdp", get_codec(codec), weight and get_codec(weight))
    spec = P("fsdp", None) if dim == 0 else P(None, "fsdp")
    w = jax.random.normal(jax.random.key(1), (24, 32), jnp.float32)
    g = jax.random.normal(jax.random.key(0), (8, 24, 32), jnp.float32)  # device r's cotangent

    def on_device(shard, cot):
        whole, vjp = jax.vjp(lambda x: gathered(x, dim, spec, codecs), shard)
        return whole[None], vjp(cot[0])[0]

    wholes, grad = jax.jit(jax.shard_map(
        on_device, mesh=mesh, in_specs=(spec, P("fsdp")), out_specs=(P("fsdp"), spec),
        check_vma=False))(w, g)
    for whole in np.asarray(wholes)[1:]:
        np.testing.assert_array_equal(whole, wholes[0])
    # half an ulp relative (3 mantissa bits; mxfp8's shared block exponent: a bit more), or
    # for int8 half a step of the owner's amax / 127
    relative = {None: 0.0, "fp8_e4m3": 2.0 ** -4, "mxfp8": 2.0 ** -3}
    if weight == "int8":
        owners = np.split(np.abs(np.asarray(w)), 8, axis=dim)
        bound = np.concatenate([np.full_like(o, o.max() / 254) for o in owners], axis=dim)
    else:
        bound = np.abs(np.asarray(w)) * relative[weight]
    assert np.all(np.abs(np.asarray(wholes[0]) - np.asarray(w)) <= bound + 1e-7)
    exact = np.asarray(g).sum(0)
    err = np.abs(np.asarray(grad) - exact)
    if codec == "fp32":
        np.testing.assert_allclose(grad, exact, rtol=1e-5, atol=1e-5)
    elif codec == "int8":  # half a step of each sender's 1/127 of its amax
        assert np.all(err <= np.sum(np.max(np.abs(np.asarray(g)), axis=(1, 2))) / 254 + 1e-6)
    else:  # each sender's element rounded to 3 mantissa bits
        assert np.all(err <= np.sum(np.abs(np.asarray(g)), 0) * relative[codec] + 1e-6)
    assert codec == "fp32" or 0 < np.linalg.norm(err) / np.linalg.norm(exact) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("shape, fields", [
    ((2, 4, 1), {**SCANNED, "comm.codec": "fp8_e4m3", "comm.reduce_in": "backward"}),
    ((2, 2, 2), {}),
])
def test_fp32_fsdp_codec_trains_as_xla_fsdp(shape, fields):
    """Scanned + rematerialised blocks reduced in the backward (fp8 across data), and unrolled
    ones on a mesh with tensor parallelism: the same losses as XLA's own fsdp collectives."""
    ours = losses_of(config_on(shape, **{**fields, "comm.fsdp_codec": "fp32"}))
    xla = losses_of(config_on(shape, **fields))
    np.testing.assert_allclose(ours, xla, rtol=2e-5)


@pytest.mark.slow
def test_fp8_fsdp_collectives_move_bytes_and_keep_replicas_identical():
    fields = {**SCANNED, "comm.reduce_in": "backward"}
    quantized = config_on((2, 4, 1), "fp8", **fields, **{
        "comm.fsdp_codec": "fp8_e4m3", "comm.fsdp_weight_codec": "int8"})
    program = program_for(quantized, mesh_from_config(quantized.mesh), FAST)
    within = program.step.wire_report().within(("fsdp",))
    u8 = [op for op in within.ops if set(op.dtypes) == {"u8"}]
    # in the scanned block's loop bodies: its 7 weights' gradients reduce-scattered (the
    # backward), the 7 weights gathered (the forward, and again in the rematerialised one)
    assert sum(op.kind == "all-to-all" for op in u8) == 7, within.table()
    assert sum(op.kind == "all-gather" for op in u8) >= 2 * 7, within.table()
    plain = config_on((2, 4, 1), "fp8", **fields)
    xla = program_for(plain, mesh_from_config(plain.mesh), FAST).step.wire_report()
    floats = lambda r: sum(op.wire_bytes for op in r.within(("fsdp",)).ops
                           if not set(op.dtypes) <= {"u8", "pred"})
    assert floats(program.step.wire_report()) < 0.5 * floats(xla)

    trainer = Trainer(quantized, batches=synthetic_batches, compiler_options=FAST)
    trainer.run(6)
    assert_replicas_identical(trainer.params)
    ours = [h["loss"] for h in trainer.history if "loss" in h]
    trainer.finish()
    reference = losses_of(config_on((2, 4, 1), "fp32", **fields), steps=6)
    np.testing.assert_allclose(ours, reference, atol=0.05)


@pytest.mark.slow
def test_gift_refresh_steps_keep_xla_fsdp_and_train():
    """GIFT's refresh variant captures statistics inside the layers: it runs the blocks with
    XLA's collectives, the ordinary steps with the codec's; both keep replicas identical."""
    config = config_on((2, 4, 1), "gift_fp8", **SCANNED, **{"comm.fsdp_codec": "fp8_e4m3"})
    trainer = Trainer(config, batches=synthetic_batches, compiler_options=FAST)
    trainer.run(4)
    assert trainer.program.step.compile_count == 2  # refresh (step 0, 2) and ordinary
    assert_replicas_identical(trainer.params)
    assert all(np.isfinite(h["loss"]) for h in trainer.history if "loss" in h)
    trainer.finish()


@pytest.mark.parametrize("fields, needle", [
    ({"comm.fsdp_codec": "fp8"}, "comm.fsdp_codec='fp8' is not supported; allowed: , fp32"),
    ({"comm.fsdp_codec": "fp8_e4m3", "mesh.data": 8, "mesh.fsdp": 1},
     "which this mesh does not have"),
    ({"comm.fsdp_codec": "fp8_e4m3", "mesh.rules.layers": "fsdp"}, "mesh.rules.layers='fsdp'"),
    ({"comm.fsdp_weight_codec": "int8"}, "comm.fsdp_weight_codec='int8' needs comm.fsdp_codec"),
    ({"comm.fsdp_codec": "fp8_e4m3", "comm.fsdp_weight_codec": "bf16"},
     "comm.fsdp_weight_codec='bf16' is not supported; allowed: , fp8_e4m3"),
])
def test_bad_fsdp_codec_settings_are_one_line_errors(fields, needle):
    config = set_fields(config_on((2, 4, 1), **SCANNED), fields)
    with pytest.raises(ConfigError) as err:
        validate_config(config, 8)
    assert needle in str(err.value) and "\n" not in str(err.value)
