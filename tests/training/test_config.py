"""What a user meets before the first step: every numeric setting checked with one line naming
it and the allowed range, ``gift.layers`` and ``model.*`` checked before anything is written,
the one-device warning, and the one-line endings of ``scripts/train.py``.

Also: settings the trainer itself refuses (end to end, marked slow), and the former ``comm.mode``
vocabulary translated into ``comm.codec`` + ``comm.method``."""

import json
import logging
import os
import pathlib
import runpy
import subprocess
import sys

import ml_collections
import pytest
from trainer_kit import MODES, legacy_config, recipe_of, script_env, small_config

from gift_jax.training import (
    ConfigError,
    apply_overrides,
    build_optimizer,
    complete_config,
    validate_config,
)
from gift_jax.training.config import (
    GRID_AUTO_BYTES,
    config_differences,
    load_config,
    nothing_to_communicate,
    resolve_data_pipeline,
    set_fields,
    to_json,
    validate_layer_patterns,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.py")


def tiny(**overrides):
    """The tiny config with ``--config.<name>=<text>`` overrides."""
    return apply_overrides(complete_config(load_config(TINY)), list(overrides.items()))


@pytest.mark.parametrize(
    "overrides,match",
    [({"optimizer.learning_rate": "-1e-3"},
      r"^optimizer\.learning_rate=-0\.001 must be a finite number > 0$"),
     ({"optimizer.learning_rate": "1e400"},
      r"^optimizer\.learning_rate=inf must be a finite number > 0$"),
     ({"optimizer.learning_rate": "0"}, r"optimizer\.learning_rate=0\.0 must be"),
     ({"optimizer.final_learning_rate": "-1e-4"},
      r"optimizer\.final_learning_rate=-0\.0001 must be a finite number >= 0"),
     ({"optimizer.final_learning_rate": "1e-2"},
      r"optimizer\.final_learning_rate=0\.01 must be <= optimizer\.learning_rate=0\.003"),
     ({"optimizer.warmup_steps": "300", "optimizer.warmup_fraction": "0"},
      r"optimizer\.warmup_steps=300 must be < train\.num_steps=300"),
     ({"optimizer.warmup_fraction": "-0.5"},
      r"optimizer\.warmup_fraction=-0\.5 must be a finite number >= 0"),
     ({"optimizer.warmup_steps": "-1"}, r"optimizer\.warmup_steps=-1 must be an int >= 0"),
     ({"optimizer.b1": "1.0"}, r"optimizer\.b1=1\.0 must be a finite number in \[0, 1\)"),
     ({"optimizer.b2": "-0.1"}, r"optimizer\.b2=-0\.1 must be a finite number in \[0, 1\)"),
     ({"optimizer.eps": "0"}, r"optimizer\.eps=0\.0 must be a finite number > 0"),
     ({"optimizer.weight_decay": "-0.1"}, r"optimizer\.weight_decay=-0\.1 must be"),
     ({"optimizer.grad_clip_norm": "1e400"}, r"optimizer\.grad_clip_norm=inf must be a finite"),
     ({"optimizer.name": "muon", "optimizer.momentum": "1.5"},
      r"optimizer\.momentum=1\.5 must be a finite number in \[0, 1\)"),
     ({"optimizer.name": "muon", "optimizer.muon_extra_scale_factor": "0"},
      r"optimizer\.muon_extra_scale_factor=0\.0 must be a finite number > 0"),
     ({"comm.method": "gift", "gift.damping": "0"}, r"gift\.damping=0\.0 must be"),
     ({"comm.method": "gift", "gift.ema": "1"}, r"gift\.ema=1\.0 must be a finite number in"),
     ({"comm.method": "plumage", "plumage.scale": "-1"}, r"plumage\.scale=-1\.0 must be"),
     ({"train.seed": "-1"}, r"train\.seed=-1 must be an int >= 0"),
     ({"model.num_heads": "3"}, r"^model\.num_heads must divide d_model=128, got num_heads=3$"),
     ({"model.dtype": "float8"}, r"^model\.dtype must be one of")],
)
def test_bad_numbers_name_the_setting_and_the_range(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        validate_config(tiny(**overrides), 8)
    assert "\n" not in str(info.value)


def test_good_numbers_pass():
    validate_config(tiny(), 8)
    # a constant schedule ignores final_learning_rate; Muon's settings only matter for Muon
    validate_config(tiny(**{"optimizer.schedule": "constant",
                            "optimizer.final_learning_rate": "1.0",
                            "optimizer.momentum": "2.0"}), 8)
    validate_config(tiny(**{"optimizer.warmup_steps": "0", "optimizer.grad_clip_norm": "0",
                            "train.num_steps": "1"}), 8)


def test_override_type_errors_read_as_english():
    with pytest.raises(ConfigError, match=r"--config\.train\.num_steps='x': expected an int$"):
        tiny(**{"train.num_steps": "x"})
    with pytest.raises(ConfigError, match=r"expected a float, got a str"):
        tiny(**{"optimizer.learning_rate": "'fast'"})


PATHS = ["embed/embedding", "layers/0/attn/q_proj/kernel", "layers/0/mlp/down_proj/kernel"]


def test_gift_layers_that_match_nothing_name_the_setting():
    with pytest.raises(ConfigError, match=r"^gift\.layers pattern\(s\) '\*/nope' match no "
                                          r"parameter of the model; allowed: fnmatch") as info:
        validate_layer_patterns(tiny(**{"comm.method": "gift", "gift.layers": "*/nope"}), PATHS)
    assert "layers/0/mlp/down_proj/kernel" in str(info.value)
    validate_layer_patterns(tiny(**{"comm.method": "gift"}), PATHS)  # */mlp/down_proj
    validate_layer_patterns(tiny(**{"gift.layers": "*/nope"}), PATHS)  # GIFT does not run
    with pytest.raises(ConfigError, match="gift.layers"):  # GIFT inside PLUMAGE
        validate_layer_patterns(tiny(**{"comm.method": "plumage", "plumage.gift": "true",
                                        "gift.layers": "*/nope"}), PATHS)


def test_one_device_run_warns_that_nothing_is_communicated(caplog):
    from gift_jax.training.loop import _warn_if_nothing_to_communicate

    assert nothing_to_communicate(tiny(), 1) is None  # fp32 + none: nothing was asked for
    assert nothing_to_communicate(tiny(**{"comm.codec": "fp8_e4m3"}), 8) is None
    with caplog.at_level(logging.WARNING, logger="gift_jax.training"):
        _warn_if_nothing_to_communicate(tiny(**{"comm.codec": "fp8_e4m3",
                                                "comm.method": "gift"}), 1)
        _warn_if_nothing_to_communicate(tiny(**{"comm.method": "plumage"}), 1)
        _warn_if_nothing_to_communicate(tiny(**{"comm.codec": "bf16"}), 2)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    assert "comm.codec='fp8_e4m3' comm.method='gift' on a data-parallel size of 1" in messages[0]
    assert "nothing to communicate" in messages[1] and "--cpu_devices" in messages[1]


# ---- scripts/train.py -----------------------------------------------------------------------


@pytest.fixture()
def train_script():
    return runpy.run_path(str(ROOT / "scripts" / "train.py"))["main"]


@pytest.mark.parametrize(
    "args,needle",
    [(["--config.comm.method=gift", "--config.gift.layers=*/nope"],
      "gift.layers pattern(s) '*/nope' match no parameter"),
     (["--config.model.num_heads=3"], "model.num_heads must divide d_model=128"),
     (["--config.optimizer.learning_rate=-1e-3"], "optimizer.learning_rate=-0.001 must be"),
     (["--config.optimizer.learning_rate=1e400"], "optimizer.learning_rate=inf must be")],
)
def test_train_script_ends_with_one_line_and_writes_nothing(train_script, capsys, tmp_path,
                                                            args, needle):
    workdir = tmp_path / "run"
    rc = train_script(["--config", TINY, "--workdir", str(workdir), "--no_progress", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
    assert not workdir.exists()  # validated before the checkpoint directory is created


def test_train_script_config_file_without_get_config(train_script, capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    rc = train_script(["--config", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: config file {str(bad)!r} defines no get_config()"]


def test_ctrl_c_before_the_first_step_says_so(train_script, capsys, monkeypatch):
    import gift_jax.training

    def interrupted_while_compiling(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gift_jax.training, "train", interrupted_while_compiling)
    rc = train_script(["--config", TINY, "--no_progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 130
    assert err == ("stopped: interrupted with no checkpoint written by this run (before the "
                   "first step, or by a second Ctrl-C)")


def test_train_script_quiets_the_missing_tpu_message(train_script, capsys):
    logger, root = logging.getLogger("jax._src.xla_bridge"), logging.getLogger()
    before = logger.level, root.level
    root.setLevel(logging.INFO)  # what the script's basicConfig does outside pytest
    try:
        train_script(["--config", TINY, "--config.comm.method=int4"])
        capsys.readouterr()
        assert not logger.isEnabledFor(logging.INFO)
        assert logging.getLogger("gift_jax.training").isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(before[0])
        root.setLevel(before[1])


def _script_stderr(*args: str) -> str:
    """stderr of ``scripts/train.py`` run in a fresh process with its own devices."""
    env = script_env(JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config", TINY,
                           *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


@pytest.mark.slow  # two fresh Python processes importing JAX
def test_train_script_simulates_cpu_devices_unless_told_otherwise():
    # a batch of 12 cannot be split over the 8 simulated devices: the error names the count
    err = _script_stderr("--config.train.global_batch_size=12")
    assert "data-parallel size 8 (number of devices)" in err
    assert "Unable to initialize backend" not in err
    err = _script_stderr("--cpu_devices", "3")
    assert "data-parallel size 3 (number of devices)" in err


# ---- settings checked by the trainer, and the former comm.mode -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,match",
    [({"train.global_batch_size": 12}, r"train\.global_batch_size=12 must be divisible by "
                                        r"the data-parallel size 8"),
     ({"comm.method": "int4"}, r"comm\.method='int4' is not supported; allowed: none, gift, "
                               r"plumage"),
     ({"optimizer.name": "sgd"}, r"optimizer\.name='sgd' is not supported; allowed: adamw"),
     ({"comm.codec": "fp6"}, r"comm\.codec='fp6' is not supported; allowed: fp32, bf16, "
                             r"fp8_e4m3, fp8_e5m2, mxfp8, nvfp4"),
     ({"train.grad_accum_steps": 3}, r"train\.grad_accum_steps=3 must divide"),
     ({"mesh.intra_size": 3}, r"mesh\.intra_size=3 must divide"),
     ({"data.pipeline": "tfdata"}, r"data\.pipeline='tfdata' is not supported; allowed: "
                                   r"auto, grid, stream"),
     ({"data.workers": -2}, r"data\.workers=-2 must be an int >= -1 \(-1: the host's cores"),
     ({"data.pipeline": "stream", "data.id_cache": "gs://bucket/ids"},
      r"data\.id_cache='gs://bucket/ids' must be a local directory or ''"),
     ({"data.id_cache": "/tmp/ids"}, r"data\.id_cache='/tmp/ids' needs data\.pipeline='stream'"),
     ({"comm.method": "gift", "gift.eig_method": "qr"},
      r"gift\.eig_method='qr' is not supported; allowed: eigh, subspace")],
)
def test_bad_settings_name_the_setting(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(small_config(**overrides), 8)


@pytest.mark.slow
def test_overrides_and_script_errors(capsys, tmp_path):
    config = complete_config(small_config())
    out = apply_overrides(config, [("comm.method", "gift"), ("train.num_steps", "7"),
                                   ("comm.error_feedback", "true"), ("gift.layers",
                                                                     "('*/mlp/up_proj',)")])
    assert (out.comm.method, out.train.num_steps, out.comm.error_feedback) == ("gift", 7, True)
    assert out.gift.layers == ("*/mlp/up_proj",)
    with pytest.raises(ConfigError, match="unknown config field 'comm.moode'"):
        apply_overrides(config, [("comm.moode", "fp8")])
    with pytest.raises(ConfigError, match=r"--config.train.num_steps='x': expected an int"):
        apply_overrides(config, [("train.num_steps", "x")])
    script = runpy.run_path(str(ROOT / "scripts" / "train.py"))
    for args, needle in [
        (["--config.comm.moode=fp8"], "unknown config field 'comm.moode'"),
        (["--config.comm.method=int4"], "comm.method='int4' is not supported"),
        (["--config.comm.mode=gift_fp8"], "comm.mode was replaced by comm.codec"),
        (["--config.train.global_batch_size=12"], "train.global_batch_size=12"),
    ]:
        rc = script["main"](["--config", str(ROOT / "configs" / "tiny.py"),
                             "--workdir", str(tmp_path), *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,match",
    [({"plumage.gift": "yes"}, r"plumage\.gift='yes' must be a bool"),
     ({"plumage.gift": True, "gift.two_sided": True},
      r"gift\.two_sided=True cannot be combined with plumage\.gift=True"),
     ({"plumage.gift": True, "gift.remainder": "full"},
      r"gift\.remainder='full' is not supported"),
     ({"plumage.gift": True, "gift.route_frame": "sideways"},
      r"gift\.route_frame='sideways' is not supported"),
     ({"plumage.gift": True, "gift.refresh": "adaptive"},
      r"gift\.refresh='adaptive' cannot be combined with plumage\.gift=True")],
)
def test_plumage_gift_bad_settings_name_the_setting(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(small_config("plumage", "adamw", **overrides), 8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_every_former_mode_translates(mode):
    """A config file and a checkpoint carrying the former comm.mode become exactly the
    (comm.codec, comm.method) pair, and build the same plan."""
    from gift_jax.training.config import config_differences, to_json

    new = small_config(mode, **({"comm.codec": "fp8_e5m2"} if mode == "gift_fp8" else {}))
    old = legacy_config(new)
    assert "mode" in old.comm and "method" not in old.comm
    translated = complete_config(old)
    assert (translated.comm.codec, translated.comm.method) == (new.comm.codec, new.comm.method)
    assert to_json(translated) == to_json(new)
    assert config_differences(to_json(old), new) == []  # an old checkpoint resumes
    plan = build_optimizer(recipe_of(translated), ("data",)).plan
    assert (plan.name, plan.codec) == (new.comm.method, new.comm.codec)
    assert plan.variants() == ((False, True) if mode in ("gift_fp8", "plumage") else (False,))


@pytest.mark.slow
def test_former_mode_override_and_conflicts_name_the_new_settings():
    config = small_config()
    with pytest.raises(ConfigError, match=r"comm\.mode='gift_fp8': comm\.mode was replaced by "
                                          r"comm\.codec \(fp32, bf16, .*\) and comm\.method "
                                          r"\(none, gift, plumage\).*gift_fp8 = comm\.codec="):
        apply_overrides(config, [("comm.mode", "gift_fp8")])
    both = legacy_config(config)
    with both.unlocked():
        both.comm.method = "gift"
    with pytest.raises(ConfigError, match="comm.mode and comm.method are both set"):
        complete_config(both)
    unknown = legacy_config(config)
    with unknown.unlocked():
        unknown.comm.mode = "int4"
    with pytest.raises(ConfigError, match=r"comm\.mode='int4' is not supported: comm\.mode was "
                                          r"replaced by comm\.codec"):
        complete_config(unknown)


@pytest.mark.slow
def test_load_config_names_missing_files_and_missing_get_config(tmp_path):
    from gift_jax.training.config import ConfigError, load_config

    configs = ROOT / "configs"
    by_name, by_path = load_config("tiny", configs), load_config(configs / "tiny.py")
    assert by_name.to_dict() == by_path.to_dict()
    with pytest.raises(ConfigError, match="'nope': no such file"):
        load_config("nope", configs)
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="bad.py' defines no get_config"):
        load_config(bad)



# ---- data.pipeline='auto' ---------------------------------------------------------------------


def _with_data(source="shakespeare", workdir="", **fields):
    return set_fields(tiny(), {"data.source": source, "train.workdir": workdir, **fields})


@pytest.mark.parametrize("source,pipeline,why", [
    ("shakespeare", "grid", "bundled"), ("small", "grid", "MB, at most 16.0 MB"),
    ("big", "stream", "MB, more than 16.0 MB"), ("text:/no/such/corpus", "stream", "any size"),
    ("tfds:c4/en:3.0.1", "stream", "any size")])
def test_auto_pipeline_reads_small_corpora_whole_and_streams_the_rest(source, pipeline, why,
                                                                      caplog, tmp_path):
    """The default ``auto`` takes the grid for the bundled corpus and a ``text:DIR`` corpus of
    at most GRID_AUTO_BYTES (their pass before step 1 is short), the stream for a larger one
    and for a corpus of unknown size; validation resolves it in place and says why in one
    line; an explicit setting wins."""
    if source in ("small", "big"):
        (tmp_path / "a.txt").write_text("some text\n" * 100)
        if source == "big":  # a sparse file: its size, not its bytes, is what auto reads
            with open(tmp_path / "b.txt", "wb") as f:
                f.truncate(GRID_AUTO_BYTES)
        source = f"text:{tmp_path}"
    assert complete_config(ml_collections.ConfigDict()).data.pipeline == "auto"
    config = _with_data(source)
    with caplog.at_level(logging.INFO, logger="gift_jax.training.config"):
        validate_config(config, 8)
    assert config.data.pipeline == pipeline
    lines = [r.getMessage() for r in caplog.records if "data.pipeline" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"data.pipeline=auto -> {pipeline!r}: ")
    assert why in lines[0], lines[0]
    validate_config(config, 8)  # resolved: nothing more to say
    assert len([r for r in caplog.records if "data.pipeline" in r.getMessage()]) == 1
    for explicit in ("grid", "stream"):
        config = _with_data(source, **{"data.pipeline": explicit})
        assert resolve_data_pipeline(config) is None and config.data.pipeline == explicit
    # id_cache needs the stream: fine where auto streams, one line where it takes the grid
    config = _with_data(source, **{"data.id_cache": "/tmp/ids"})
    if pipeline == "stream":
        validate_config(config, 8)
    else:
        with pytest.raises(ConfigError, match=r"needs data\.pipeline='stream'"):
            validate_config(config, 8)


def _write_checkpoint(workdir, config, monkeypatch=None, drop=()):
    """A real checkpoint of a two-leaf state in ``workdir``, its stored config without the
    settings in ``drop`` (as one written before they existed)."""
    import jax.numpy as jnp

    from gift_jax.training import checkpoint

    if drop:
        original = checkpoint.to_json
        monkeypatch.setattr(checkpoint, "to_json", lambda c: json.dumps(
            {k: v for k, v in json.loads(original(c)).items() if k not in drop}))
    ckpt = checkpoint.Checkpointer(str(workdir), config)
    ckpt.save(3, {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}, data_position=3)
    ckpt.close()


@pytest.mark.parametrize("stored,drop", [("grid", ()), ("stream", ()),
                                         ("grid", ("data.pipeline",))])
def test_auto_pipeline_resumes_with_the_checkpoints_pipeline(tmp_path, monkeypatch, stored,
                                                              drop):
    """A checkpoint written with the former default (``grid``, stored or, before the setting,
    absent) resumes with the grid on a ``text:`` corpus under ``auto``: the run reads the
    batches it was reading, and the stored config matches the resolved one."""
    written = _with_data("text:/corpus", str(tmp_path), **{"data.pipeline": stored})
    _write_checkpoint(tmp_path, written, monkeypatch, drop)
    resumed = _with_data("text:/corpus", str(tmp_path))
    line = resolve_data_pipeline(resumed)
    assert resumed.data.pipeline == stored and "checkpoints" in line, line
    from gift_jax.training.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tmp_path), resumed)
    try:
        assert ckpt.check_config()["step"] == 3  # no difference reported
    finally:
        ckpt.close()
    # without a checkpoint the same config streams; a stream config against the grid
    # checkpoint is a difference named in one line
    assert resolve_data_pipeline(_with_data("text:/corpus", str(tmp_path / "new"))) is not None
    other = set_fields(resumed, {"data.pipeline": "stream" if stored == "grid" else "grid"})
    stored_json = json.dumps({k: v for k, v in json.loads(to_json(written)).items()
                              if k not in drop})
    assert [d for d in config_differences(stored_json, other) if d.startswith("data.")] == [
        f"data.pipeline: {stored if not drop else 'grid'!r} (checkpoint) != "
        f"{other.data.pipeline!r} (now)"]


def test_an_unresolved_auto_pipeline_matches_the_checkpoints():
    """``auto`` not yet resolved (a Checkpointer built from a completed config) is no
    difference from a stored pipeline: resuming, it resolves to it."""
    stored = to_json(_with_data(**{"data.pipeline": "grid"}))
    assert config_differences(stored, _with_data()) == []
    assert config_differences(stored, _with_data(**{"data.pipeline": "stream"})) == [
        "data.pipeline: 'grid' (checkpoint) != 'stream' (now)"]
