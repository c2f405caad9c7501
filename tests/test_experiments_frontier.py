"""Smoke tests of gift_jax.apps.experiments.frontier: the grid, the statistics, and a two-run
slice of the grid trained end to end (tiny model, a few steps, in-memory corpus, 8 devices)."""

import json
import math
import pathlib

import numpy as np
import pytest
from scipy import stats
from trainer_kit import script_env

from gift_jax.apps.experiments import frontier as F
from gift_jax.data import TokenSource
from gift_jax.training.config import load_config

BASE = load_config("base", pathlib.Path(__file__).resolve().parents[1] / "configs")
TINY = F.FrontierSettings(
    steps=4, eval_every=2, eval_batches=2,
    model=(("d_model", 32), ("num_layers", 1), ("num_heads", 2), ("d_ff", 64),
           ("max_seq_len", 16)),
    train=(("train.global_batch_size", 8), ("optimizer.warmup_steps", 1)),
)
REF = F.Cell()
FP8 = F.Cell("fp8_e4m3")


@pytest.fixture(scope="module")
def source():
    text = "To be, or not to be, that is the question. " * 40
    return TokenSource({"train": [text, text.upper()], "validation": [text[::-1]]}, name="t")


def test_cross_product_keeps_only_runnable_cells_and_adds_references():
    cells = F.cross_product()
    names = {c.name for c in cells}
    assert "nvfp4/euclidean/acc-fp8/adamw" not in names  # the FP8 ring takes per-tensor FP8
    assert "fp8_e5m2/gift_ef/acc-fp8/muon" in names
    assert "fp32/ef/acc-fp32/adamw" not in names  # error feedback is off for fp32
    assert {c.reference for c in cells} <= set(cells)
    assert F.Cell("nvfp4", "plumage").reference == F.Cell("fp32", "plumage")
    assert all(F.Cell.parse(c.name) == c for c in cells)
    with pytest.raises(ValueError, match="codec"):
        F.Cell("fp4")


def test_slices_have_their_references_first():
    cells = F.slice_cells(["all"])
    assert len(cells) == len(set(cells))
    refs = [c for c in cells if c.is_reference]
    assert cells[: len(refs)] == refs and {c.reference for c in cells} == set(refs)
    with pytest.raises(ValueError, match="unknown slice"):
        F.slice_cells(["nope"])


def test_t_interval_matches_scipy():
    d = [0.01, 0.03, -0.005, 0.02]
    mean, sd, lo, hi = F.t_interval(d)
    lo_ref, hi_ref = stats.t.interval(0.95, len(d) - 1, loc=np.mean(d), scale=stats.sem(d))
    assert mean == pytest.approx(np.mean(d)) and sd == pytest.approx(np.std(d, ddof=1))
    assert (lo, hi) == (pytest.approx(lo_ref), pytest.approx(hi_ref))


def test_paired_difference_pairs_by_seed():
    recs = [{"cell": "a", "seed": s, "final_eval": v} for s, v in ((0, 2.0), (1, 2.5), (2, 2.2))]
    recs += [{"cell": "b", "seed": s, "final_eval": v} for s, v in ((0, 2.1), (1, 2.6), (2, 2.3))]
    g = F.paired_difference(recs, "b", "a")
    # the seeds' spread (0.25) is far larger than the gap, but every pair moves by +0.1
    assert g["n"] == 3 and g["mean"] == pytest.approx(0.1)
    assert g["sd"] == pytest.approx(0, abs=1e-12)
    recs[-1]["final_eval"] = 2.1  # pairs +0.1, +0.1, −0.1: not distinguishable
    assert not F.paired_difference(recs, "b", "a")["distinguishable"]


