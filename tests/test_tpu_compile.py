"""The real TPU compiler on this host (libtpu's compile-only devices, no TPU): meshes laid out
on physical topologies (one slice, two slices), kernels chosen by the lowering target and
compiled by Mosaic. Skipped, with one line, where libtpu is not installed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax as gj
from gift_jax.comm import codecs as C
from gift_jax.comm.kernels import backend as kb
from gift_jax.comm.kernels import roofline as R
from gift_jax.models import LlamaConfig, param_shapes
from gift_jax.training.mesh import MeshLayoutError, make_mesh
from gift_jax.utils import tpu

if not tpu.libtpu_available():
    pytest.skip(f"{tpu.INSTALL_HINT} (TPU compile tests skipped)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _no_persistent_cache():
    """No persistent compilation cache here: an executable compiled for compile-only devices
    is written to it but cannot be read back (no client to load it), so a test that compiles
    a program another test (here or in test_kernel_lowering) compiled would warn and compile
    again."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()  # JAX decides whether to use the cache once; make it decide again
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    reset_cache()


V5P_64 = tpu.parse_topology("v5p-128")  # 64 chips, 4x4x4
V5E_2X16 = tpu.parse_topology("v5e-16", slices=2)  # 2 slices of 4x4


def test_topology_names():
    assert (V5P_64.grid, V5P_64.chips, V5P_64.hbm_bytes) == ("4x4x4", 64, 95 * 2**30)
    assert tpu.parse_topology("v5e-256").grid == "16x16"
    assert tpu.parse_topology("v6e:8x8").label == "v6e-64"
    assert V5E_2X16.label == "2 x v5e-16"
    with pytest.raises(tpu.TopologyError, match=r"unknown topology 'v5p-100'; known: .*v5p-128"):
        tpu.parse_topology("v5p-100")
    with pytest.raises(tpu.TopologyError, match="--slices=0"):
        tpu.parse_topology("v5e-16", slices=0)


@pytest.mark.parametrize("shape", [(8, 8, 1), (4, 16, 1), (2, 8, 4)])
def test_single_slice_mesh_maps_onto_the_torus(shape):
    devices = tpu.topology_devices(V5P_64)
    mesh = make_mesh(devices=devices, fsdp=shape[1], tensor=shape[2])
    assert tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    # each tensor group is physically adjacent: neighbours differ in one coordinate by 1
    if shape[2] > 1:
        coords = np.array([[d.coords for d in row] for row in mesh.devices[0, 0:1, :]])[0]
        assert all(np.abs(np.diff(coords, axis=0)).sum(axis=1) <= 2)


def test_multi_slice_mesh_puts_data_across_slices():
    devices = tpu.topology_devices(V5E_2X16)
    mesh = make_mesh(devices=devices, fsdp=4, tensor=2)  # data = 4: 2 per slice
    assert tuple(mesh.shape.values()) == (4, 4, 2)
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    for replica in range(4):  # a replica's fsdp x tensor devices share one slice
        assert len(set(slices[replica].flat)) == 1
    assert set(slices[:, 0, 0]) == {0, 1}  # and data crosses the slices
    with pytest.raises(MeshLayoutError, match=r"mesh 1x16x2 .* cannot be laid out on 2 slices "
                       r"of TPU v5 lite 4x4x1 .*not a multiple of the 2 slices.*shapes that fit: "
                       r"2x1x16, "):
        make_mesh(devices=devices, fsdp=16, tensor=2)


def _compiled_psum(mesh, codec, backend, pack="bytes"):
    body = lambda g: gj.quantized_psum(g[0], "data", codec=codec, backend=backend,
                                       pack=pack)[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))
    arg = jax.ShapeDtypeStruct((mesh.size, 8192), jnp.float32,
                               sharding=NamedSharding(mesh, P("data")))
    return f.lower(arg).compile().as_text()


