"""Every kernel of every codec lowers for GPU (Triton) and TPU (Mosaic) through jax.export, in
one pass over its data, on the shapes the all-reduce produces for a paper model; and
backend="auto" falls back to XLA, with one warning, where a kernel does not build."""

import pathlib
import runpy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax as gj
from gift_jax.comm import codecs as C
from gift_jax.comm.kernels import backend as kb
from gift_jax.comm.kernels import quantize as qk
from gift_jax.comm.kernels import roofline as R
from gift_jax.models import model_config_of, param_shapes

CODECS = [(c.name, c.block_size if c.supports_block_scaling else None)
          for c in C.codec_variants(128)]
CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(scope="module")
def shapes_600m():
    cfg = runpy.run_path(str(CONFIGS / "gift_llama_600m.py"))["get_config"]()
    return [tuple(s.shape) for s in
            jax.tree.leaves(param_shapes(model_config_of(cfg.model)))]


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("name,block", CODECS)
def test_kernels_lower_in_one_pass_on_collective_shapes(shapes_600m, platform, name, block):
    codec = C.get_codec(name, block)
    for replicas in (8, 64):
        calls = R.collective_calls(shapes_600m, codec, replicas)
        assert {k for k, _ in calls} == {"quantize", "dequantize_accumulate"}
        assert any(a[0].shape[0] == replicas for k, a in calls if k == "dequantize_accumulate")
        for kind, args in calls:
            assert R.memory_ops(kind, codec, args, platform) == \
                R.expected_memory_ops(kind, codec, args), (kind, args)
    # stochastic rounding (random bits per element) and a row count that leaves a partial
    # last tile (masked on GPU)
    x = jax.ShapeDtypeStruct((1037, codec.row_size), jnp.float32)
    leaf = jax.ShapeDtypeStruct((1037, 1), jnp.float32) if codec.has_leaf_scale else None
    args = (x, leaf, jax.ShapeDtypeStruct(x.shape, jnp.uint32))
    assert R.memory_ops("quantize", codec, args, platform) == \
        R.expected_memory_ops("quantize", codec, args)


def test_memory_op_counter_counts_used_loads_only():
    text = """
    %1 = tt.load %0 : tensor<64x128x!tt.ptr<f32>>
    %2 = tt.load %p : tensor<64x128x!tt.ptr<i8>>
    %3 = arith.mulf %1, %1 : tensor<64x128xf32>
    tt.store %p, %3 : tensor<64x128x!tt.ptr<i8>>
    %10 = vector.load %arg1[%c0] : memref<8x128xf32>, vector<8x128xf32>
    tpu.vector_store %arg2[%c0], %10 : memref<8x128xf32>, vector<8x128xf32>,
    """
    assert R.count_memory_ops(text) == (2, 2)  # %2 (a swap's dead load) is not counted


def test_traffic_per_element():
    fp8 = C.get_codec("fp8_e4m3")
    assert R.traffic("quantize", fp8) == (4 + 4 / 128, 1.0)
    assert R.traffic("dequantize_accumulate", fp8, num_chunks=8) == (8 * (1 + 4 / 128), 4.0)
    nv = C.get_codec("nvfp4")
    assert R.traffic("quantize", nv, stochastic=True) == (8 + 4 / 16, 0.5 + 1 / 16)
    with pytest.raises(ValueError, match="kind='pack'"):
        R.traffic("pack", nv)


def test_tile_rows():
    assert qk.tile_rows(100_000, 128, "gpu") == 64  # 8192 elements
    assert qk.tile_rows(37, 128, "gpu") == 64  # one masked tile (Triton: a power of two)
    assert qk.tile_rows(37, 128, "tpu") == 37  # the whole (small) array
    assert qk.tile_rows(100_000, 16, "tpu") == 4096
    assert qk.tile_rows(37, 128, "interpret", block_rows=8) == 8


def test_block_size_that_triton_cannot_tile_falls_back_with_one_warning(monkeypatch):
    """fp8 blocks of 48 elements: Triton tiles must be powers of two, so on a GPU the kernels
    do not build; "auto" must warn once and run the XLA path, and "pallas" must not hide it."""
    codec = C.get_codec("fp8_e4m3", 48)
    x = jax.random.normal(jax.random.key(0), (40, 48))
    reason = kb.lowering_error("quantize", codec, (x, None, None), "gpu")
    assert reason is not None and "power of 2" in reason
    assert kb.lowering_error("quantize", codec, (x, None, None), "tpu") is None

    monkeypatch.setattr(kb, "target_device", lambda: ("gpu", None))  # pretend the target is a GPU
    monkeypatch.setattr(kb, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"kernel 'quantize' does not build for codec "
                      r"'fp8_e4m3' \(block_size=48\) on gpu; using the XLA path.*power of 2"):
        out = kb.quantize(x, codec, backend="auto")
    ref = qk.quantize_reference(x, codec)
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same kernel and codec warn only once
        kb.quantize(x, codec, backend="auto")
    assert kb.choose("pallas", "quantize", codec, (x, None, None)) == "pallas"

    # the whole all-reduce with the default backend runs (on XLA) instead of crashing
    mesh = jax.make_mesh((8,), ("data",))
    grads = jax.random.normal(jax.random.key(1), (8, 300))

    def reduce(backend):
        body = lambda g: gj.quantized_psum(g[0], "data", codec="fp8_e4m3", block_size=48,
                                           backend=backend)[None]
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                  check_vma=False))
        return np.asarray(f(jax.device_put(grads, NamedSharding(mesh, P("data")))))

    with pytest.warns(RuntimeWarning, match="dequantize_accumulate"):
        auto = reduce("auto")
    np.testing.assert_array_equal(auto, reduce("xla"))
