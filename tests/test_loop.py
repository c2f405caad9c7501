"""The trainer's loop as users meet it (:mod:`gift_jax.training.loop`): throughput that counts
only train steps, skipped steps that are shown and stop a stalled run, strict/auto resume,
resuming a finished run, the window length of every record (also at an interrupt), the
``Trainer`` object the experiments drive, and ``scripts/train.py --stop_after``.

The small config and synthetic batches are those of ``test_training.py``.
"""

import json
import logging
import os
import re
import shutil
import signal
import time

import numpy as np
import pytest
from test_training import (
    FAST,
    ROOT,
    assert_trees_equal,
    run,
    small_config,
    synthetic_batches,
)

from gift_jax.training import ConfigError, Trainer, TrainingStalledError
from gift_jax.training.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    NoIntactCheckpointError,
)

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

    def interrupting(split, *args, **kwargs):
        for k, batch in enumerate(synthetic_batches(split, *args, **kwargs)):
            if split == "train" and k == 5:
                os.kill(os.getpid(), signal.SIGINT)  # arrives while step 6 is prepared
            yield batch

    with pytest.raises(KeyboardInterrupt, match="step 6"):
        run(config, str(tmp_path), batches=interrupting, stop_after=10)
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
