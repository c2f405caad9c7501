"""When the quantized reduction pays (gift_jax.apps.crossover): compiled steps found by folder
and mode, replayed per link, the fp8 step's ratio to XLA's own per tokens per device falling
as the link slows and as the tokens per device shrink, the TPU points read from docs/pod, and
the chart written."""

import pathlib

import pytest

from gift_jax.apps import crossover, pod_estimate

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _step(matmul: int, comm_bytes: int) -> str:
    """A scheduled step: a ``matmul``-sized square matmul (its compute), then a synchronous
    all-reduce of ``comm_bytes`` over 16 GPUs on two nodes (its exposed communication)."""
    n, group = comm_bytes // 4, ",".join(map(str, range(16)))
    return (f"%add (a: f32[], b: f32[]) -> f32[] {{\n  %a = f32[] parameter(0)\n}}\n\n"
            f"ENTRY %main (p: bf16[{matmul},{matmul}]) -> f32[{n}] {{\n"
            f"  %p = bf16[{matmul},{matmul}] parameter(0)\n"
            f"  %mm = bf16[{matmul},{matmul}] dot(%p, %p), lhs_contracting_dims={{1}}, "
            "rhs_contracting_dims={0}\n"
            f"  %g = f32[{n}] parameter(1)\n"
            f"  ROOT %ar = f32[{n}] all-reduce(%g), replica_groups={{{{{group}}}}}, "
            "to_apply=%add\n}\n")


@pytest.fixture
def hlo_root(tmp_path):
    """Two batch sizes of one model: XLA's bf16 step reduces 4x the fp8 step's bytes."""
    for batch, matmul in ((8, 2048), (64, 4096)):
        folder = tmp_path / crossover.hlo_name("toy", batch)
        folder.mkdir()
        for mode, nbytes in (("xla_bf16", 1 << 30), ("fp32", 2 << 30), ("fp8", 1 << 28)):
            (folder / f"{mode}_16x1x1_flat_ordinary_-.hlo.txt").write_text(
                _step(matmul, nbytes))
        (folder / "fp8_16x1x1_flat_refresh_-.hlo.txt").write_text("ignored")
    return tmp_path


def test_the_ratio_falls_with_slower_links_and_fewer_tokens(hlo_root, tmp_path):
    from gift_jax.utils.gpu import parse_gpu_topology

    points = crossover.find_points(hlo_root, {"toy": 1024}, devices=16)
    assert sorted({(p.mode, p.tokens_per_device) for p in points}) == sorted(
        (m, t) for m in crossover.MODES for t in (512, 4096))
    by_link = {}
    for link in ("ib100", "ib800"):
        cluster = pod_estimate.GpuCluster.of(parse_gpu_topology("h100", 2, None, link))
        by_link[link] = crossover.ratios(crossover.step_seconds(points, cluster), "xla_bf16")
    (small, r100_small), (large, r100_large) = by_link["ib100"]["toy"]
    assert small < large and r100_small < r100_large < 1  # fewer tokens: comm weighs more
    assert by_link["ib100"]["toy"][0][1] < by_link["ib800"]["toy"][0][1]  # slower link
    tpu = crossover.tpu_points(ROOT / "docs" / "pod", {"llama_7b_v5p-128": 512 * 2048})
    assert [p.label for p in tpu] == ["Llama-7B v5p-128 (ICI)"]
    assert tpu[0].tokens_per_device == 16384 and 0.9 < tpu[0].ratio < 1.2
    png = tmp_path / "chart.png"
    crossover.plot({"ib100": {"xla_bf16": by_link["ib100"]}}, tpu, png, "toy")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _compile_pod_main():
    import runpy

    return runpy.run_path(str(ROOT / "scripts" / "compile_pod.py"))["main"]


def test_compile_pod_gpu_bad_input_is_one_line(capsys, monkeypatch):
    """An unknown GPU or link lists the known ones; without the gpu-aot extra the line names
    the pip install to run."""
    main = _compile_pod_main()
    assert main(["--config", "tiny", "--gpu", "a100"]) == 2
    assert "unknown GPU 'a100'; known: h100, gh200" in capsys.readouterr().err
    assert main(["--config", "tiny", "--gpu", "h100", "--link", "eth10"]) == 2
    assert "unknown link 'eth10'; known: ib100, ib200, ib400, ib800, slingshot200" in (
        capsys.readouterr().err)
    from gift_jax.utils import gpu

    def missing(*_):
        raise gpu.GpuTopologyError(gpu.INSTALL_HINT)

    monkeypatch.setattr(gpu, "_devices", missing)
    assert main(["--config", "tiny", "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install -e ".[gpu-aot]"' in err, err
