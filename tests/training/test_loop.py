"""The trainer's loop as users meet it (:mod:`gift_jax.training.loop`): throughput that counts
only train steps, skipped steps that are shown and stop a stalled run, strict/auto resume,
resuming a finished run, the window length of every record (also at an interrupt), the
``Trainer`` object the experiments drive, and ``scripts/train.py --stop_after``.

Also every communication mode and optimizer end to end, loss going down with eval and outputs,
2 processes × 4 devices == 1 process × 8 devices, and PLUMAGE + GIFT. The small config and
synthetic batches are ``trainer_kit``'s.
"""

# ruff: noqa: E402  (a worker process sets its devices before JAX is imported)
import os
import sys

_WORKER = __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker"
if _WORKER:  # a process of the multi-process test: 4 CPU devices, gloo collectives
    # the test process's other XLA flags, so that both sides compile alike
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    from gift_jax.utils.cpu_devices import avoid_cpu_dot_crash

    avoid_cpu_dot_crash()  # the same XLA:CPU dot emitters as the test process (conftest)
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_kit import (
    FAST,
    ROOT,
    SMOKE,
    STEPS,
    assert_replicas_identical,
    assert_trees_equal,
    interrupting_batches,
    recipe_of,
    run,
    script_env,
    small_config,
    synthetic_batches,
)

import gift_jax as gj
from gift_jax.training import (
    ConfigError,
    Trainer,
    TrainingStalledError,
    build_optimizer,
    complete_config,
    make_mesh,
    validate_config,
)
from gift_jax.training.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    DamagedCheckpointError,
    NoIntactCheckpointError,
    write_manifest,
)
from gift_jax.training.method import STATS
from gift_jax.training.program import program_for

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it


def _train_records(history):
    return [r for r in history if "loss" in r]


def test_tokens_per_s_excludes_checkpoint_time(tmp_path, monkeypatch):
    """With a checkpoint after every step (each made 0.4 s slower), ``train_s`` and the
    records' throughput count the train steps only; checkpoint time is reported apart."""
    real_save = Checkpointer.save

    def slow_save(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        time.sleep(0.4)

    monkeypatch.setattr(Checkpointer, "save", slow_save)
    config = small_config("fp32", **{"train.checkpoint_every": 1, "train.log_every": 3})
    result = run(config, str(tmp_path), stop_after=6)
    s = result.summary
    assert s["checkpoint_s"] >= 6 * 0.4
    assert s["train_s"] < 6 * 0.4 / 2  # the old loop charged the checkpoints to training
    records = _train_records(result.history)
    assert [r["window"] for r in records] == [3, 3]
    tokens = config.train.global_batch_size * config.train.seq_len
    seconds = sum(r["window"] * tokens / r["tokens_per_s"] for r in records)
    np.testing.assert_allclose(seconds, s["train_s"], rtol=1e-6)


def test_skipped_steps_warn_and_stop_the_run(tmp_path, caplog):
    """A learning rate of 1e30 makes every update non-finite after the first steps: the log
    warns, and after ``max_consecutive_skips`` the run stops with a checkpoint kept."""
    config = small_config("fp32", **{"optimizer.learning_rate": 1e30,
                                     "optimizer.final_learning_rate": 1e29,
                                     "optimizer.warmup_steps": 0, "train.log_every": 1,
                                     "train.max_consecutive_skips": 3})
    with caplog.at_level(logging.WARNING, logger="gift_jax.training"):
        with pytest.raises(TrainingStalledError,
                           match=r"the last 3 steps were all skipped .*max_consecutive_skips=3"
                                 r".*checkpoint of step \d+ kept"):
            run(config, str(tmp_path))
    assert any("skipped (non-finite updates" in r.getMessage() for r in caplog.records)
    assert Checkpointer(str(tmp_path), config).latest_step() is not None


def test_resume_needs_a_checkpoint_unless_auto(tmp_path):
    config = small_config("fp32")
    with pytest.raises(ConfigError, match="holds no checkpoint.*--resume=auto"):
        run(config, str(tmp_path / "a"), resume=True, stop_after=1)
    assert not (tmp_path / "a" / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (tmp_path / "a" / "checkpoints").iterdir())
    result = run(config, str(tmp_path / "b"), resume="auto", stop_after=2)
    assert result.step == 2
    again = run(config, str(tmp_path / "b"), resume="auto", stop_after=2)
    assert again.step == 4  # auto continues once there is a checkpoint
    with pytest.raises(ConfigError, match="resume='yes' must be False, True or 'auto'"):
        run(config, str(tmp_path / "c"), resume="yes")


def test_resuming_a_finished_run_leaves_its_records_alone(tmp_path, capsys):
    config = small_config("fp32", **{"train.num_steps": 4})
    first = run(config, str(tmp_path))
    files = {name: (tmp_path / name).read_bytes() for name in ("summary.json", "metrics.jsonl")}
    capsys.readouterr()
    again = run(config, str(tmp_path), resume=True)
    assert "already finished at step 4" in capsys.readouterr().out
    assert again.step == 4 and again.history == []
    assert again.summary == json.loads(files["summary.json"])
    assert again.summary["final_loss"] == first.summary["final_loss"] is not None
    for name, content in files.items():
        assert (tmp_path / name).read_bytes() == content
    assert_trees_equal(again.params, first.params)


def test_interrupt_logs_the_partial_window_and_resume_says_its_length(tmp_path):
    config = small_config("fp32", **{"train.log_every": 4})
    with pytest.raises(KeyboardInterrupt, match="step 6"):
        run(config, str(tmp_path), batches=interrupting_batches(5), stop_after=10)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["window"]) for r in lines if "loss" in r] == [(4, 4), (6, 2)]
    resumed = run(config, str(tmp_path), resume=True, stop_after=4)
    assert [(r["step"], r["window"]) for r in _train_records(resumed.history)] == [(8, 2),
                                                                                   (10, 2)]


