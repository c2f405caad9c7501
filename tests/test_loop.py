"""The trainer's loop as users meet it (:mod:`gift_jax.training.loop`): throughput that counts
only train steps, skipped steps that are shown and stop a stalled run, strict/auto resume,
resuming a finished run, the window length of every record (also at an interrupt), the
``Trainer`` object the experiments drive, and ``scripts/train.py --stop_after``.

The small config and synthetic batches are those of ``test_training.py``.
"""

import json
import logging
import os
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
from gift_jax.training.checkpoint import Checkpointer

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
