"""Smoke tests of the GIFT experiment library (scripts/roundtrip.py, profile_layers.py,
bench_gift.py): tiny shapes, synthetic data, a few seconds each."""

import gc
import pathlib
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gift_jax import quantized_psum
from gift_jax.apps.experiments import profile as pf
from gift_jax.apps.experiments import roundtrip as rt
from gift_jax.models.llama import Llama, LlamaConfig, next_token_loss
from gift_jax.training.config import load_config

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it

ROOT = pathlib.Path(__file__).resolve().parents[1]
R = 8


def _synthetic_captures(steps=2, n=48, m=40, layers=2, seed=0):
    """ReplicaCaptures with anisotropic inputs: G_r = X_rᵀ D_r / T with correlated X."""
    key = jax.random.key(seed)
    caps = []
    mix = jax.random.normal(key, (n, n)) * (jnp.arange(1, n + 1) ** -1.0)
    for t in range(steps):
        grads, a, b = {}, {}, {}
        for li in range(layers):
            k = jax.random.fold_in(key, 100 * t + li)
            x = jax.random.normal(k, (R, 64, n)) @ mix
            d = jax.random.normal(jax.random.fold_in(k, 1), (R, 64, m)) * 1e-2
            p = f"layers/{li}/mlp/down_proj/kernel"
            grads[p] = jnp.einsum("rti,rtj->rij", x, d) / 64
            a[p] = jnp.einsum("rti,rtj->rij", x, x) / 64
            b[p] = jnp.einsum("rti,rtj->rij", d, d) / 64
        caps.append(rt.ReplicaCapture(jnp.zeros(R), grads, a, b))
    return caps


@pytest.mark.parametrize("accumulate", ["fp32", "fp8"])
def test_simulation_matches_quantized_psum(accumulate):
    """The one-device simulation equals the real collective in shard_map (global scale)."""
    mesh = jax.make_mesh((R,), ("data",))
    xs = jax.random.normal(jax.random.key(1), (R, 64, 128)) * jnp.linspace(0.1, 3.0, R)[:, None,
                                                                                        None]

    def body(x):
        out = quantized_psum(x[0], "data", codec="fp8_e5m2", mean=True, global_scale=True,
                             accumulate=accumulate)
        return out[None]

    xs_sharded = jax.device_put(xs, NamedSharding(mesh, P("data")))
    real = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        xs_sharded)
    real = np.asarray(real)
    sim = np.asarray(rt.simulate_allreduce(xs, "fp8_e5m2", accumulate, True).mean)
    np.testing.assert_array_equal(real[3], real[0])  # bit-identical on every replica
    # same arithmetic up to the fp32 summation order (which can flip a rare rounding)
    assert np.mean(real[0] == sim) > 0.99
    np.testing.assert_allclose(real[0], sim, rtol=0.25, atol=1e-6)


def test_simulate_allreduce_error_feedback_buffers():
    xs = jax.random.normal(jax.random.key(2), (R, 16, 128))
    res = rt.simulate_allreduce(xs, "fp8_e4m3")
    q_sum = xs - res.local_err  # the decoded contributions
    np.testing.assert_allclose(np.asarray(jnp.mean(q_sum, 0) - res.shard_err),
                               np.asarray(res.mean), atol=1e-6)
    err = jnp.linalg.norm(res.mean - xs.mean(0)) / jnp.linalg.norm(xs.mean(0))
    assert 0 < float(err) < 0.1


