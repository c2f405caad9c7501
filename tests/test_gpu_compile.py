"""The real XLA:GPU compiler on this host (jax's CUDA plugin, compile-only H100s, no GPU): the
trainer's fp8 step compiled for one node of 8 and for 2 nodes of 8, with the Pallas-Triton
kernels compiled into the program (through ptxas), only quantized gradient bytes across the
data axis (across the nodes, with the node's replicas reducing first over NVLink), a program
that fits the GPU, and a step-time estimate from the scheduled HLO. Skipped, with one line,
where the ``gpu-aot`` extra is not installed (the newest CI pair installs it)."""

import pathlib

import jax
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache

import gift_jax as gj
from gift_jax.apps import pod, pod_estimate
from gift_jax.training.config import set_fields
from gift_jax.training.mesh import data_axes, mesh_from_config
from gift_jax.utils import gpu

if not gpu.gpu_compiler_available():
    pytest.skip(f"{gpu.INSTALL_HINT} (GPU compile tests skipped)", allow_module_level=True)


@pytest.fixture(autouse=True)
def _no_persistent_cache():
    """No persistent compilation cache: an executable for compile-only devices is written to
    it but cannot be read back (as in test_tpu_compile)."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    reset_cache()


def test_gpu_table_and_bad_names_are_one_line():
    topo = gpu.parse_gpu_topology("H100", hosts=2)
    assert (topo.gpus, topo.gpus_per_host, topo.link, topo.topology_string) == (
        16, 8, "ib400", "1x2x8")
    assert gpu.parse_gpu_topology("gh200", 16).label == "16 x 4 GH200 (slingshot200)"
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in topo.spec.target_config()
    for kwargs, match in ((dict(gpu="b300"), r"unknown GPU 'b300'; known: h100, gh200"),
                          (dict(gpu="h100", link="ib300"), r"unknown link 'ib300'; known: ib100"),
                          (dict(gpu="h100", hosts=0), r"--hosts=0 must be a positive int"),
                          (dict(gpu="gh200", gpus_per_host=8), r"at most 4 GPUs")):
        with pytest.raises(gpu.GpuTopologyError, match=match):
            gpu.parse_gpu_topology(**kwargs)
    cluster = pod_estimate.GpuCluster.of(topo)
    assert cluster.network_bandwidth == 50e9 and cluster.nvlink_bandwidth == 450e9
    assert cluster.matmul_rate("bf16") == 2 * cluster.matmul_rate("f32")


def test_nccl_bus_model_per_link():
    """NVLink inside a node; across nodes a ring's bus bandwidth is the NICs of the group's
    GPUs on a node (8 on a DGX: 400 GB/s, NVLink's 450 caps it), one GPU per node gets one
    NIC, an all-to-all sends what leaves the node through its NIC; latency per launch."""
    c = pod_estimate.GpuCluster.of(gpu.parse_gpu_topology("h100", hosts=8))
    gb, lat, rtt = 1e9, c.launch_latency, c.network_latency
    assert c.collective("all-reduce", gb, tuple(range(8)), None) == pytest.approx(
        ("NVLink", gb / 450e9 + lat))
    assert c.collective("all-reduce", gb, tuple(range(64)), None) == pytest.approx(
        ("ib400", gb / 400e9 + lat + rtt))
    assert c.collective("all-reduce", gb, tuple(range(0, 64, 8)), None) == pytest.approx(
        ("ib400", gb / 50e9 + lat + rtt))  # one GPU per node: its own NIC
    link, seconds = c.collective("all-to-all", gb, tuple(range(64)), None)
    assert seconds == pytest.approx(gb * 56 / 63 / 50e9 + lat + rtt)
    assert c.collective("all-gather", 0.0, (0, 8), None) == ("NVLink", 0.0)


@pytest.mark.parametrize("hosts", [1, 2])
def test_tiny_fp8_step_compiles_for_h100_nodes(tiny_config, hosts, tmp_path):
    """XLA:GPU compiles the trainer's fp8 step: Triton kernels in the program, uint8 the only
    gradient bytes across the data axis (2 nodes: the node's 8 replicas reduce first in fp32
    over NVLink, mesh.intra_size, and only uint8 leaves a node), the program far inside
    80 GB, and the estimate's clock at least its compute."""
    topo = gpu.parse_gpu_topology("h100", hosts=hosts)
    devices = gpu.topology_devices(topo)
    assert len(devices) == 8 * hosts and devices[-1].process_index == hosts - 1
    config = set_fields(tiny_config, {"train.global_batch_size": 16, "model.num_layers": 2})
    intra = 8 if hosts > 1 else 1
    (row,) = pod.compile_mode(config, "fp8", (8 * hosts, 1, 1), devices, topology=topo,
                              intra=intra, hlo_dir=str(tmp_path))
    assert row.compiler == "XLA:GPU" and row.kernels >= 2  # quantize, dequantize-accumulate
    assert row.total_bytes < 0.9 * topo.hbm_bytes
    e = row.estimate
    assert e is not None and e.step_s >= e.compute_s > 0
    mesh = mesh_from_config(pod.mode_config(config, "fp8", (8 * hosts, 1, 1), len(devices),
                                            intra).mesh, devices)
    (hlo,) = tmp_path.iterdir()
    report = gj.parse_hlo(hlo.read_text(), mesh=mesh)
    flat = mesh.devices.reshape(-1)
    crossing = [op for op in report.over(data_axes(mesh)).ops if op.buffer_bytes > 64
                and (hosts == 1 or len({flat[i].process_index for i in op.group}) > 1)]
    assert crossing and {d for op in crossing for d in op.dtypes} == {"u8"}, report.table()
    assert sum(op.wire_bytes for op in crossing) < 0.3 * row.fp32_local_bytes
    if hosts > 1:
        assert row.network_bytes == pytest.approx(sum(
            op.wire_bytes for op in report.ops
            if len({flat[i].process_index for i in op.group}) > 1))
        assert {c.link for c in e.collectives if c.bytes > 1024} == {"NVLink", "ib400"}
        # the same HLO re-estimated on a 4x slower network, no compile (--from_hlo)
        slow = gpu.parse_gpu_topology("h100", hosts=2, link="ib100")
        (again,) = pod.reestimate_gpu_rows([row.row()], tmp_path, slow, config)
        assert again["topology"] == "2 x 8 H100 (ib100)" and again["mode"] == "fp8"
        assert again["net_ms"] > row.row()["net_ms"] and again["step_ms"] >= e.step_s * 1e3


def test_a_mesh_that_does_not_divide_the_cluster_is_one_line(capsys):
    import runpy

    main = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "scripts" /
                              "compile_pod.py"))["main"]
    assert main(["--config", "tiny", "--gpu", "h100", "--hosts", "2", "--mesh", "5,1,1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "5,1,1" in err and "16 devices" in err, err