@pytest.mark.parametrize("backend", ["pallas", "auto"])
@pytest.mark.parametrize("codec", ["fp8_e4m3", "mxfp8", "bf16"])
def test_kernels_follow_the_mesh_not_the_host(backend, codec):
    """From this CPU host, the all-reduce compiled for a v5p mesh carries the Mosaic kernels
    (quantize, dequantize-accumulate twice each; a per-tensor fp8 bucket packed as bytes,
    the default, encodes its leaves and decodes the gathered bytes where they lie, in fused
    element-wise ops: the two kernels of the reduced shard remain); "xla" carries none."""
    assert jax.default_backend() == "cpu"
    mesh = make_mesh(devices=tpu.topology_devices(tpu.parse_topology("v5p-16")))
    kernels = lambda **kw: _compiled_psum(mesh, codec, backend, **kw).count("tpu_custom_call")
    assert kernels() == (2 if codec == "fp8_e4m3" else 4)
    assert kernels(pack="floats") == 4
    assert "tpu_custom_call" not in _compiled_psum(mesh, codec, "xla")


def test_auto_falls_back_where_mosaic_refuses(monkeypatch):
    """NVFP4's quantize kernel packs 4-bit pairs into i8 vectors, which Mosaic does not
    compile: "auto" warns once and uses XLA there; "pallas" raises."""
    monkeypatch.setattr(kb, "_warned", set())
    mesh = make_mesh(devices=tpu.topology_devices(tpu.parse_topology("v5p-16")))
    with pytest.warns(RuntimeWarning, match=r"'quantize' does not build for codec 'nvfp4'.*"
                      r"on tpu.*Mosaic"):
        text = _compiled_psum(mesh, "nvfp4", "auto")
    assert "tpu_custom_call" in text  # the dequantize-accumulate kernels remain
    with pytest.raises(Exception, match="Mosaic"):
        _compiled_psum(mesh, "nvfp4", "pallas")


@pytest.mark.parametrize("device_kind", ["TPU v5", "TPU v6 lite"])
@pytest.mark.parametrize("codec", C.codec_variants(128), ids=lambda c: c.label)
def test_every_kernel_compiles_for_v5p_and_v6e(device_kind, codec):
    """Every kernel of every wire format, on the shapes the all-reduce makes for the tiny
    model on 8 replicas, compiled (not only lowered) by Mosaic for the chip. A sub-byte
    format (NVFP4) is the exception, asked of the codec: Mosaic refuses its quantize (4-bit
    codes packed in pairs into i8 vectors), and its dequantize-accumulate builds or not by
    shape (8-byte rows take a whole lane tile each: scoped VMEM runs out at these shapes, not
    at test_auto_falls_back_where_mosaic_refuses's); "auto" runs XLA wherever one does not."""
    shapes = [tuple(s.shape) for s in jax.tree.leaves(param_shapes(LlamaConfig()))]
    calls = R.collective_calls(shapes, codec, 8)
    assert {k for k, _ in calls} == {"quantize", "dequantize_accumulate"}
    for kind, args in calls:
        if codec.bits < 8 and kind != "quantize":
            continue  # builds or not by shape (see above): nothing to assert, slow to try
        error = kb.lowering_error(kind, codec, args, "tpu", device_kind)
        if codec.bits >= 8:
            assert error is None, (kind, args, error)
        else:
            assert error is not None and "Mosaic" in error, (kind, args, error)