def test_replica_fn_matches_full_batch():
    """Mean of replica gradients = full-batch gradient; A, B shapes; A = mean of local A."""
    cfg = LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, d_ff=24,
                      max_seq_len=8)
    graphdef, params = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(0), (R * 2, 9), 0, 32)
    fn = rt.make_replica_fn(graphdef, ["*/mlp/down_proj", "*/attn/q_proj"], R,
                            output_stats=True)
    cap = fn(params, tokens)
    full = jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), tokens))(params)
    full = rt.flat_paths(full)
    p = "layers/0/mlp/down_proj/kernel"
    assert cap.grads[p].shape == (R, 24, 16)
    np.testing.assert_allclose(np.asarray(cap.grads[p].mean(0)), np.asarray(full[p]),
                               rtol=1e-4, atol=1e-7)
    assert cap.a[p].shape == (R, 24, 24) and cap.b[p].shape == (R, 16, 16)
    assert cap.b["layers/0/attn/q_proj/kernel"].shape == (R, 16, 16)
    # G_r = Xᵀ δ: with B = N Σ δδᵀ and A = Σ xxᵀ/N, ‖G‖² ≤ tr(A)·tr(B) (Cauchy–Schwarz)
    g2 = float(jnp.sum(cap.grads[p][0] ** 2))
    assert g2 <= float(jnp.trace(cap.a[p][0]) * jnp.trace(cap.b[p][0])) * (1 + 1e-4)


def test_evaluate_method_frames_and_error_feedback():
    caps = _synthetic_captures()
    paths = list(caps[0].grads)
    res = {}
    for m in (rt.Method("Euclidean", "euclidean"), rt.Method("full", "input"),
              rt.Method("r8", "input", "lowrank_diag", rank=8),
              rt.Method("out", "output"), rt.Method("two", "two_sided"),
              rt.Method("blk", "input", "block_diag", block_size=16),
              rt.Method("diag", "input", "diag")):
        r = rt.evaluate_method(caps, paths, m, codec="fp8_e4m3", error_feedback=True)
        assert set(r["mean"]) == set(rt.METRICS)
        assert all(np.isfinite(v) for v in r["mean"].values())
        assert 0 < r["steps"][0]["rel_l2"] < 0.2 and r["steps"][0]["cosine"] > 0.98
        res[m.name] = r
    # the whitened-frame error of the full input-side frame beats the Euclidean frame's here
    assert res["full"]["steps"][0]["whitened"] < res["Euclidean"]["steps"][0]["whitened"]
    rows = rt.roundtrip_experiment(caps, groups={"g": ["*/down_proj"]},
                                   methods=(rt.Method("Euclidean", "euclidean"),),
                                   codecs=("fp8_e5m2",), accumulations=("fp8",),
                                   error_feedback=(False, True), verbose=False)
    assert len(rows) == 2 and "One-step" in rt.roundtrip_markdown(rows)


def test_profile_metrics_and_selection(tmp_path):
    g = jax.random.normal(jax.random.key(3), (R, 32, 16))
    fresh = jnp.max(jnp.abs(g)) / 57344.0
    mf = rt.build_factors(rt.Method("m", "input"), jnp.eye(32)[None], None)
    mf = jax.tree.map(lambda x: x[0], mf)
    ok = pf.layer_metrics(g, fresh, "fp8_e5m2", mf)
    stale = pf.layer_metrics(g, fresh / 4, "fp8_e5m2", mf)  # gradients grew 4x since sync
    assert ok["saturation"] <= 1.0 / g.size * R and stale["saturation"] > 0.01
    assert stale["rt_euclidean"] > ok["rt_euclidean"]
    # gradients shrank 1e10x: e5m2 spans ~1e9 (2^-14 .. 57344) in normals, so below it
    tiny_scale = pf.layer_metrics(g, fresh * 1e10, "fp8_e5m2", mf)
    assert tiny_scale["flushed"] + tiny_scale["subnormal"] > 0.5
    prof = {"a/kernel": dict(ok, rt_gift=0.0, gift_saturation=0.0),
            "b/kernel": dict(stale, rt_gift=0.0, gift_saturation=0.0)}
    assert pf.rank_layers(prof) == ["b/kernel", "a/kernel"]
    md, sel = pf.profile_markdown({0: prof, 100: prof}, 1, None, "fp8_e5m2")
    assert "1/1" in md
    snippet = pf.selection_snippet(sel, 0, "fp8_e5m2", 50)
    ns = {}
    exec(snippet, ns)  # noqa: S102 - a generated config snippet
    assert ns["GIFT_LAYERS"] == ["b"]


