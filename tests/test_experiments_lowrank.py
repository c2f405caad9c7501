"""Smoke tests of gift_jax.apps.experiments.lowrank (tiny model, a few steps, in-memory corpus)."""

import math
import pathlib

import jax
import numpy as np
import optax
import pytest

from gift_jax.apps.experiments import lowrank as E
from gift_jax.data import TokenSource
from gift_jax.models import param_shapes
from gift_jax.training.config import load_config

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it

BASE = load_config("base", pathlib.Path(__file__).resolve().parents[1] / "configs")
TINY = E.CompareSettings(
    model=(("vocab_size", 256), ("d_model", 32), ("num_layers", 1), ("num_heads", 2),
           ("d_ff", 64), ("max_seq_len", 16)),
    steps=4, batch=2, seq_len=16, rank=4, refresh_every=2, warmup=1, eval_every=2,
    eval_batches=2, eval_batch=2,
)


@pytest.fixture(scope="module")
def source():
    text = "To be, or not to be, that is the question. " * 40
    return TokenSource({"train": [text, text.upper()], "validation": [text[::-1]]}, name="t")


def test_projection_table_tiny_rank32():
    rows = {r["path"]: r for r in E.projection_table(param_shapes(E.CompareSettings().model_config),
                                                      32)}
    assert rows["embed/embedding"]["reason"] == "masked (dense)"
    assert rows["lm_head/kernel"]["reason"] == "masked (dense)"
    assert rows["final_norm/scale"]["reason"] == "1-D"
    projected = [p for p, r in rows.items() if r["projected"]]
    assert len(projected) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 blocks
    gate = rows["layers/0/mlp/gate_proj/kernel"]
    assert (gate["side"], gate["m"], gate["n"], gate["rank"]) == ("output", 344, 128, 32)


def test_projection_table_rank_too_large_keeps_dense():
    rows = E.projection_table(param_shapes(E.CompareSettings().model_config), 128)
    assert not any(r["projected"] for r in rows)  # every matrix has a side of 128
    assert any(r.get("reason", "").startswith("rank 128 >= min side") for r in rows)


def test_train_run_smoke(source):
    # flora: the low-rank path (projection, moments, back-projection) without SVDs, which are
    # slow to compile on CPU; the PLUMAGE transformation itself is tested in test_lowrank.py.
    r = E.train_run("flora", TINY, 0, source, base_config=BASE)
    assert r.train_steps == [1, 2, 3, 4] and r.eval_steps == [2, 4]
    assert all(math.isfinite(x) for x in r.train_loss + r.eval_loss)
    assert r.final_eval < math.log(256) + 0.5


def test_adam_scaled_scales_only_projected_leaves():
    s = TINY.replace(warmup=0, final_lr_ratio=1.0, clip=0.0)
    params = {"embed": {"embedding": np.ones((4, 3), np.float32)},
              "w": np.ones((3, 5), np.float32), "norm": np.ones((3,), np.float32)}
    tx = E.make_optimizer("adam_scaled", s)
    upd, _ = tx.update(jax.tree.map(lambda x: x, params), tx.init(params), params)
    lr = s.lr_lowrank  # Adam's first normalised step is ±1
    assert np.allclose(upd["embed"]["embedding"], -lr, rtol=1e-4)
    assert np.allclose(upd["norm"], -lr, rtol=1e-4)
    assert np.allclose(upd["w"], -s.scale * lr, rtol=1e-4)


def test_make_optimizer_rejects_unknown():
    with pytest.raises(ValueError, match="method must be one of"):
        E.make_optimizer("sgd", TINY)


def test_summarize_gap_closed():
    def run(m, seed, loss):
        return E.RunResult(m, seed, [1], [loss], [1], [loss], 0.0)

    rs = [run("adam", s, 2.0) for s in (0, 1)] + [run("galore", s, 3.0) for s in (0, 1)]
    rs += [run("plumage", 0, 2.5), run("plumage", 1, 2.7)]
    s = E.summarize(rs)
    assert s["methods"]["plumage"]["mean"] == pytest.approx(2.6)
    assert s["methods"]["plumage"]["std"] == pytest.approx(np.std([2.5, 2.7], ddof=1))
    gc = s["gap_closed"]["adam"]["plumage"]
    assert gc["of_means"] == pytest.approx(0.4)
    assert gc["per_seed"] == pytest.approx([0.5, 0.3])
    md = E.format_compare_markdown(s)
    assert "| plumage | 2.6000 ± 0.1414 | 2 |" in md and "+40.0%" in md


def test_state_bytes_match_hand_count():
    shapes = param_shapes(TINY.model_config)
    n = sum(x.size for x in jax.tree.leaves(shapes))
    assert E.state_bytes(optax.adam(1e-3), shapes) == 4 * (2 * n + 1)  # mu, nu, count
    ours = E.state_bytes(optax.chain(E.make_optimizer("galore", TINY)), shapes)
    ref = E.state_bytes(E.optax_galore(TINY.rank, TINY.refresh_every, 0.25), shapes)
    assert ours < E.state_bytes(optax.adam(1e-3), shapes)
    assert abs(ours - ref) / ref < 0.05  # same moments and projectors, small bookkeeping


def test_time_updates_small():
    rows = E.time_updates(d_model=16, d_ff=40, layers=1, rank=4, refresh_every=5, repeats=1,
                          strategies=("flora",), include_optax=False)
    names = {(r["optimizer"], r["step"]) for r in rows}
    assert names == {("ours[flora]", "ordinary"), ("ours[flora]", "refresh")}
    assert all(r["seconds"] > 0 for r in rows)