def test_trainer_step_compiles_for_two_slices():
    """The trainer's own step (the tiny model with one block, fp8) compiled by the TPU compiler
    for 2 slices of v5e 4x4: the data reduction crosses slices as MegaScale sends, the rest
    stays inside."""
    import pathlib
    import runpy

    from gift_jax.apps.pod import compile_mode

    config = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "configs" / "tiny.py"))
    config = config["get_config"]()
    config.train.global_batch_size = 32
    config.model.num_layers = 1  # the bytes scale with the blocks, the ratios below do not
    [row] = compile_mode(config, "fp8", (4, 8, 1),
                         tpu.topology_devices(V5E_2X16), topology=V5E_2X16)
    assert row.compiler == "TPU" and row.topology == "2 x v5e-16"
    assert row.hbm_bytes == 16 * 2**30 and 0 < row.total_bytes < row.hbm_bytes
    assert row.dcn_bytes > 0 and row.ici_bytes >= row.data_bytes > 0
    assert row.dcn_bytes < row.fp32_local_bytes  # the uint8 wire crosses slices, not fp32
    assert row.overlap is not None and row.overlap.collectives > 0
    assert row.row()["compiler"] == "TPU"
    # reduced inside each slice first (mesh.intra_size = the 2 replicas of a slice), only the
    # quantized reduction of half the shard crosses, by ppermute (measured: fp32 80 kB, flat
    # fp8 43 kB, hierarchical fp8 17 kB per chip; flat fp8 was 51 kB while the TPU compiler
    # turned its flat all-gather into an all-reduce, before the wire buffers became rows)
    [fp32] = compile_mode(config, "fp32", (4, 8, 1), tpu.topology_devices(V5E_2X16),
                          topology=V5E_2X16)
    [hier] = compile_mode(config, "fp8", (4, 8, 1), tpu.topology_devices(V5E_2X16),
                          topology=V5E_2X16, intra=2)
    assert hier.row()["reduction"] == "2 first"
    assert hier.dcn_bytes < 0.45 * row.dcn_bytes
    assert hier.dcn_bytes < 0.25 * fp32.dcn_bytes


def test_scanned_flash_step_compiles_with_the_flash_kernel():
    """model.attention_impl='flash' with scanned layers: the trainer's step compiled for a
    v5p slice with fsdp=4 carries the Pallas flash kernels (forward and backward), each in its
    own shard_map over the model axes."""
    import pathlib
    import runpy

    from gift_jax.training.config import complete_config, set_fields
    from gift_jax.training.mesh import mesh_from_config
    from gift_jax.training.program import Program

    config = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "configs" / "tiny.py"))
    config = set_fields(complete_config(config["get_config"]()), {
        "model.attention_impl": "flash", "model.scan_layers": True, "model.remat": True,
        "model.dtype": "bfloat16", "comm.codec": "fp8_e4m3", "mesh.data": 2, "mesh.fsdp": 4,
        "mesh.tensor": 1})
    devices = tpu.topology_devices(tpu.parse_topology("v5p-16"))
    text = Program(config, mesh_from_config(config.mesh, devices)).step.compiled(False).as_text()
    kernels = {line.split("custom_call_target=")[0].split("=")[0].strip()
               for line in text.splitlines() if "tpu_custom_call" in line}
    assert any("flash" in line and "tpu_custom_call" in line for line in text.splitlines())
    assert len(kernels) >= 3  # the forward, dq and dkv kernels at least


def test_in_backward_ppermute_reduction_is_asynchronous_and_xla_reduces_bf16_gradients():
    """Data parallel on a v5p slice (8 replicas), the tiny model scanned with the flash kernel:
    XLA's own reduction moves a bf16 all-reduce of the parameters (not gathered activations:
    its attention kernel is split by rows), and the fp8 reduction inside the backward by
    ppermutes is asynchronous, every collective across data a start/done pair with compute
    scheduled between, at a quarter of fp32's bytes."""
    import pathlib
    import runpy

    from gift_jax.apps.pod import compile_mode
    from gift_jax.training.config import complete_config, set_fields

    config = runpy.run_path(str(pathlib.Path(__file__).parent.parent / "configs" / "tiny.py"))
    config = set_fields(complete_config(config["get_config"]()), {
        "model.attention_impl": "flash", "model.scan_layers": True, "model.remat": True,
        "model.dtype": "bfloat16", "model.num_layers": 2, "train.global_batch_size": 32})
    topology = tpu.parse_topology("v5p-16")
    devices = tpu.topology_devices(topology)
    [xla] = compile_mode(config, "xla_bf16", (8, 1, 1), devices, topology=topology)
    assert xla.data_bytes <= 1.05 * 2 * 7 / 8 * 2 * xla.params
    config = set_fields(config, {"comm.reduce_in": "backward", "comm.exchange": "permute"})
    [ours] = compile_mode(config, "fp8", (8, 1, 1), devices, topology=topology)
    assert ours.row()["reduction"] == "flat, in backward, ppermute"
    o = ours.overlap
    assert o.collectives > 0 and o.asynchronous >= 0.9 * o.collectives, o
    assert any(n > 0 for n in o.compute_between), o
    assert ours.data_bytes <= 0.26 * ours.fp32_local_bytes


