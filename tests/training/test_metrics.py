"""The metrics writer (:mod:`gift_jax.training.metrics`): one JSON record per call with plain
values (non-finite floats as strings, arrays as scalars), nothing written when disabled, and a
resumed run dropping the records past its checkpoint so no step is logged twice."""

import json

import jax.numpy as jnp
import numpy as np

from gift_jax.training.metrics import MetricsWriter


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_are_plain_json(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"loss": jnp.float32(2.5), "n": np.int64(3), "bad": float("nan"),
                     "eval/loss": 1.25, "mode": "fp8"})
    writer.close()
    (record,) = _records(tmp_path / "metrics.jsonl")
    assert record == {"step": 1, "loss": 2.5, "n": 3, "bad": "nan", "eval/loss": 1.25,
                      "mode": "fp8"}
    assert any((tmp_path / "tensorboard").iterdir())


def test_disabled_writes_nothing(tmp_path):
    for writer in (MetricsWriter(str(tmp_path / "a"), enabled=False), MetricsWriter(None)):
        writer.write(1, {"loss": 1.0})
        writer.close()
    assert not (tmp_path / "a").exists()


def test_resume_drops_records_past_the_checkpoint(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        writer.write(step, {"loss": float(step)})
    writer.close()  # the run died after step 5; its last checkpoint was step 3
    resumed = MetricsWriter(str(tmp_path), start_step=3)
    resumed.write(4, {"loss": 40.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in _records(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
