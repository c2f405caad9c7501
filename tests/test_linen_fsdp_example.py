"""examples/linen_fsdp.py (a public-style flax linen trainer: boxed parameters FSDP on data,
a token-weighted loss over padded rows, optax.MultiSteps, an orbax-checkpointed TrainState)
and its ports: linen_fsdp_fp8.py (6 lines: FP8 across data, the FSDP layout as it is) and
linen_fsdp_gift.py (12 lines: GIFT, its state in the TrainState)."""

import difflib
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name):  # a fresh module each time: its own constants and its own build cache
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("port, most", [("linen_fsdp_fp8", 6), ("linen_fsdp_gift", 12)])
def test_the_ports_change_few_lines(port, most):
    a = (EXAMPLES / "linen_fsdp.py").read_text().splitlines()
    b = (EXAMPLES / f"{port}.py").read_text().splitlines()
    diff = list(difflib.unified_diff(a, b, lineterm="", n=0))
    added = [x for x in diff[2:] if x.startswith("+")]
    removed = [x for x in diff[2:] if x.startswith("-")]
    assert 0 < len(added) <= most and len(removed) <= len(added), "\n".join(diff)
    assert not any("PartitionSpec" in x or "get_sharding" in x for x in added + removed)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def original():
    """The original example and 4 steps of it: ``(module, final state, metrics)``."""
    module = _load("linen_fsdp")
    return (module, *module.train(steps=4))


@pytest.mark.slow
def test_the_fp8_port_is_the_original_with_fp32_and_its_loss_the_global_token_mean(original):
    """The FP8 port with the fp32 codec: the original's losses (each the global token mean of
    its batch: the original is one GSPMD program over the whole batch) and parameters to fp32
    rounding (the per-replica backward compiles apart from the whole program's); token counts
    exactly. The mean of the replicas' own token means, what the port would compute without
    ``loss_weight``, is measurably off. With fp8 the port trains close to the original."""
    original, s1, h1 = original
    port = _load("linen_fsdp_fp8")
    port.COMM = "fp32"
    s2, h2 = port.train(steps=4)
    np.testing.assert_allclose([float(m["loss"]) for m in h2], [float(m["loss"]) for m in h1],
                               rtol=2e-6)
    assert [int(m["tokens"]) for m in h2] == [int(m["tokens"]) for m in h1]
    for a, b in zip(_leaves(s1.params), _leaves(s2.params), strict=True):
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
    assert int(s2.step) == 4
    # the bias loss_weight removes: the first batch's replica means, averaged
    mesh, _, fresh = original.build()
    batch = jax.device_get(original.batch_at(mesh, 0))
    rows = original.BATCH // 8

    @jax.jit
    def replica_loss(params, part):
        return original.loss_fn(fresh.apply_fn, params, part)[0]

    means = [float(replica_loss(jax.device_get(fresh.params),
                                jax.tree.map(lambda x, r=r: x[r * rows:(r + 1) * rows], batch)))
             for r in range(8)]
    assert abs(np.mean(means) - float(h1[0]["loss"])) > 1e-4, (np.mean(means), h1[0]["loss"])
    fp8 = _load("linen_fsdp_fp8")
    _, h3 = fp8.train(steps=2)
    np.testing.assert_allclose([float(m["loss"]) for m in h3],
                               [float(m["loss"]) for m in h1[:2]], atol=2e-3)


@pytest.mark.slow
def test_the_gift_port_keeps_its_state_in_the_train_state_and_resumes_bit_for_bit(
        original, tmp_path):
    """GIFT (refreshed on steps 0 and 4 from the linen capture): 6 steps, or 3, an orbax save
    of the TrainState, a restore and 3 more: the same parameters, optimizer and GIFT state bit
    for bit. The checkpoint holds the comm state; a restore without it diverges."""
    gift = _load("linen_fsdp_gift")
    whole, history = gift.train(steps=6)
    np.testing.assert_allclose([float(m["loss"]) for m in history[:4]],
                               [float(m["loss"]) for m in original[2]], atol=2e-3)
    # the loss's own aux beside GIFT's statistics, on refresh steps (0) and the others
    assert [int(m["tokens"]) for m in history[:4]] == [int(m["tokens"]) for m in original[2]]
    assert int(whole.comm_state.refreshes) == 2 and int(whole.comm_state.count) == 1
    first, _ = gift.train(steps=3, ckpt=tmp_path / "ckpt")
    mesh, _, fresh = gift.build()
    restored = gift.restore(tmp_path / "ckpt", fresh, mesh)
    for a, b in zip(_leaves(first), _leaves(restored), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(restored.comm_state.refreshes) == 1  # the checkpoint holds GIFT's factors
    resumed, tail = gift.train(steps=3, state=restored)
    assert [float(m["loss"]) for m in tail] == [float(m["loss"]) for m in history[3:]]
    for a, b in zip(_leaves(whole), _leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    lost, _ = gift.train(steps=3, state=restored.replace(comm_state=fresh.comm_state))
    assert not all(np.array_equal(a, b) for a, b in zip(
        _leaves(whole.params), _leaves(lost.params), strict=True))
    assert jnp.isfinite(whole.comm_state.whitened["blocks_0/mlp_out/kernel"].stats).all()