def test_compile_pod_script_topology(tmp_path, capsys):
    """scripts/compile_pod.py --topology: one row per (mesh, mode), each compiled in a child
    process by the TPU compiler; bad topologies and slice counts get one line, no traceback."""
    import json
    import pathlib
    import runpy
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "compile_pod.py"
    proc = subprocess.run([sys.executable, str(script), "--config", "tiny", "--topology",
                           "v5p-16", "--mesh", "8,1,1", "--modes", "xla_bf16,fp8", "--set",
                           "model.num_layers=1", "--out", str(tmp_path), "--option",
                           "xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    xla, row = json.loads((tmp_path / "tiny_v5p-16.json").read_text())
    assert (row["compiler"], row["topology"], row["mesh"]) == ("TPU", "v5p-16", "8x1x1")
    assert (xla["mode"], row["mode"]) == ("xla_bf16", "fp8")
    for r in (xla, row):  # the step-time model's columns (gift_jax.apps.pod_estimate)
        assert r["step_ms"] >= r["compute_ms"] > 0 and r["ici_ms"] > 0, r
        assert r["step_ms"] == pytest.approx(r["compute_ms"] + r["exposed_ms"], rel=1e-3)
        assert 0 <= r["data_covered"] <= 1
        assert r["flags"] == "xla_jf_spmd_threshold_for_windowed_einsum_mib=1000000"
    # a real all-gather, not the u32 all-reduce a flat u8 wire buffer became: fp8 moves a
    # quarter of an fp32 reduction's bytes (0.375 before the wire buffers were lane-dense)
    assert row["vs_fp32_shard"] <= 0.26, row
    assert "compiler: TPU (libtpu), v5p-16: 8 chips of TPU v5" in proc.stdout
    main = runpy.run_path(str(script))["main"]
    for args, message in [(("--topology", "v5x-16"), "unknown topology 'v5x-16'; known: "),
                          (("--topology", "v4-16"), "no published bandwidths for TPU 'v4'; "
                           "step times are estimated for: v5p, v5e, v6e"),
                          (("--topology", "v6e-16", "--slices", "2"), "no published DCN "
                           "bandwidth for TPU 'v6e'; multi-slice step times are estimated "
                           "for: v5p, v5e"),
                          (("--topology", "v5e-16", "--slices", "2", "--mesh", "3,4,1"),
                           "--mesh '3,4,1' does not divide the 32 devices of 2 x v5e-16: "
                           "mesh.data=3, mesh.fsdp=4, mesh.tensor=1 multiply to 12, not to "
                           "the number of devices (32)"),
                          (("--topology", "v5e-16", "--slices", "2", "--mesh", "4,8,1"),
                           "train.global_batch_size=8 must be divisible"),
                          (("--topology", "v5e-16", "--slices", "2", "--mesh=-1,16,2"),
                           "mesh 1x16x2 (data x fsdp x tensor) cannot be laid out on 2 slices "
                           "of TPU v5 lite 4x4x1 (mesh.data=1 is not a multiple of the 2 slices)"),
                          (("--topology", "v5p-16", "--option", "windowed"),
                           "--option 'windowed' must be NAME=VALUE")]:
        # in this process (nothing compiles): status 2 and the line, no exception escapes
        assert main(["--config", "tiny", *args]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith(f"error: {message}"), err
