"""Element formats and scales: saturation, zeros, non-finite values, MX/NVFP4 against
independent ml_dtypes oracles, stochastic rounding."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from codegen import at_default_codegen

from gift_jax.comm import codecs as C

PER_TENSOR = ["bf16", "fp8_e4m3", "fp8_e5m2"]


def _rows(x, codec):
    B = codec.row_size
    return x.reshape(-1, B)


def test_e4m3_is_the_fn_variant():
    codec = C.get_codec("fp8_e4m3")
    assert codec.element_dtype == jnp.float8_e4m3fn and codec.fmax == 448.0


@pytest.mark.parametrize("name", C.low_precision_codecs())
def test_saturating_cast_never_nan(name):
    codec = C.get_codec(name)
    y = jnp.array([1e6, -1e6, codec.fmax * 1.01, 3.0e38] * (codec.row_size // 4 or 1))
    y = y[: codec.row_size].reshape(1, -1)
    out = C.decode_elements(C.encode_elements(y, codec), codec)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert bool(jnp.all(jnp.abs(out) == codec.fmax))


@pytest.mark.parametrize("name,block", [(n, None) for n in C.CODEC_NAMES]
                         + [(n, 64) for n in C.block_scaled_codecs()])
def test_zero_roundtrips_to_exact_zero(name, block):
    out = jax.jit(lambda x: C.roundtrip(x, name, block))(jnp.zeros((3, 70)))
    assert out.shape == (3, 70) and bool(jnp.all(out == 0)) and not bool(jnp.any(jnp.signbit(out)))


@pytest.mark.parametrize("name,block", [(n, None) for n in C.low_precision_codecs()]
                         + [("int8", 32)])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_poisons_the_whole_group(name, block, bad):
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    x[5] = bad
    codec = C.get_codec(name, block)
    out = np.asarray(C.roundtrip(jnp.asarray(x), codec))
    # the group that shares a scale with it: the block (mxfp8) or the tensor (per-tensor
    # fp8; nvfp4, whose second-level scale is per tensor)
    B = 64 if codec.has_leaf_scale else codec.block_size
    assert np.isnan(out[5])
    # never finite garbage: every element of the group is NaN or exactly its RTN value
    exact = np.asarray(C.roundtrip(jnp.asarray(np.where(np.isfinite(x), x, 0)), codec))
    group = out[:B]
    assert np.all(np.isnan(group) | (group == exact[:B]))
    # Inf, any per-tensor scale, or an integer format (no NaN code: an explicit check): the
    # whole group
    if not (codec.block_size and bad != bad) or codec.is_integer:
        assert np.isnan(group).all()
    if B < 64:
        assert np.isfinite(out[B:]).all()


@pytest.mark.parametrize("name,block", [("bf16", None), ("fp8_e4m3", None), ("fp8_e5m2", None),
                                        ("fp8_e4m3", 32), ("fp8_e5m2", 128), ("mxfp8", None),
                                        ("int8", None), ("int8", 32)])
def test_roundtrip_error_within_format_precision(name, block):
    codec = C.get_codec(name, block)
    x = jax.random.normal(jax.random.key(0), (4096,)) * jnp.exp(
        jax.random.normal(jax.random.key(1), (4096,)))
    out = C.roundtrip(x, codec)
    err = np.abs(np.asarray(out - x))
    unit = 2.0 ** -(codec.mantissa_bits + 1)
    # relative rounding + half the subnormal spacing at the group's scale
    groups = np.asarray(x).reshape(-1, codec.block_size or 4096)
    amax = np.abs(groups).max(1, keepdims=True)
    if name == "mxfp8":
        scale = 2.0 ** np.ceil(np.log2(amax / 448))
    elif name == "bf16":
        scale = np.zeros_like(amax)
    else:
        scale = amax / codec.fmax
    sub = scale * 2.0 ** (codec.min_exponent - codec.mantissa_bits - 1)
    bound = (unit * np.abs(groups) + sub).reshape(-1) * (1 + 1e-6)
    if codec.is_integer:  # round to nearest integer multiple of the scale
        bound = np.broadcast_to(scale / 2, groups.shape).reshape(-1) * (1 + 1e-6)
    assert (err <= bound).all(), float((err - bound).max())


def _oracle_mx(x):
    """Independent MX reference in numpy: exponent ceil(log2(amax/448)), ml_dtypes cast."""
    g = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(g).max(1, keepdims=True)
    e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448)), -126)
    e = np.clip(e, -126, 127)
    q = np.clip(g / 2.0**e, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float64) * 2.0**e).reshape(-1)


def _oracle_nvfp4(x):
    g = x.reshape(-1, 16).astype(np.float32)
    amax_t = np.float32(np.abs(g).max())
    gs = np.float32(amax_t / np.float32(448 * 6)) if amax_t > 0 else np.float32(1)
    bs = np.clip(np.abs(g).max(1, keepdims=True) / np.float32(6) / gs, 0, 448)
    bs = bs.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * gs
    safe = np.where(bs == 0, 1, bs)
    q = np.clip(np.where(bs == 0, 0, g / safe), -6, 6).astype(ml_dtypes.float4_e2m1fn)
    return (q.astype(np.float32) * bs).reshape(-1)


@pytest.mark.parametrize("block", [None, 32])
def test_int8_matches_independent_oracle(block):
    """Symmetric int8: ``s = amax / 127``, ``q = clip(rint(x · (1/s)), ±127)``, in numpy."""
    x = np.asarray(jax.random.normal(jax.random.key(4), (32 * 16,))) * np.repeat(
        np.linspace(0.01, 10, 16), 32).astype(np.float32)
    x[:32] = 0.0
    g = x.reshape(-1, block or x.size)
    amax = np.abs(g).max(1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(g * (np.float32(1) / s)), -127, 127).astype(np.int8)
    out = np.asarray(C.roundtrip(jnp.asarray(x), "int8", block))
    # the same codes; XLA may divide amax by 127 one ulp apart from numpy
    np.testing.assert_allclose(out, (q.astype(np.float32) * s).reshape(-1), rtol=3e-7, atol=0)
    codec = C.get_codec("int8", block)
    assert codec.row_bytes == codec.row_size and codec.ideal_ratio == (
        0.25 if block is None else 0.25 + 1 / block)


def test_mxfp8_matches_independent_oracle():
    x = np.asarray(jax.random.normal(jax.random.key(2), (32 * 64,))) * np.repeat(
        2.0 ** np.arange(-40, 24), 32).astype(np.float32)
    x[:32] = 0.0
    x[32:64] = 3.0  # amax 3: float8_e8m0fnu would round the scale up to 4
    out = np.asarray(C.roundtrip(jnp.asarray(x), "mxfp8"))
    np.testing.assert_array_equal(out, _oracle_mx(x).astype(np.float32))


def test_mx_exponent_is_explicit_not_an_e8m0_cast():
    byte = C._mx_exponent_byte(jnp.array([0.0, 3.0, 448.0, 1.0, 500.0, 449.0 * 2.0**-20]))
    # ceil(log2(3/448)) = -7; an e8m0 cast of 3 would give 2^2 (and 0 → NaN)
    assert [int(b) - 127 for b in byte] == [-126, -7, 0, -8, 1, -19]


def test_nvfp4_matches_independent_oracle_and_packs_two_per_byte():
    x = np.asarray(jax.random.normal(jax.random.key(3), (16 * 40,))) * np.repeat(
        np.linspace(0.01, 10, 40), 16).astype(np.float32)
    # exact to the oracle at the code users run (tests/codegen.py: the suite's emitters put one
    # quotient on the other side of a rounding tie)
    out = np.asarray(at_default_codegen(C.roundtrip, jnp.asarray(x), "nvfp4",
                                        static_argnums=(1,)))
    np.testing.assert_allclose(out, _oracle_nvfp4(x), rtol=0, atol=0)
    codec = C.get_codec("nvfp4")
    assert codec.row_bytes == 8
    payload, scale = C.encode_rows(jnp.asarray(x[:16]).reshape(1, 16), codec,
                                   jnp.ones((1, 1)) * 0.01)
    assert payload.shape == (1, 8) and scale.dtype == jnp.uint8


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "int8"])
def test_stochastic_rounding_is_unbiased_and_on_grid(name):
    codec = C.get_codec(name)
    n = 40000
    for value in (0.3, -1.37, 2.0 ** (codec.min_exponent - 1) * 1.3):  # includes a subnormal
        y = jnp.full((n,), value, jnp.float32)
        u = C.uniform_from_bits(jax.random.bits(jax.random.key(7), (n,), jnp.uint32), codec)
        q = C.stochastic_round(y, u, codec)
        exact = C.decode_elements(C.encode_elements(q[None], codec), codec)[0]
        np.testing.assert_array_equal(np.asarray(exact), np.asarray(q))  # representable
        assert len(np.unique(np.asarray(q))) <= 2
        spread = float(jnp.max(q) - jnp.min(q))
        # mean within 5 standard errors of the Bernoulli mean
        assert abs(float(jnp.mean(q)) - value) <= 5 * spread / 2 / np.sqrt(n) + 1e-12


@pytest.mark.parametrize(
    "kwargs,match",
    [({"codec": "fp16"}, "codec='fp16'.*allowed"), ({"codec": "fp8_e4m3", "block_size": 0},
                                                     "block_size"),
     ({"codec": "bf16", "block_size": 32}, "block_size"),
     ({"codec": "mxfp8", "block_size": 64}, "mxfp8"),
     ({"codec": "nvfp4", "block_size": 32}, "nvfp4 uses block_size=16")],
)
def test_bad_codec_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C.get_codec(kwargs["codec"], kwargs.get("block_size"))
