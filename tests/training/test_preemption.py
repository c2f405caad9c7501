"""A run that survives what pods do to it (:mod:`gift_jax.training.loop`,
:mod:`gift_jax.training.checkpoint`): SIGTERM finishes the step, checkpoints it and stops
(``Preempted``; ``scripts/train.py`` exits 0), the resume is bit-exact; a signal before the
first step writes nothing; a second signal during the save leaves the newest step intact; a
kill that cut a save short falls back to the newest intact step; a flipped bit in any kind of
checkpoint file is found (one warning naming the file and the step) and the run resumes from
the newest intact step; checkpoints of before the checksums still restore; and two processes
of which only one gets SIGTERM stop at the same step through JAX's preemption sync point.
"""

# ruff: noqa: E402  (a worker process sets its devices before JAX is imported)
import os
import sys

_WORKER = __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker"
if _WORKER:  # a process of the two-process test: 4 CPU devices, gloo collectives
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    from gift_jax.utils.cpu_devices import avoid_cpu_dot_crash

    avoid_cpu_dot_crash()
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest
from trainer_kit import (
    FAST,
    ROOT,
    SMOKE,
    assert_trees_equal,
    run,
    script_env,
    small_config,
    synthetic_batches,
)

from gift_jax.training import Preempted
from gift_jax.training.checkpoint import (
    FILE_LISTING,
    Checkpointer,
    DamagedCheckpointError,
    verify_manifest,
)

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it


def _signalling(at: int, signum=signal.SIGTERM, *, slow_after: float = 0.0):
    """:func:`synthetic_batches` that send this process ``signum`` while train batch ``at``
    (0-based) is prepared, i.e. during step ``at``; from then on each batch takes
    ``slow_after`` seconds more (steps of a real size, for the sync protocol's second)."""

    def batches(split, *args, **kwargs):
        for k, batch in enumerate(synthetic_batches(split, *args, **kwargs)):
            if split == "train" and k == at:
                os.kill(os.getpid(), signum)
            if split == "train" and k >= at and slow_after:
                time.sleep(slow_after)
            yield batch

    return batches