@pytest.mark.slow
def test_two_run_slice_end_to_end(source, tmp_path):
    recs = F.run_grid([FP8, REF], [0], TINY, tmp_path, source=source, base_config=BASE, log=None)
    assert [r["cell"] for r in recs] == [REF.name, FP8.name]  # reference first
    by = {r["cell"]: r for r in recs}
    for r in recs:
        assert r["eval_steps"] == [2, 4] and math.isfinite(r["final_eval"]) and r["devices"] == 8
    # wire bytes from the compiled HLO: FP8 moves about a quarter of fp32's bytes
    assert by[FP8.name]["wire_bytes"] < 0.35 * by[REF.name]["wire_bytes"]
    assert by[REF.name]["wire_bytes"] == pytest.approx(by[REF.name]["wire_fp32_reference"],
                                                       rel=0.01)
    # one JSON per run; a second call reuses them (nothing is trained again)
    assert F.record_path(tmp_path, FP8, 0).is_file()
    again = F.run_grid([REF, FP8], [0], TINY, tmp_path, source=source, base_config=BASE, log=None)
    assert again == recs
    # the same seed's fp32 run is bit-reproducible: its gap to itself is exactly 0
    rerun = F.run_cell(REF, TINY, 0, source, base_config=BASE)
    assert rerun["final_eval"] == by[REF.name]["final_eval"]
    rows = {r["cell"]: r for r in F.summarize(recs)}
    assert rows[REF.name]["gap"]["mean"] == 0.0
    assert rows[FP8.name]["gap"]["per_seed"] == {
        0: by[FP8.name]["final_eval"] - by[REF.name]["final_eval"]}
    md = F.format_table(list(rows.values()))
    assert "| adamw | fp32 | euclidean | fp8_e4m3 |" in md and "0 (reference)" in md
    json.dumps(list(rows.values()))  # the summary is JSON-able
    png = F.plot_frontier(list(rows.values()), tmp_path / "frontier.png")
    assert png.stat().st_size > 0
    assert F.load_records(tmp_path, TINY) and not F.load_records(tmp_path, F.FrontierSettings())


def test_transport_comparisons_pair_cells_of_one_codec():
    recs = [{"cell": c.name, "seed": s, "final_eval": v + 0.01 * s}
            for c, v in ((F.Cell("nvfp4", "gift"), 2.0), (F.Cell("nvfp4"), 2.1),
                         (F.Cell("fp8_e4m3"), 2.2)) for s in range(3)]
    rows = F.transport_comparisons(recs)
    assert len(rows) == 1 and (rows[0]["codec"], rows[0]["a"], rows[0]["b"]) == (
        "nvfp4", "gift", "euclidean")
    assert rows[0]["mean"] == pytest.approx(-0.1)
    assert "gift − euclidean" in F.format_comparisons(rows)


@pytest.mark.slow
def test_frontier_at_16_replicas_smoke(tmp_path):
    """#23's training cells at R = 16 (the R = 64 measurement's shape): fp8_e5m2 on the FP8
    ring, Euclidean and GIFT, and the fp32 reference, 2 steps each on 16 simulated devices
    with 16 x 1 sequences of a 1-block model, through the script; the records say 16 devices
    and the model override."""
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = script_env()
    subprocess.run(
        [sys.executable, str(root / "scripts" / "frontier.py"), "--out", str(tmp_path),
         "--cpu_devices", "16", "--set", "train.global_batch_size=16", "--set",
         "optimizer.warmup_steps=1", "--set", "model.num_layers=1", "--steps", "2",
         "--eval_every", "2", "--eval_batches", "1", "--refresh_every", "2", "--codecs", "fp8_e5m2",
         "--transports", "euclidean,gift", "--accumulations", "fp8", "--optimizers", "adamw",
         "--seeds", "0"], check=True, cwd=root, env=env, timeout=900)
    records = sorted(tmp_path.glob("records/**/seed0.json"))
    loaded = [json.loads(r.read_text()) for r in records]
    runs = {(r["cell"], r["devices"]) for r in loaded}
    assert {d for _, d in runs} == {16} and len(runs) == 3
    assert all(r["settings"]["model"] == [["num_layers", 1]] for r in loaded)
    assert (tmp_path / "frontier.png").stat().st_size > 0
    # a report with other settings finds no records: one error line, the report kept
    table = (tmp_path / "table.md").read_text()
    bad = subprocess.run(
        [sys.executable, str(root / "scripts" / "frontier.py"), "--out", str(tmp_path),
         "--cpu_devices", "16", "--steps", "2", "--report_only"],
        cwd=root, env=env, timeout=300, capture_output=True, text=True)
    assert bad.returncode == 2 and "pass the same --config, --steps, --set" in bad.stderr
    assert (tmp_path / "table.md").read_text() == table