def test_trainer_object_is_the_loop_of_train():
    """``Trainer.run`` in pieces == ``train`` in one call, bit for bit."""
    config = small_config("gift_fp8")
    whole = run(config, stop_after=5)
    trainer = Trainer(config, batches=synthetic_batches, compiler_options=FAST)
    try:
        trainer.run(2)
        trainer.run(3)
        assert trainer.step == 5
        assert_trees_equal(trainer.params, whole.params)
        assert_trees_equal(trainer.opt_state, whole.opt_state)
    finally:
        trainer.close()


def test_cli_stop_after_then_resume(tmp_path, capsys):
    """``--stop_after N`` then ``--resume --stop_after N``: 2N steps, the second call starting
    where the first stopped."""
    import runpy

    main = runpy.run_path(str(ROOT / "scripts" / "train.py"))["main"]
    args = ["--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(tmp_path),
            "--no_progress", "--config.model.num_layers=1", "--config.model.d_model=32",
            "--config.model.num_heads=2", "--config.model.d_ff=64", "--config.train.seq_len=16",
            "--config.model.max_seq_len=16", "--config.train.global_batch_size=8",
            "--config.train.eval_every=0", "--config.train.diagnostics_every=0",
            "--config.train.log_every=1"]
    assert main(args + ["--stop_after", "2"]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2
    assert main(args + ["--resume", "--stop_after", "2"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["steps_this_call"] == 2
    assert main(args + ["--stop_after", "0"]) == 2
    assert "--stop_after=0 must be a positive" in capsys.readouterr().err


def _damage(step_dir, case):
    """One way a checkpoint step gets damaged on disk."""
    state = step_dir / "state"
    if case == "truncated_data_file":
        data = max((p for p in state.glob("ocdbt.process_0/d/*")), key=lambda p: p.stat().st_size)
        with open(data, "r+b") as f:
            f.truncate(10)
    elif case == "missing_metadata":
        (step_dir / "meta" / "metadata").unlink()
    elif case == "missing_manifest":
        for p in [state / "manifest.ocdbt", *state.glob("ocdbt.process_*/manifest.ocdbt")]:
            p.unlink()
    elif case == "missing_commit_marker":
        (step_dir / "commit_success.txt").unlink()
    elif case == "partly_written":  # the state item never made it
        shutil.rmtree(state)


DAMAGES = ["truncated_data_file", "missing_metadata", "missing_manifest",
           "missing_commit_marker", "partly_written"]


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    """A GIFT run's checkpoints of steps 2 and 4 (of 6), and the uninterrupted run."""
    config = small_config("gift_fp8", "adamw", **{"train.checkpoint_every": 2,
                                                  "train.num_steps": 6})
    workdir = tmp_path_factory.mktemp("interrupted")
    run(config, str(workdir), stop_after=4)
    return config, workdir, run(config, stop_after=6)


@pytest.mark.parametrize("case", DAMAGES)
def test_a_damaged_checkpoint_resumes_from_the_newest_intact_one(interrupted_run, tmp_path,
                                                                  case, caplog):
    config, source, full = interrupted_run
    shutil.copytree(source, tmp_path / "run")
    workdir = tmp_path / "run"
    _damage(workdir / "checkpoints" / "4", case)
    with caplog.at_level(logging.INFO):
        resumed = run(config, str(workdir), resume=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if case == "missing_commit_marker":  # the listing, written after orbax's commit, holds
        assert not warnings and "resumed from step 4" in caplog.text
    else:
        assert len(warnings) == 1 and "\n" not in warnings[0], warnings
        assert re.match(r"checkpoint of step 4 is damaged \(.+\): moved aside to .*4\.damaged; "
                        r"trying step 2$", warnings[0]), warnings[0]
        assert "resumed from step 2" in caplog.text
        assert (workdir / "checkpoints" / "4.damaged").is_dir()  # kept, not deleted
    assert resumed.step == 6
    assert_trees_equal(resumed.params, full.params)
    assert_trees_equal(resumed.opt_state, full.opt_state)


def test_no_intact_checkpoint_is_one_line(interrupted_run, tmp_path):
    config, source, _ = interrupted_run
    shutil.copytree(source, tmp_path / "run")
    for step in ("2", "4"):
        _damage(tmp_path / "run" / "checkpoints" / step, "missing_metadata")
    with pytest.raises(NoIntactCheckpointError, match=r"steps \[4, 2\] were damaged"):
        run(config, str(tmp_path / "run"), resume=True)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "2.damaged", "4.damaged"]


def test_explicit_step_with_incomplete_metadata_is_named(interrupted_run, tmp_path):
    """Restoring a given step whose metadata lacks an entry: an error naming the step and the
    entry (not a bare KeyError); the newest-intact search treats it as damage."""
    config, source, _ = interrupted_run
    shutil.copytree(source, tmp_path / "run")
    path = tmp_path / "run" / "checkpoints" / "4" / "meta" / "metadata"
    meta, size = json.loads(path.read_text()), path.stat().st_size
    del meta["paths"]
    path.write_text(json.dumps(meta).ljust(size))
    write_manifest(path.parents[1])  # a manifest that holds: the metadata is what is wrong
    checkpointer = Checkpointer(str(tmp_path / "run"), config)
    with pytest.raises(DamagedCheckpointError, match=r"\(step 4\): its metadata has no "
                                                     r"\['paths'\]"):
        checkpointer.check_config(step=4)
    assert checkpointer.check_config()["step"] == 2  # step 4 moved aside
    assert (tmp_path / "run" / "checkpoints" / "4.damaged").is_dir()


def _with(config, **fields):
    config = config.copy_and_resolve_references()
    with config.unlocked():
        for name, value in fields.items():
            group, key = name.split("__")
            config[group][key] = value
    return config


def test_extending_a_finished_run_keeps_or_stretches_the_schedule(tmp_path, caplog):
    """``train.num_steps`` 6 -> 9 on a finished run. ``keep``: bit for bit a 9-step run whose
    schedule is 6 steps long (no jump); ``stretch``: a one-line warning naming the jump, and
    the logged learning rate follows the 9-step schedule. Model changes are still refused."""
    config = small_config("fp8", "adamw", **{"train.num_steps": 6, "train.log_every": 1,
                                             "train.checkpoint_every": 3})
    run(config, str(tmp_path / "keep"))
    shutil.copytree(tmp_path / "keep", tmp_path / "stretch")
    longer = _with(config, train__num_steps=9)

    with caplog.at_level(logging.INFO):
        kept = run(longer, str(tmp_path / "keep"), resume=True)
    assert "keeps its 6-step length" in caplog.text
    reference = run(_with(longer, optimizer__schedule_steps=6))
    assert kept.step == 9
    assert_trees_equal(kept.params, reference.params)
    assert_trees_equal(kept.opt_state, reference.opt_state)
    final = config.optimizer.final_learning_rate
    assert [r["learning_rate"] for r in _train_records(kept.history)] == pytest.approx(
        [final] * 3)
    caplog.clear()
    with caplog.at_level(logging.INFO):  # again with 9: the kept 6-step schedule is recorded
        again = run(longer, str(tmp_path / "keep"), resume=True)
    assert again.step == 9 and "schedule" not in caplog.text

    caplog.clear()
    stretched = run(_with(longer, train__extend_schedule="stretch"), str(tmp_path / "stretch"),
                    resume=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.search(r"stretched from 6 to 9 steps.*: 0\.001 -> "
                                            r"0\.00\d+ at step 6$", warnings[0]), warnings
    from gift_jax.training import learning_rate_schedule
    nine = learning_rate_schedule(longer.optimizer, 9)
    assert [r["learning_rate"] for r in _train_records(stretched.history)] == pytest.approx(
        [float(nine(s)) for s in (6, 7, 8)])

    with pytest.raises(CheckpointMismatchError, match=r"model\.d_model: 32 \(checkpoint\)"):
        run(_with(longer, model__d_model=48), str(tmp_path / "keep"), resume=True)
    with pytest.raises(ConfigError, match=r"train\.extend_schedule='later' is not supported; "
                       "allowed: keep, stretch"):
        run(_with(longer, train__extend_schedule="later"), str(tmp_path / "keep"), resume=True)


# ---- every mode end to end, several processes, PLUMAGE + GIFT ---------------------------------


@pytest.mark.parametrize("name", list(SMOKE))
def test_smoke_every_mode(name):
    mode, optimizer, overrides = SMOKE[name]
    config = small_config(mode, optimizer, **overrides)
    result = run(config, stop_after=4)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert result.step == 4 and len(losses) == 2 and all(np.isfinite(losses))
    assert result.summary["skipped_steps"] == 0
    assert_replicas_identical(result.params)
    program = program_for(complete_config(config), make_mesh(config.mesh.intra_size), FAST)
    # one compile per variant (GIFT's statistics-only one where a step ran it): carried state
    # never changes sharding between steps/variants
    stats = program.step.is_compiled(STATS) and program.optimizer.plan.stats_variant
    assert program.step.compile_count == len(program.step.variants()) + stats
    assert len(program.step.variants()) == (2 if mode in ("gift_fp8", "plumage") else 1)
    if config.comm.error_feedback:  # per-device buffers are sharded over the data axis
        res = [s.residuals for s in jax.tree.leaves(
            result.opt_state, is_leaf=lambda x: isinstance(x, gj.AllReduceState))
            if isinstance(s, gj.AllReduceState)]
        leaf = jax.tree.leaves(res)[0]
        assert leaf.shape[0] == 8 and leaf.sharding.spec[0] == "data"


def test_loss_goes_down_with_eval_and_outputs(tmp_path):
    config = small_config("fp8", "adamw", **SMOKE["fp8_block_sr_ef"][2])
    with config.unlocked():
        config.train.eval_every = 12
        config.train.diagnostics_every = 12
    result = run(config, str(tmp_path))
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0], losses
    evals = [h["eval/loss"] for h in result.history if "eval/loss" in h]
    assert len(evals) == 2 and evals[-1] < evals[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    diag = [r for r in records if "wire/bytes_per_step_ordinary" in r]
    assert diag and 0 < diag[0]["wire/bytes_per_step_ordinary"] < diag[0]["wire/fp32_reference"]
    assert 0 < diag[0]["fidelity/relative_l2"] < 0.2
    assert list((tmp_path / "tensorboard").iterdir())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["tokens_per_s"] > 0


MP_OVERRIDES = SMOKE["fp8_block_sr_ef"][2]  # per-device EF buffers, SR keys, block scales


MP_STEPS = 3


def _assembled(x) -> np.ndarray:
    """The whole of ``x`` from this process's shards (it holds a full copy: parameters are
    replicated over ``data``, and each process holds whole replicas)."""
    out = np.zeros(x.shape, x.dtype)
    for s in x.addressable_shards:
        out[s.index] = np.asarray(s.data)
    return out


#: Multi-process meshes: pure data parallelism, and (data=2 across the processes, fsdp=2,
#: tensor=2) — each process holds one replica, split over its 4 devices; "stream": pure data
#: parallelism on the bundled corpus through the streaming pipeline (each process reads the
#: documents of its own rows), checkpointed (the processes' data positions gathered).
MP_MESHES = {"data": {}, "sharded": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
             "stream": {"data.pipeline": "stream", "data.workers": 0,
                        "train.checkpoint_every": MP_STEPS}}


def _mp_run(mesh: str, workdir: str | None):
    config = small_config("fp8", "adamw", **MP_OVERRIDES, **MP_MESHES[mesh])
    if mesh != "stream":
        return run(config, stop_after=MP_STEPS)
    return run(config, workdir, stop_after=MP_STEPS, batches=None)


def _data_state(workdir: str):
    path = os.path.join(workdir, "checkpoints", str(MP_STEPS), "meta", "metadata")
    with open(path) as f:
        return json.load(f)["data_state"]


def _worker(port: int, process_id: int, out: str, mesh: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from gift_jax.training import initialize_distributed

    initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    result = _mp_run(mesh, out + ".run")
    if process_id == 0:
        flat = {str(i): _assembled(x) for i, x in enumerate(jax.tree.leaves(result.params))}
        np.savez(out, losses=[h["loss"] for h in result.history if "loss" in h], **flat)
    jax.distributed.shutdown()


@pytest.mark.parametrize("mesh", list(MP_MESHES))
def test_two_processes_match_one_process(tmp_path, mesh):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "mp.npz")
    env = script_env(JAX_PLATFORMS=None)
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(port), str(i), out, mesh],
                              env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    single = _mp_run(mesh, str(tmp_path / "single"))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = np.load(out)
    losses = [h["loss"] for h in single.history if "loss" in h]
    # the logged loss is a pmean (gloo sums in another order); the parameters: bit for bit,
    # so each process fed exactly its rows (the batch iterator's process slice)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-6)
    for i, leaf in enumerate(jax.tree.leaves(single.params)):
        np.testing.assert_array_equal(got[str(i)], np.asarray(leaf))
    if mesh == "stream":  # both processes' lanes, in one global position
        assert _data_state(out + ".run") == _data_state(str(tmp_path / "single"))



if _WORKER:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])


@pytest.mark.parametrize("route", ["off", "optimizer"])
def test_plumage_with_gift_whitening_runs_replica_identical(route):
    config = small_config("plumage", "adamw", **{"plumage.gift": True,
                                                 "comm.error_feedback": True,
                                                 "gift.layers": ("*/mlp/down_proj",),
                                                 "gift.route_frame": route})
    result = run(config, stop_after=4)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert result.step == 4 and all(np.isfinite(losses))
    assert result.summary["skipped_steps"] == 0
    assert_replicas_identical(result.params)
    gifts = [s for s in jax.tree.leaves(result.opt_state, is_leaf=lambda x: isinstance(
        x, gj.GiftState)) if isinstance(s, gj.GiftState)]
    assert len(gifts) == 1 and int(gifts[0].refreshes) == 2  # PLUMAGE refreshes at 0 and 2
    if route != "off":  # routed on the step's coordinates (zeros would give errors of 0)
        err = np.asarray(gifts[0].whitened["layers/0/mlp/down_proj/kernel"].route_error)
        assert err.shape == (2, 1) and (err > 0).all() and np.isfinite(err).all()
        assert gifts[0].whitened["layers/0/mlp/down_proj/kernel"].use_whitening.shape == (1,)


def test_plumage_warns_once_when_no_leaf_is_projected(caplog):
    params = {"layers": {"0": {"mlp": {"down_proj": {"kernel": jnp.zeros((64, 32))}},
                               "attn": {"q_proj": {"kernel": jnp.zeros((32, 48))}}}},
              "embed": {"embedding": jnp.zeros((50, 32))}}
    warnings = lambda: [r.getMessage() for r in caplog.records
                        if "projects NO parameter" in r.getMessage()]
    with caplog.at_level("WARNING", logger="gift_jax.training"):
        tx = build_optimizer(recipe_of(small_config("plumage", "adamw", **{"plumage.rank": 32})),
                             ("data",)).tx
        jax.eval_shape(tx.init, params)
        jax.eval_shape(tx.init, params)
        assert len(warnings()) == 1
        assert "plumage.rank=32" in warnings()[0] and "smallest: 32" in warnings()[0]
        caplog.clear()
        tx = build_optimizer(recipe_of(small_config("plumage", "adamw")), ("data",)).tx
        jax.eval_shape(tx.init, params)  # rank 4 projects both kernels
        assert not warnings()


def test_trainer_two_sided_gift_replicas_identical():
    """gift.two_sided: the refresh variant captures A and B (gift_jax.whitening.capture.
    kfac_value_and_grad, also under gradient accumulation) and GIFT whitens both sides."""
    from gift_jax.whitening.stage import GiftState

    config = small_config("gift_fp8", **{
        "train.grad_accum_steps": 2, "gift.two_sided": True,
        "gift.layers": ("*/mlp/down_proj", "*/attn/o_proj")})
    result = run(config, stop_after=3)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert result.step == 3 and all(np.isfinite(losses))
    assert result.summary["skipped_steps"] == 0
    assert_replicas_identical(result.params)
    (gs,) = [s for s in jax.tree.leaves(result.opt_state, is_leaf=lambda x: isinstance(
        x, GiftState)) if isinstance(s, GiftState)]
    assert int(gs.refreshes) == 2 and int(gs.identity_fallbacks) == 0  # steps 0 and 2
    assert sorted(gs.member("out_stats")) == ["layers/0/attn/o_proj/kernel",
                                    "layers/0/mlp/down_proj/kernel"]
    for b in gs.member("out_stats").values():
        assert b.shape == (1, 32, 32) and float(jnp.trace(b[0])) > 0
    with pytest.raises(ConfigError, match=r"gift\.two_sided='yes' must be a bool"):
        validate_config(small_config("gift_fp8", **{"gift.two_sided": "yes"}), 8)


def test_step_times_interleaved_rows():
    """gift_jax.apps.step_timing (scripts/bench_step.py): one row per config, refresh times only
    for configs with a refresh variant, all positive."""
    from gift_jax.apps.step_timing import step_times

    configs = {"fp8": small_config("fp8"), "gift_fp8": small_config("gift_fp8")}
    rows = step_times(configs, make_mesh(), repeats=2, refresh_repeats=1, compiler_options=FAST)
    by = {r["config"]: r for r in rows}
    assert set(by) == {"fp8", "gift_fp8"}
    assert by["fp8"]["refresh_best"] is None and by["gift_fp8"]["refresh_every"] == 2
    for r in rows:
        assert 0 < r["ordinary_best"] <= r["ordinary_median"]
    assert by["gift_fp8"]["refresh_best"] > 0