def _steps(workdir) -> list[str]:
    return sorted(p.name for p in (workdir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference():
    """The GIFT config (EF, SR keys, factors) and its uninterrupted 6-step run."""
    config = small_config("gift_fp8", "adamw", **SMOKE["gift_fp8_ef"][2],
                          **{"train.checkpoint_every": 2, "train.num_steps": 6,
                             "data.pipeline": "grid"})
    return config, run(config)


def test_sigterm_finishes_the_step_checkpoints_and_resumes_bit_exactly(reference, tmp_path):
    config, full = reference
    with pytest.raises(Preempted, match=r"preempted \(SIGTERM\) at step 3; checkpoint saved") as e:
        run(config, str(tmp_path), batches=_signalling(2))
    assert (e.value.step, e.value.signal_name, e.value.saved) == (3, "SIGTERM", True)
    assert _steps(tmp_path) == ["2", "3"]
    verify_manifest(tmp_path / "checkpoints" / "3")
    resumed = run(config, str(tmp_path), resume=True)
    assert resumed.step == 6
    assert_trees_equal(resumed.params, full.params)
    assert_trees_equal(resumed.opt_state, full.opt_state)


@pytest.mark.parametrize("when", ["setup", "loop"])
def test_a_signal_before_the_first_step_writes_nothing(when, reference, tmp_path):
    """SIGTERM while the evaluation batches are prepared (the Trainer's setup), or as the
    train iterator is made: one line, no checkpoint. Ctrl-C during the setup stops at once."""
    config, _ = reference
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.train.eval_every = 100
    split = "validation" if when == "setup" else "train"

    def batches(signum):
        def make(name, *args, **kwargs):
            if name == split:
                os.kill(os.getpid(), signum)
            return synthetic_batches(name, *args, **kwargs)

        return make

    with pytest.raises(Preempted, match=r"before the first step \(step 0\): stopped, no "
                                        r"checkpoint written") as e:
        run(config, str(tmp_path / "term"), batches=batches(signal.SIGTERM))
    assert not e.value.saved
    assert _steps(tmp_path / "term") == []
    if when == "setup":
        with pytest.raises(KeyboardInterrupt) as e:
            run(config, str(tmp_path / "int"), batches=batches(signal.SIGINT))
        assert not isinstance(e.value, Preempted)
        assert _steps(tmp_path / "int") == []


def test_a_second_signal_during_the_save_waits_for_it(reference, tmp_path, monkeypatch, caplog):
    """SIGTERM, then SIGINT while the preemption checkpoint is written: the save finishes
    (manifest and all), the run stops as after one signal, and the resume is bit-exact."""
    config, full = reference
    save = Checkpointer.save

    def interrupted_save(self, step, *args, **kwargs):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", interrupted_save)
    with pytest.raises(Preempted, match="at step 3; checkpoint saved"):
        run(config, str(tmp_path), batches=_signalling(2))
    assert "SIGINT during a checkpoint's save: the save finishes first" in caplog.text
    verify_manifest(tmp_path / "checkpoints" / "3")
    monkeypatch.setattr(Checkpointer, "save", save)
    resumed = run(config, str(tmp_path), resume=True)
    assert_trees_equal(resumed.params, full.params)
    assert_trees_equal(resumed.opt_state, full.opt_state)


def test_cli_exits_0_with_one_line_on_sigterm(monkeypatch, capsys, tmp_path):
    import runpy

    import gift_jax.training as training

    def preempted(*args, **kwargs):
        raise Preempted("preempted (SIGTERM) at step 7; checkpoint saved", step=7,
                        signal_name="SIGTERM", saved=True)

    monkeypatch.setattr(training, "train", preempted)
    main = runpy.run_path(str(ROOT / "scripts" / "train.py"))["main"]
    args = ["--config", str(ROOT / "configs" / "tiny.py"), "--workdir", str(tmp_path),
            "--no_progress"]
    assert main(args) == 0
    assert capsys.readouterr().err.strip().splitlines() == [
        "stopped: preempted (SIGTERM) at step 7; checkpoint saved"]


# ---- damage: a kill during a save, flipped bits --------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(reference, tmp_path_factory):
    """The reference config's checkpoints of steps 2 and 4."""
    config, _ = reference
    workdir = tmp_path_factory.mktemp("checkpoints")
    run(config, str(workdir), stop_after=4)
    return workdir


def _flip(path, bit: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1 << bit
    path.write_bytes(bytes(data))


#: Every kind of file of a checkpoint step, by a pattern of its path under the step.
FILE_KINDS = {
    "array_data": "state/ocdbt.process_0/d/*",
    "ocdbt_manifest": "state/manifest.ocdbt",
    "process_manifest": "state/ocdbt.process_0/manifest.ocdbt",
    "state_metadata": "state/_METADATA",
    "sharding_metadata": "state/_sharding",
    "meta_json": "meta/metadata",
    "step_metadata": "_CHECKPOINT_METADATA",
    "gift_jax_manifest": FILE_LISTING,
}


def _files_of(step_dir, pattern):
    return sorted(p for p in step_dir.glob(pattern) if p.is_file())


def test_every_file_of_a_step_is_in_the_manifest(checkpoints):
    step = checkpoints / "checkpoints" / "4"
    listed = set(json.loads((step / FILE_LISTING).read_text())["files"])
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*")
               if p.is_file() and p.name != "commit_success.txt"}  # orbax's (late) marker
    assert listed == on_disk - {FILE_LISTING}
    for kind, pattern in FILE_KINDS.items():
        assert _files_of(step, pattern), kind


@pytest.mark.parametrize("kind", list(FILE_KINDS))
def test_a_flipped_bit_is_found_and_the_newest_intact_step_restores(kind, reference,
                                                                     checkpoints, tmp_path,
                                                                     caplog):
    config, full = reference
    shutil.copytree(checkpoints, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "4"
    victim = max(_files_of(step, FILE_KINDS[kind]), key=lambda p: p.stat().st_size)
    _flip(victim)
    if kind == "array_data":  # the whole way: the run resumes from 2, bit-identical
        with caplog.at_level(logging.INFO):
            resumed = run(config, str(tmp_path / "run"), resume=True)
        assert "resumed from step 2" in caplog.text
        assert_trees_equal(resumed.params, full.params)
        assert_trees_equal(resumed.opt_state, full.opt_state)
    else:  # the check that the restore runs first
        assert Checkpointer(str(tmp_path / "run"), config).check_config()["step"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    name = str(victim.relative_to(step))
    if kind == "gift_jax_manifest":
        assert f"step 4: its manifest {FILE_LISTING} is damaged" in warnings[0]
    else:
        assert f"step 4: {name} fails its checksum (crc32 " in warnings[0], warnings[0]
    assert re.match(r"checkpoint of step 4 is damaged \(DamagedCheckpointError: .+\): moved "
                    r"aside to .*4\.damaged; trying step 2$", warnings[0]), warnings[0]
    resumed_ones = ["4", "6"] if kind == "array_data" else []  # written by the resumed run
    assert _steps(tmp_path / "run") == sorted(["2", "4.damaged", *resumed_ones])


def test_an_explicit_step_names_the_file_and_the_step(reference, checkpoints, tmp_path):
    config, _ = reference
    shutil.copytree(checkpoints, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "4"
    _flip(step / "meta" / "metadata")
    with pytest.raises(DamagedCheckpointError,
                       match=r"^step 4: meta/metadata fails its checksum \(crc32 [0-9a-f]{8}, "
                             r"manifest [0-9a-f]{8}\)$"):
        Checkpointer(str(tmp_path / "run"), config).check_config(step=4)


@pytest.mark.parametrize("cut", ["before_the_manifest", "during_orbax_write"])
def test_a_kill_during_the_save_falls_back_to_the_newest_intact_step(cut, reference,
                                                                     checkpoints, tmp_path,
                                                                     caplog):
    """What SIGKILL (after SIGTERM) leaves when it cuts a save short: orbax's committed step
    without gift_jax's manifest (damaged: step 2 restores), or orbax's temporary folder
    (ignored: step 4 restores); either way the rest of the run is bit-identical."""
    config, full = reference
    shutil.copytree(checkpoints, tmp_path / "run")
    ckpts = tmp_path / "run" / "checkpoints"
    if cut == "before_the_manifest":
        (ckpts / "4" / FILE_LISTING).unlink()
        expected, warned = 2, [f"step 4: {FILE_LISTING} is missing (the save did not finish)"]
    else:
        tmp = ckpts / "6.orbax-checkpoint-tmp-1765000000000000"
        shutil.copytree(ckpts / "4", tmp)
        (tmp / "state" / "manifest.ocdbt").unlink()
        expected, warned = 4, []
    with caplog.at_level(logging.INFO):
        resumed = run(config, str(tmp_path / "run"), resume=True)
    assert f"resumed from step {expected}" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(warned) and all(w in x for w, x in zip(warned, warnings,
                                                                         strict=True))
    assert_trees_equal(resumed.params, full.params)
    assert_trees_equal(resumed.opt_state, full.opt_state)


@pytest.mark.parametrize("listing", ["sizes", "none"])
def test_checkpoints_of_before_the_checksums_restore(listing, reference, tmp_path, caplog):
    """A checkpoint written before the checksums (its metadata has no ``manifest`` entry;
    a listing of sizes, or none at all) restores without a warning."""
    config, full = reference
    from gift_jax.training import Trainer

    trainer = Trainer(config, str(tmp_path), batches=synthetic_batches, compiler_options=FAST)
    try:
        trainer.checkpointer.checksums = False  # the former save
        trainer.run(4)
        trainer.save()
    finally:
        trainer.close()
    step = tmp_path / "checkpoints" / "4"
    assert "manifest" not in json.loads((step / "meta" / "metadata").read_text())
    assert isinstance(json.loads((step / FILE_LISTING).read_text())["meta/metadata"], int)
    if listing == "none":
        (step / FILE_LISTING).unlink()
    with caplog.at_level(logging.INFO):
        resumed = run(config, str(tmp_path), resume=True)
    assert "resumed from step 4" in caplog.text
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert_trees_equal(resumed.params, full.params)


# ---- two processes, one signal -------------------------------------------------------------

MP_CONFIG = {**SMOKE["fp8_block_sr_ef"][2], "train.checkpoint_every": 100,
             "train.num_steps": 40}


def _assembled(x) -> np.ndarray:
    """The whole of ``x`` from this process's shards (parameters are replicated)."""
    out = np.zeros(x.shape, x.dtype)
    for s in x.addressable_shards:
        out[s.index] = np.asarray(s.data)
    return out


def _worker(port: int, process_id: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from gift_jax.training import initialize_distributed

    initialize_distributed(f"127.0.0.1:{port}", 2, process_id)
    config = small_config("fp8", "adamw", **MP_CONFIG)
    # only process 1 is preempted; steps of 0.1 s from then on (the notifier polls each second)
    batches = _signalling(3, slow_after=0.1) if process_id == 1 else _signalling(
        10**6, slow_after=0.0)
    stopped = None
    try:
        run(config, out + ".run", batches=batches)
    except Preempted as e:
        stopped = (e.step, e.signal_name, e.saved)
        print(f"stopped: {e}", flush=True)
    steps = sorted(int(p) for p in os.listdir(out + ".run/checkpoints") if p.isdigit())
    resumed = run(config, out + ".run", resume=True)
    if process_id == 0:
        flat = {str(i): _assembled(x) for i, x in enumerate(jax.tree.leaves(resumed.params))}
        np.savez(out, **flat)
    with open(f"{out}.{process_id}.json", "w") as f:
        json.dump({"stopped": stopped, "steps": steps}, f)
    jax.distributed.shutdown()


def test_two_processes_stop_at_the_same_step_when_one_gets_sigterm(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "mp.npz")
    env = script_env(JAX_PLATFORMS=None)
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(port), str(i), out],
                              env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    full = run(small_config("fp8", "adamw", **MP_CONFIG))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    got = [json.load(open(f"{out}.{i}.json")) for i in range(2)]
    (step0, *_), (step1, *_) = got[0]["stopped"], got[1]["stopped"]
    assert step0 == step1 and 4 <= step0 < MP_CONFIG["train.num_steps"], got
    assert got[0]["stopped"] == [step0, "SIGTERM", True] == got[1]["stopped"]
    assert got[0]["steps"] == [step0]
    for log in logs:  # one line each, naming the step
        assert [ln for ln in log.splitlines() if ln.startswith("stopped:")] == [
            f"stopped: preempted (SIGTERM) at step {step0}; checkpoint saved"]
    params = np.load(out)
    for i, leaf in enumerate(jax.tree.leaves(full.params)):
        np.testing.assert_array_equal(params[str(i)], np.asarray(leaf))


if _WORKER:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
