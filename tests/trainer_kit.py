"""What the trainer tests share: a 1-layer, d_model 32 Llama config with the (codec, method)
of a mode label, synthetic batches of a repetitive text, runs compiled at XLA optimization
level 0 (repeated runs of one config reuse the cached program,
:mod:`gift_jax.training.program`), and bit-level comparisons of replicas and trees."""

import os
import pathlib
import runpy
import signal

import jax
import ml_collections
import numpy as np
from codegen import SUITE_CODEGEN

from gift_jax.comm.codecs import get_codec
from gift_jax.training import complete_config, train
from gift_jax.training.config import DEFAULT_LOW_PRECISION_CODEC, set_fields
from gift_jax.training.recipe import Recipe
from gift_jax.utils.cpu_devices import FORCE_COUNT_FLAG

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 24  # num_steps of every config here (smoke runs stop early with stop_after)

#: The trainer runs' compiler options: the suite's code generation (tests/codegen.py), also
#: where a user's XLA_FLAGS choose another.
FAST = SUITE_CODEGEN


def script_env(**changes: str | None) -> dict[str, str]:
    """The environment of a script a test starts: this process's, with the device count taken
    out of ``XLA_FLAGS`` (the script sets its own, e.g. ``--cpu_devices``) and any other XLA
    flag kept (so that its results agree with this process's bit for bit); then ``changes``
    (``None`` removes a variable)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith(FORCE_COUNT_FLAG))
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


_TEXT = np.frombuffer(b"the quick brown fox jumps over the lazy dog; " * 40, np.uint8)


# (mode, optimizer, overrides): every mode, both optimizers, accumulation, hierarchical mesh
SMOKE = {
    "fp32_accum": ("fp32", "adamw", {"train.grad_accum_steps": 2}),
    "fp8_block_sr_ef": ("fp8", "adamw", {"comm.codec": "fp8_e5m2", "comm.scaling": "block",
                                         "comm.block_size": 32, "comm.error_feedback": True,
                                         "comm.stochastic_rounding": True}),
    "bf16_hier_muon": ("bf16", "muon", {"mesh.intra_size": 2}),
    "gift_fp8_ef": ("gift_fp8", "adamw", {"comm.error_feedback": True,
                                          "comm.stochastic_rounding": True}),
    "gift_fp8_subspace": ("gift_fp8", "adamw", {"gift.eig_method": "subspace"}),
    "plumage": ("plumage", "adamw", {}),
}


def synthetic_batches(split, global_batch, seq_len, *, seed, start_step, process_index,
                      process_count):
    """Windows of a repetitive text: batch k depends on (split, seed, k) only."""
    local = global_batch // process_count
    k = start_step
    while True:
        rng = np.random.default_rng([seed, k, int(split == "train")])
        starts = rng.integers(0, len(_TEXT) - seq_len - 1, global_batch)
        rows = np.stack([_TEXT[s: s + seq_len + 1] for s in starts]).astype(np.int32)
        yield rows[process_index * local: (process_index + 1) * local]
        k += 1


def interrupting_batches(at: int):
    """:func:`synthetic_batches` that send this process SIGINT (a Ctrl-C) while training batch
    ``at`` (0-based) is prepared, i.e. during step ``at``."""

    def batches(split, *args, **kwargs):
        for k, batch in enumerate(synthetic_batches(split, *args, **kwargs)):
            if split == "train" and k == at:
                os.kill(os.getpid(), signal.SIGINT)
            yield batch

    return batches


#: The former comm.mode values as (comm.codec, comm.method) (base.py's low-precision codec is
#: fp8_e4m3); the tests name runs by these labels.
MODES = {"fp32": ("fp32", "none"), "bf16": ("bf16", "none"), "fp8": ("fp8_e4m3", "none"),
         "gift_fp8": ("fp8_e4m3", "gift"), "plumage": ("fp8_e4m3", "plumage")}


def small_config(mode="fp8", optimizer="adamw", **overrides):
    """The small test config with the (comm.codec, comm.method) of ``mode`` (a key of
    :data:`MODES`); ``overrides`` win (e.g. ``**{"comm.codec": "fp8_e5m2"}``)."""
    config = complete_config(runpy.run_path(str(ROOT / "configs" / "base.py"))["get_config"]())
    codec, method = MODES[mode]
    base = {
        "model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2, "model.d_ff": 64,
        "model.max_seq_len": 16, "train.seq_len": 16, "train.global_batch_size": 16,
        "train.num_steps": STEPS, "train.log_every": 2, "train.eval_every": 0,
        "train.diagnostics_every": 0, "optimizer.warmup_steps": 2,
        "optimizer.learning_rate": 1e-2, "optimizer.final_learning_rate": 1e-3,
        "gift.rank": 4, "gift.refresh_every": 2, "plumage.rank": 4,
        "plumage.refresh_every": 2, "comm.codec": codec, "comm.method": method,
        "optimizer.name": optimizer,
    }
    base.update(overrides)
    return set_fields(config, base)


def run(config, workdir=None, **kwargs):
    kwargs.setdefault("batches", synthetic_batches)
    kwargs.setdefault("show_progress", False)
    kwargs.setdefault("compiler_options", FAST)
    return train(config, workdir, **kwargs)


def assert_replicas_identical(tree):
    """Every data replica holds bit-identical copies of each shard (of each leaf)."""
    for leaf in jax.tree.leaves(tree):
        by_index = {}
        for s in leaf.addressable_shards:
            by_index.setdefault(str(s.index), []).append(np.atleast_1d(np.asarray(s.data)))
        for copies in by_index.values():
            for c in copies[1:]:
                np.testing.assert_array_equal(c.view(np.uint8), copies[0].view(np.uint8))


def assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def legacy_config(config):
    """``config`` as the former vocabulary wrote it: ``comm.mode`` and a low-precision
    ``comm.codec`` (base.py's old default fp8_e4m3 where the mode ignored it)."""
    codec, method = config.comm.codec, config.comm.method
    scaled = get_codec(codec).is_scaled  # the former modes named only the unscaled codecs
    mode = {"gift": "gift_fp8", "plumage": "plumage"}.get(method, "fp8" if scaled else codec)
    old = ml_collections.ConfigDict(config.to_dict())
    with old.unlocked():
        del old.comm["method"]
        old.comm.mode = mode
        old.comm.codec = codec if scaled else DEFAULT_LOW_PRECISION_CODEC
    return old


def recipe_of(config, num_devices: int = 8) -> Recipe:
    """The typed recipe of ``config`` (completed) on ``num_devices`` devices."""
    return Recipe.from_config(complete_config(config), num_devices)
