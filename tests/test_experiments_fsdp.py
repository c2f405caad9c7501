"""Smoke tests of gift_jax.apps.experiments.fsdp_study: the paired summary, and two variants
trained end to end on a (data=2, fsdp=4) mesh (tiny model, a few steps, in-memory corpus)."""

import math
import pathlib

import pytest

from gift_jax.apps.experiments import fsdp_study as S
from gift_jax.apps.experiments.frontier import FrontierSettings
from gift_jax.data import TokenSource
from gift_jax.training.config import load_config

BASE = load_config("base", pathlib.Path(__file__).resolve().parents[1] / "configs")
TINY = FrontierSettings(
    steps=3, eval_every=3, eval_batches=1,
    model=(("d_model", 32), ("num_layers", 1), ("num_heads", 2), ("d_ff", 64),
           ("max_seq_len", 16)),
    train=(("train.global_batch_size", 8), ("optimizer.warmup_steps", 1)),
)


def test_summary_pairs_every_run_with_the_reference_by_seed():
    ref, fp8 = S.CELLS[0].name, S.CELLS[1].name
    rec = lambda cell, seed, loss: {"cell": cell, "seed": seed, "final_eval": loss,
                                    "wire_bytes": 1.0}
    records = {"xla": [rec(ref, 0, 2.0), rec(ref, 1, 2.5)],
               "grads_fp8": [rec(ref, 0, 2.1), rec(ref, 1, 2.6), rec(fp8, 1, 2.4)]}
    rows = {(r["variant"], r["cell"]): r for r in S.summarize(records)}
    assert math.isnan(rows["xla", ref]["gap"]) and rows["xla", ref]["n"] == 2
    shifted = rows["grads_fp8", ref]  # every seed moved by +0.1: no spread, an exact gap
    assert shifted["gap"] == pytest.approx(0.1) and shifted["gap_sd"] == pytest.approx(0)
    assert rows["grads_fp8", fp8]["n"] == 1 and rows["grads_fp8", fp8]["gap"] == (
        pytest.approx(-0.1))
    table = S.format_table(S.summarize(records))
    assert "| xla | fp32 |" in table and "0 (reference)" in table


@pytest.mark.slow
def test_two_variants_end_to_end(tmp_path):
    text = "To be, or not to be, that is the question. " * 40
    source = TokenSource({"train": [text, text.upper()], "validation": [text[::-1]]}, name="t")
    variants = ("xla", "grads_weights_fp8")
    records = S.run_study(str(tmp_path), [0], TINY, (2, 4, 1), variants, source=source,
                          base_config=BASE, log=None)
    assert {v: len(r) for v, r in records.items()} == {"xla": 2, "grads_weights_fp8": 2}
    ours = records["grads_weights_fp8"][0]["settings"]["train"]
    assert ["comm.fsdp_weight_codec", "fp8_e4m3"] in ours and ["mesh.fsdp", 4] in ours
    rows = S.summarize(S.load_study(str(tmp_path), TINY, (2, 4, 1), variants))
    assert len(rows) == 4 and all(math.isfinite(r["eval"]) for r in rows)
    assert all(abs(r["gap"]) < 0.05 for r in rows[1:])  # 3 steps: fp8 stays with fp32
