"""Pallas kernels equal their jnp references bit for bit (interpreted on CPU, both compiled at
XLA's default code generation: tests/codegen.py), lower for GPU (Triton) and TPU (Mosaic)
through jax.export, and backend="auto" never crashes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codegen import at_default_codegen

from gift_jax.comm import codecs as C
from gift_jax.comm.kernels import backend as kb
from gift_jax.comm.kernels import quantize as qk

CASES = [(c.name, c.block_size if c.supports_block_scaling else None)
         for c in C.codec_variants(32)] + [("fp8_e5m2", 48)]


def _inputs(codec, rows, key=0):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    x = jax.random.normal(k1, (rows, codec.row_size)) * jnp.exp(
        3 * jax.random.normal(k2, (rows, 1)))
    x = x.at[1].set(0.0)  # a zero row
    leaf = None
    if codec.has_leaf_scale:
        leaf = C.leaf_scale_from_amax(jnp.max(jnp.abs(x), axis=1, keepdims=True), codec)
    bits = jax.random.bits(k3, x.shape, jnp.uint32)
    return x, leaf, bits


def _bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("name,block", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_kernel_equals_reference(name, block, stochastic):
    codec = C.get_codec(name, block)
    x, leaf, bits = _inputs(codec, rows=37)  # 37 rows: not a multiple of the 8-row tile
    bits = bits if stochastic else None
    ref = at_default_codegen(qk.quantize_reference, x, codec, leaf, bits, static_argnums=(1,))
    ker = at_default_codegen(lambda x, leaf, bits: qk.quantize_pallas(
        x, leaf, bits, codec=codec, block_rows=8, platform="interpret"), x, leaf, bits)
    _bitwise_equal(ker[0], ref[0])
    assert (ker[1] is None) == (ref[1] is None)
    if ref[1] is not None:
        _bitwise_equal(ker[1], ref[1])


@pytest.mark.parametrize("name,block", CASES)
def test_dequantize_accumulate_kernel_equals_reference(name, block):
    codec = C.get_codec(name, block)
    n, rows = 3, 21
    payloads, scales, leaves = [], [], []
    for i in range(n):
        x, leaf, _ = _inputs(codec, rows, key=10 + i)
        p, s = qk.quantize_reference(x, codec, leaf)
        payloads.append(p)
        scales.append(s)
        leaves.append(leaf)
    payload = jnp.stack(payloads)
    row = None if scales[0] is None else jnp.stack(scales)
    leaf = None if leaves[0] is None else jnp.stack(leaves)
    ref = at_default_codegen(qk.dequantize_accumulate_reference, payload, codec, row, leaf,
                             static_argnums=(1,))
    ker = at_default_codegen(lambda p, r, l: qk.dequantize_accumulate_pallas(
        p, r, l, codec=codec, block_rows=8, platform="interpret"), payload, row, leaf)
    _bitwise_equal(ker, ref)
    # and the reference is the plain fixed-order sum of the decoded chunks (both compiled:
    # XLA may contract a multiply-add into an FMA, so eager and jitted code can differ)
    manual = at_default_codegen(lambda p, r, l: sum(
        C.decode_rows(p[i], None if r is None else r[i], codec, None if l is None else l[i])
        for i in range(n)), payload, row, leaf)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(manual))


def test_default_codegen_is_xlas_default():
    """The options the bit-identity tests pin are XLA's defaults, as XLA's own flag help (a
    process started with ``XLA_FLAGS=--help``) prints them."""
    import re

    from codegen import DEFAULT_CODEGEN, start_jax

    help_text = start_jax("--help").stderr
    defaults = dict(re.findall(r"^\s*--(\w+)=(\S*)\s", help_text, re.M))
    assert {name: defaults.get(name) for name in DEFAULT_CODEGEN} == {
        name: str(v).lower() for name, v in DEFAULT_CODEGEN.items()}


def test_backend_setting():
    codec = C.get_codec("fp8_e4m3")
    x = jnp.zeros((64, 128))
    assert kb.choose("xla", "quantize", codec, (x, None, None)) == "xla"
    assert kb.choose("auto", "quantize", codec, (x, None, None)) == "xla"  # CPU
    assert kb.choose("pallas", "quantize", codec, (x, None, None)) == "pallas"
    with pytest.raises(ValueError, match="backend='cuda'.*allowed"):
        kb.resolve_backend("cuda")
    with pytest.raises(ValueError, match="platform='cuda'.*allowed"):
        qk.quantize_pallas(x, None, None, codec=codec, platform="cuda")