def test_bench_gift_step_and_flops():
    shapes = {"layers/0/mlp/down_proj/kernel": (64, 32), "layers/0/norm/scale": (32,)}
    r = pf.bench_gift_step(shapes, ["*/mlp/down_proj"], rank=8, repeats=1)
    assert r["devices"] == R and r["gift_over_euclidean"] > 0 and r["refresh_every"] == 50
    fl = pf.gift_flops(3456, 1280, rank=32, layers=13, model_params=600_000_000)
    assert fl["step_flops"] == 13 * (8 * 3456 * 32 * 1280 + 6 * 3456 * 1280)
    assert fl["step_over_train"] < 1e-3


@pytest.mark.parametrize("offsets, match", [
    ((0, 4, -2), r"offsets=\(0, 4, -2\) must be ints >= 0 .*invalid entries: \[-2\]"),
    ((0, 2.5), r"invalid entries: \[2.5\]"),
    ((3, 6), r"offsets=\(3, 6\) must be ints >= 0 that include 0"),
])
def test_staleness_rejects_offsets_it_would_mislabel(offsets, match):
    with pytest.raises(ValueError, match=match):  # before the trainer is touched
        rt.staleness_experiment(None, offsets=offsets)


def test_gift_flops_counts_only_lowrank_diag():
    with pytest.raises(ValueError, match=r"factor='full_cholesky' is not supported; allowed"):
        pf.gift_flops(64, 32, factor="full_cholesky")


def test_cost_markdown_names_the_real_refresh_interval():
    row = {"case": "a", "devices": 8, "euclidean_s": 1.0, "gift_s": 1.1, "gift_refresh_s": 3.0,
           "gift_over_euclidean": 1.1, "refresh_over_euclidean": 3.0,
           "amortised_over_euclidean": 1.2, "refresh_every": 20}
    head = pf.cost_markdown([row, row | {"case": "b"}]).splitlines()[0]
    assert "refresh amortised, K=20" in head and "K=50" not in head
    table = pf.cost_markdown([row, row | {"case": "b", "refresh_every": 100}]).splitlines()
    assert "refresh amortised over K" in table[0] and "| K |" in table[0]
    assert "| 20 |" in table[2] and "| 100 |" in table[3]
    with pytest.raises(ValueError, match=r"rows \['a'\] have no refresh_every"):
        pf.cost_markdown([{k: v for k, v in row.items() if k != "refresh_every"}])


def _one_block_tiny(num_steps: int):
    """``configs/tiny.py`` shrunk to one 32-wide block, 16-token sequences, 8 per step."""
    from gift_jax.training import complete_config

    config = complete_config(load_config("tiny", ROOT / "configs"))
    with config.unlocked():
        config.model.num_layers, config.model.d_model, config.model.d_ff = 1, 32, 64
        config.model.num_heads, config.train.seq_len = 2, 16
        config.train.global_batch_size, config.train.num_steps = 8, num_steps
        config.optimizer.warmup_steps = 2
    return config


def _train_and_capture(config, **kwargs):
    """:func:`rt.train_and_capture` on 4 replicas × 2 sequences, down_proj, input side."""
    return rt.train_and_capture(config, replicas=4, local_batch=2, layers=("*/mlp/down_proj",),
                                output_stats=False, log_every=0, **kwargs)


