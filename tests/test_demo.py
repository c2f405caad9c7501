"""Smoke test of the README demo's library side: one short run, the table and the PNG."""

import os
import pathlib

import pytest
from trainer_kit import FAST

from gift_jax.apps.demo import format_table, run_demo
from gift_jax.apps.plotting import plot_runs, read_metrics

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it

SMALL = """
import pathlib, runpy

def get_config():
    config = runpy.run_path(str(pathlib.Path({tiny!r})))["get_config"]()
    config.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64, max_seq_len=16)
    config.train.seq_len = 16
    return config
"""


def test_demo_one_mode_table_and_plot(tmp_path):
    tiny = pathlib.Path(__file__).resolve().parent.parent / "configs" / "tiny.py"
    cfg = tmp_path / "small.py"
    cfg.write_text(SMALL.format(tiny=str(tiny)))
    rows = run_demo(tmp_path, cfg, steps=4, modes=("fp8",), show_progress=False,
                    compiler_options=FAST)
    (row,) = rows
    assert row["mode"] == "fp8" and 0.24 < row["wire_vs_fp32"] < 0.27
    assert 0 < row["eval_loss"] < 6 and 0 < row["roundtrip_rel_l2"] < 0.1
    assert "| fp8 (e4m3, per tensor) |" in format_table(rows)
    png = plot_runs({"fp8": row["workdir"]}, tmp_path / "loss.png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nope")
    # the README command is re-runnable: a second run replaces the first one's workdir ...
    again = run_demo(tmp_path, cfg, steps=4, modes=("fp8",), show_progress=False,
                     compiler_options=FAST)
    assert again[0]["eval_loss"] == row["eval_loss"]  # same seed, fresh run
    # ... but never a directory holding anything else
    (tmp_path / "fp8" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        run_demo(tmp_path, cfg, steps=4, modes=("fp8",), show_progress=False)


def test_the_demo_pins_xla_cpu_to_avx2_on_x86(monkeypatch):
    import platform

    from gift_jax.utils import cpu_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert not cpu_devices.pin_cpu_isa("AVX2")  # not an x86 host: nothing to pin
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert cpu_devices.pin_cpu_isa("AVX2")
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8",
                                               "--xla_cpu_max_isa=AVX2"]
    assert not cpu_devices.pin_cpu_isa("AVX512")  # a setting already there wins
    assert os.environ["XLA_FLAGS"].endswith("--xla_cpu_max_isa=AVX2")
