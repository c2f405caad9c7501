"""Smoke test of the communication benchmark's library functions (scripts/bench_comm.py)."""

import jax
import pytest

from gift_jax.apps.bench import quantize_throughput, wire_table
from gift_jax.models import LlamaConfig, param_shapes


def test_wire_table_and_throughput_smoke():
    cfg = LlamaConfig(vocab_size=256, d_model=64, num_layers=1, num_heads=2, d_ff=128,
                      max_seq_len=16)
    mesh = jax.make_mesh((8,), ("data",))
    rows = wire_table(param_shapes(cfg), mesh, codecs=(("fp32", None), ("fp8_e4m3", None)))
    assert rows[0]["ratio_to_fp32"] == 1.0
    fp8 = rows[1]
    assert fp8["ideal_ratio"] == 0.25 and 0.25 <= fp8["ratio_to_fp32"] <= 0.255 * 1.02
    tp = quantize_throughput(1 << 14, repeats=1)
    assert tp["cast_s"] > 0 and tp["per_block_over_cast"] > 0 and tp["platform"] == "cpu"


@pytest.mark.slow
def test_device_check_script_smoke(tmp_path):
    """scripts/device_check.py on CPU: the roofline table proves one pass for every kernel and
    codec on GPU and TPU, and the interpreted kernels equal their references bit for bit."""
    import json
    import pathlib
    import runpy

    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "device_check.py"
    out = tmp_path / "dc.json"
    runpy.run_path(str(script))["main"](["--elements", "4096", "--repeats", "1",
                                         "--out", str(out)])
    report = json.loads(out.read_text())
    assert len(report["roofline"]) == 12  # 6 codecs × 2 kernels
    for row in report["roofline"]:
        assert row["gpu"].endswith("(one pass)") and row["tpu"].endswith("(one pass)"), row
    for check in report["device"]:
        assert check["platform"] == "interpret"
        assert check["quantize_bitwise_equal"] and check["quantize_stochastic_bitwise_equal"]
        assert check["accumulate_bitwise_equal"], check
        assert "quantize_pallas_fraction_of_hbm" not in check  # no bandwidth claims on CPU


@pytest.mark.slow  # compiles a train step: about 30 s on 2 shared cores
def test_bench_data_script_smoke(tmp_path):
    """scripts/bench_data.py on a small text directory: pipeline, tokenize and train-step
    tokens/s of the byte tokenizer and a trained SentencePiece."""
    import json
    import pathlib
    import runpy

    pytest.importorskip("sentencepiece")
    pytest.importorskip("tensorflow_datasets")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "thou art the king of all this land and i the fool who follows thee".split()
    for i in range(4):
        lines = (" ".join(words[(i + j) % len(words):] + words[:j % 5]) for j in range(400))
        (corpus / f"{i}.txt").write_text("\n".join(lines))
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_data.py"
    runpy.run_path(str(script))["main"]([
        "--config", "tiny", "--data", f"text:{corpus}", "--data_dir", str(tmp_path / "dd"),
        "--tokenizers", "byte,spm:300", "--batches", "2", "--repeats", "1",
        "--set", "model.num_layers=1", "--set", "train.seq_len=32",
        "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "bench_data.json").read_text())
    assert [r["tokenizer"] for r in report["rows"]] == ["byte", "spm:300"]
    assert [r["vocab"] for r in report["rows"]] == [256, 300]
    for r in report["rows"]:
        assert r["pipeline_tokens_per_s"] > 0 and r["tokenize_tokens_per_s"] > 0
    assert report["train_step"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_stream_script_smoke(tmp_path):
    """scripts/bench_stream.py on a 4 MB generated corpus: its JSON lines become one TFDS
    record each, the first batch comes with a freshly trained SentencePiece, the pipeline's
    tokens/s and memory per worker count and the pod arithmetic are reported."""
    import json
    import pathlib
    import runpy

    pytest.importorskip("sentencepiece")
    pytest.importorskip("tensorflow_datasets")
    pytest.importorskip("grain")
    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_stream.py"
    runpy.run_path(str(script))["main"]([
        "--out", str(tmp_path), "--gigabytes", "0.004", "--tokenizer", "spm:400",
        "--config", "tiny", "--workers", "0,1", "--batches", "2", "--repeats", "1"])
    report = json.loads((tmp_path / "bench_stream.json").read_text())
    assert report["corpus_bytes"] >= 0.004 * 2**30 and report["train_documents"] > 1000
    assert 0 < report["tokenizer_s"] < report["first_batch_s"]
    assert [(r["workers"], r.get("id_cache", False)) for r in report["rows"]] == [
        (0, False), (1, False), (1, True)]
    assert report["id_cache_build_s"] > 0
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 for r in report["rows"])
    assert report["grid"]["first_batch_s"] > report["tokenizer_s"]
    assert report["pod"]["cores_needed"] > 0
    assert "Time to the first batch" in (tmp_path / "bench_stream.md").read_text()


def test_pod_unknown_mode_names_the_allowed_ones():
    import ml_collections

    from gift_jax.apps.pod import MODES, compile_mode, mode_config
    from gift_jax.training.config import ConfigError

    match = (r"mode='fp16' is not supported; allowed modes: fp32, fp8, gift_fp8, plumage_fp8, "
             r"xla_bf16, xla_fp32$")
    assert tuple(MODES) == ("fp32", "fp8", "gift_fp8", "plumage_fp8")
    with pytest.raises(ConfigError, match=match):  # a ValueError, not a bare KeyError
        mode_config(ml_collections.ConfigDict(), "fp16", (8, 1, 1), 8)
    with pytest.raises(ConfigError, match=match):
        compile_mode(ml_collections.ConfigDict(), "fp16", (8, 1, 1))



@pytest.mark.parametrize("mode,dtype", [("xla_bf16", "bfloat16"), ("xla_fp32", "float32")])
def test_pod_xla_baseline_is_gspmds_own_reduction(mode, dtype):
    """The baseline rows: the trainer's model (computing in the mode's dtype), loss and
    optimizer in a plain jit with the parameters' shardings and no shard_map: GSPMD reduces
    the gradients itself (in the dtype its partitioner picks: f32 here on XLA:CPU, bf16 on
    the TPU compiler), and nothing quantized crosses data."""
    import pathlib

    import gift_jax as gj
    from gift_jax.apps.pod import mode_config, xla_step
    from gift_jax.training.config import load_config
    from gift_jax.training.mesh import mesh_from_config
    from gift_jax.training.program import Program

    config = load_config("tiny", pathlib.Path(__file__).resolve().parent.parent / "configs")
    config.model.num_layers = 1
    config = mode_config(config, mode, (4, 2, 1), 8)
    program = Program(config, mesh_from_config(config.mesh, jax.devices()[:8]))
    report = gj.parse_hlo(xla_step(program).compile().as_text(), mesh=program.mesh)
    across = report.over("data")
    assert across.ops and "u8" not in across.by_dtype
    assert program.model_config.dtype == dtype
    grads = [op for op in across.ops if op.kind in ("all-reduce", "reduce-scatter")]
    assert sum(op.buffer_bytes for op in grads) >= 2 * program.model_config.d_model ** 2
    assert {d for op in grads for d in op.dtypes} <= {"f32", "bf16"}, report.table()