@pytest.mark.slow
def test_experiments_drive_the_trainers_loop():
    """The round-trip experiment trains with the library's trainer: its parameters after
    k steps are bit-identical to ``gift_jax.training.train``'s for the same config."""
    from gift_jax.training import train

    config = _one_block_tiny(num_steps=6)
    trainer, caps = _train_and_capture(config, train_steps=3, capture_steps=2)
    assert trainer.step == 4 and len(caps) == 2 and len(trainer.losses) == 4
    assert caps[0].grads["layers/0/mlp/down_proj/kernel"].shape == (4, 64, 32)
    with config.unlocked():
        config.train.eval_every = config.train.diagnostics_every = 0
    reference = train(config, stop_after=4, show_progress=False)
    ours = jax.tree.leaves(trainer.params)
    for a, b in zip(ours, jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trainer.close()


@pytest.mark.slow
def test_refresh_schedule_experiment_smoke():
    """A 6-step walk of the schedules: fresh refreshes every step, K=3 at steps 0 and 3, the
    adaptive rule within its bounds; the signal table covers the fixed schedules."""
    trainer, _ = _train_and_capture(_one_block_tiny(num_steps=12), train_steps=2,
                                    capture_steps=1)
    res = rt.refresh_schedule_experiment(trainer, steps=6, fixed=(3,), thresholds=(0.99,),
                                         min_every=1, max_every=4, rank=4, replicas=4,
                                         verbose=False)
    by = {r["schedule"]: r for r in res["summary"]}
    assert by["fresh"]["refreshes"] == 6 and by["K=3"]["refreshes"] == 2
    assert 1 <= by["adaptive 0.99"]["refreshes"] <= 6
    assert by["fresh"]["ratio"] == 1.0 and all(r["worst_ratio"] > 0 for r in res["summary"])
    assert res["refresh_steps"]["K=3"] == [res["start_step"], res["start_step"] + 3]
    corr = res["correlations"]["K=3"]
    assert set(corr) == {"input", "gradient"} and all(-1 <= v <= 1 for v in corr.values())
    assert "gradient coverage" in rt.refresh_schedule_markdown(res)
    trainer.close()


def test_replica_sweep_ring_error_grows_with_replicas(tmp_path):
    """The replica sweep (#23) on synthetic captures: rows for every R, frame, codec and
    accumulation; the FP8 ring's Euclidean error grows from R = 2 to R = 8 (more rounded
    partial sums) while fp32 sums' does not grow like it; table and plot are written."""
    caps = _synthetic_captures(steps=1)
    rows = rt.replica_sweep_experiment(caps, [2, 8], codecs=("fp8_e5m2",), verbose=False,
                                       groups={"g": ["*/down_proj"]})
    assert {(r["replicas"], r["accumulate"], r["method"]) for r in rows} == {
        (n, acc, m) for n in (2, 8) for acc in ("fp32", "fp8") for m in rt.SWEEP_METHODS}
    err = {(r["replicas"], r["accumulate"]): r["step0"]["rel_l2"] for r in rows
           if r["method"] == "Euclidean"}
    assert err[8, "fp8"] > 1.5 * err[2, "fp8"] and err[8, "fp8"] > 2 * err[8, "fp32"]
    # captures consumed one at a time (scripts/roundtrip.py's sweep: one in memory) give the
    # same rows, each R's mean over the steps included
    two = _synthetic_captures(steps=2)
    kw = dict(codecs=("fp8_e5m2",), accumulations=("fp8",), verbose=False,
              groups={"g": ["*/down_proj"]})
    streamed = rt.replica_sweep_experiment(iter(two), [2, 8], **kw)
    assert streamed == rt.replica_sweep_experiment(two, [2, 8], **kw)
    assert all(len(r["per_step"]) == 2 for r in streamed)
    md = rt.replica_sweep_markdown(rows)
    assert "R = 2 | R = 8" in md and "rank-32 A" in md
    rt.plot_replica_sweep(rows, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 0
    with pytest.raises(ValueError, match="replicas=9 must lie in"):
        rt.first_replicas(caps[0], 9)


def test_experiments_release_their_captures():
    """An experiment keeps no capture alive once it returns (its factor cache held every
    capture it saw: the R = 64 sweep of configs/small.py ran out of 24 GB that way)."""
    cap = _synthetic_captures(steps=1)[0]
    alive = weakref.ref(cap.loss)
    rows = rt.roundtrip_experiment([cap], {"g": ["*/down_proj"]}, codecs=("fp8_e4m3",),
                                   accumulations=("fp32",), error_feedback=(False,),
                                   verbose=False)
    assert rows and all(np.isfinite(r["step0"]["rel_l2"]) for r in rows)
    del cap
    gc.collect()
    assert alive() is None


def test_fp8_ring_variants():
    """Issue #46's transport models: on values whose every partial sum is exact in the
    format, every ring gives the exact mean; the NCCL ring is the sequential ring without the
    mean's re-cast, in each chunk's own order; headroom (scale R×) never saturates where
    the sum of R maximal values would."""
    # amax 14 → scale 1/32: a 1 is 32, every partial sum k·32 (k ≤ 8) and 14·32 = 448 exact
    ones = jnp.ones((R, 4, 128)).at[:, 0, 0].set(0.0).at[0, 0, 0].set(14.0)
    want = np.ones((4, 128), np.float32)
    want[0, 0] = 14.0 / R
    for ring in rt.RINGS:
        res = rt.simulate_allreduce(ones, "fp8_e4m3", "fp8", ring=ring)
        np.testing.assert_array_equal(np.asarray(res.mean), want, err_msg=ring)
    with pytest.raises(ValueError, match="ring must be one of"):
        rt.simulate_allreduce(ones, "fp8_e4m3", "fp8", ring="star")
    # saturation: R values of 400·s each (just under fmax) sum beyond fmax without headroom
    x = jnp.ones((R, 4, 128)) * jnp.asarray([400.0, *[1.0] * 127]) / 448.0
    tight = rt.simulate_allreduce(x, "fp8_e4m3", "fp8", ring="nccl").mean
    room = rt.simulate_allreduce(x, "fp8_e4m3", "fp8", ring="nccl_headroom").mean
    np.testing.assert_allclose(np.asarray(tight)[..., 0], 400.0 / 448.0 / R, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(room)[..., 0], 400.0 / 448.0, rtol=1e-6)
    # the NCCL ring's error is the sequential ring's order of magnitude (same hops)
    xs = jax.random.normal(jax.random.key(3), (R, 16, 128))
    ref = xs.mean(0)
    err = {ring: float(jnp.linalg.norm(rt.simulate_allreduce(xs, "fp8_e5m2", "fp8",
                                                            ring=ring).mean - ref)
                       / jnp.linalg.norm(ref)) for ring in rt.RINGS}
    assert 0.3 < err["nccl"] / err["sequential"] < 3, err
    assert err["tree"] < err["nccl"], err  # log₂ R roundings of balanced sums, not R − 1


def test_transport_study_rows_and_table():
    caps = _synthetic_captures(steps=1)
    rows = rt.transport_study(caps, replica_counts=(4, 8), codecs=("fp8_e5m2",),
                              verbose=False)  # no earlier step: no stale transports
    fresh = [t for t in rt.TRANSPORTS if not rt.TRANSPORTS[t].get("stale")]
    assert {(r["transport"], r["replicas"], r["method"]) for r in rows} == {
        (t, n, m) for t in fresh for n in (4, 8) for m in rt.PAPER_TABLE}
    # stale scales of a step whose gradients were 4x smaller: the ring saturates
    small = rt.ReplicaCapture(caps[0].loss, {p: g / 4 for p, g in caps[0].grads.items()},
                              caps[0].a, caps[0].b)
    st = rt.transport_study(caps, transports=("fp32", "fp32_stale", "ring_nccl_stale"),
                            replica_counts=(8,), codecs=("fp8_e5m2",), stale=small,
                            verbose=False)
    e = {(r["transport"], r["method"]): r["rel_l2"] for r in st}
    assert e["fp32_stale", "Euclidean"] > 2 * e["fp32", "Euclidean"]
    err = {(r["transport"], r["replicas"], r["method"]): r["rel_l2"] for r in rows}
    # a single cast's error does not depend on R, and diagonal scaling leaves it alone
    assert err["cast_local", 4, "Euclidean"] == pytest.approx(err["cast_local", 8, "Euclidean"],
                                                              rel=0.1)
    assert err["cast_mean", 8, "diagonal A"] == pytest.approx(err["cast_mean", 8, "Euclidean"],
                                                              rel=0.1)
    assert all(0 < r["rel_l2"] < 2 and np.isfinite(r["rel_l2_local"]) for r in rows)
    md = rt.transport_markdown(rows)
    assert "**paper** | 5.28e-02" in md and "| ring_nccl |" in md and "R = 8" in md
    with pytest.raises(ValueError, match="transports"):
        rt.transport_study(caps, transports=("carrier_pigeon",))


def test_profile_reports_the_librarys_stale_scale_saturation():
    """The profile's ``library_saturation``: the library's all-reduce with stale scales over
    R devices, synced on a window's first call; gradients 4× larger afterwards clip."""
    g = {"a/kernel": jax.random.normal(jax.random.key(4), (R, 32, 16)),
         "b/kernel": jax.random.normal(jax.random.key(5), (R, 8, 16))}
    red = pf.StaleScaleReduction("fp8_e5m2", calls_per_sync=3, replicas=R)
    first = red(g)
    assert first == {"a/kernel": 0.0, "b/kernel": 0.0}  # the sync call
    grown = red({"a/kernel": 4 * g["a/kernel"], "b/kernel": g["b/kernel"]})
    assert grown["a/kernel"] > 0.01 and grown["b/kernel"] == 0.0
    ok = pf.layer_metrics(g["a/kernel"], jnp.max(jnp.abs(g["a/kernel"])) / 57344.0, "fp8_e5m2",
                          jax.tree.map(lambda x: x[0], rt.build_factors(
                              rt.Method("m", "input"), jnp.eye(32)[None], None)))
    prof = {"a/kernel": dict(ok, rt_gift=0.0, gift_saturation=0.0, library_saturation=0.25)}
    md, _ = pf.profile_markdown({0: prof}, 1, None, "fp8_e5m2")
    assert "clipped, library (scale_sync_every)" in md and "0.2500" in md


@pytest.mark.slow
def test_factor_distance_experiment_smoke():
    """Both EMA schemes in short GIFT runs: a row per refresh; at step 0 every EMA is the
    step's own batch statistic; the table says whether the goal is met."""
    from gift_jax.apps.experiments import factor_tracking as ft

    schemes = {"art": {"gift.ema_scheme": "artifact", "gift.refresh_every": 2},
               "bc": {"gift.refresh_every": 2, "gift.stats_every": 1,
                      "gift.stats_half_life": 2.0}}
    res = ft.factor_distance_experiment(_one_block_tiny(num_steps=6), steps=5,
                                        schemes=schemes, heldout_sequences=32, verbose=False)
    rows = res["rows"]
    assert [(r["scheme"], r["step"]) for r in rows] == [
        (n, s) for n in ("art", "bc") for s in (0, 2, 4)]
    for r in rows:
        assert r["layers"] == 1 and 0 < r["mean"] == r["worst"] and r["refresh_every"] == 2
        if r["step"] == 0:
            assert r["mean"] == pytest.approx(r["batch_mean"], rel=1e-5)
    md = ft.factor_distance_markdown(res, after=2)
    assert "| refresh at step | art | bc | one training batch |" in md
    assert "- bc: worst layer at refreshes from step 2 on" in md
    with pytest.raises(ValueError, match="heldout_sequences=20"):
        ft.factor_distance_experiment(_one_block_tiny(num_steps=6), heldout_sequences=20)
