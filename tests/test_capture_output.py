"""Two-sided K-FAC capture (gift_jax.whitening.capture.kfac_value_and_grad): the output-side
statistic B = E_t[g_t g_tᵀ] = N·Σ_t δ_t δ_tᵀ against a hand computation with ``jax.grad``
w.r.t. the layer outputs, the input side, loss and gradients against the plain paths, model
restoration, nnx.scan stacks, a tiny Llama with ``gift(two_sided=True)``, and the trainer's
``gift.two_sided``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from nnx_toys import DF, DM, NL, ListModel, ScanModel

from gift_jax.models.llama import Llama, LlamaConfig, next_token_loss
from gift_jax.whitening.capture import (
    GiftOutputProbe,
    install_capture,
    kfac_value_and_grad,
    output_probes,
    remove_capture,
    with_input_stats,
)
from gift_jax.whitening.stage import GiftDimensionNumbers, gift

B_, T_ = 2, 5  # batch, sequence: N = 10 tokens per layer
TOL = dict(rtol=1e-4, atol=1e-7)
#: B = N·Σ δδᵀ against the hand computation: float32 sums of N products, so an entry that
#: cancels is off by a few float32 ulps of the largest entry, not of itself
B_ATOL = 1e-6


def _loss(model, x):
    return jnp.mean(jnp.tanh(model(x)) ** 2)


X = jnp.asarray(np.random.default_rng(0).standard_normal((B_, T_, DM)), jnp.float32)


def _reference(params, x, stacked):
    """Hand computation: zero perturbations ``e`` added to every up/down_proj output of a pure
    function of the parameters; ``jax.grad`` w.r.t. ``e`` is δ (B, T, m) per layer.  Returns
    ``({name: A}, {name: N·Σ δδᵀ})`` with names ``(block, 'up'|'down')``."""
    blocks = ([jax.tree.map(lambda v, i=i: v[i], params["layers"]) for i in range(NL)]
              if stacked else [params["layers"][i] for i in range(2)])

    def forward(eps):
        h, acts = x, {}
        for i, blk in enumerate(blocks):
            up, down = blk["mlp"]["up_proj"], blk["mlp"]["down_proj"]
            acts[(i, "up")] = h
            u = jax.nn.relu(h @ up["kernel"] + up["bias"] + eps[(i, "up")])
            acts[(i, "down")] = u
            h = h + u @ down["kernel"] + down["bias"] + eps[(i, "down")]
        return jnp.mean(jnp.tanh(h) ** 2), acts

    eps = {(i, s): jnp.zeros((B_, T_, DF if s == "up" else DM))
           for i in range(len(blocks)) for s in ("up", "down")}
    deltas, acts = jax.grad(forward, has_aux=True)(eps)
    n = B_ * T_
    a = {k: np.asarray(v).reshape(n, -1).T @ np.asarray(v).reshape(n, -1) / n
         for k, v in acts.items()}
    b = {k: n * np.asarray(v).reshape(n, -1).T @ np.asarray(v).reshape(n, -1)
         for k, v in deltas.items()}
    return a, b


def _params(model):
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_list_model_matches_hand_computation_and_plain_paths():
    model = ListModel(nnx.Rngs(0))
    before = nnx.graphdef(model)
    layers = ["*/mlp/*_proj"]
    refresh = nnx.jit(kfac_value_and_grad(_loss, layers))
    (loss, (a_stats, b_stats)), grads = refresh(model, X)
    keys = sorted(f"layers/{i}/mlp/{s}_proj/kernel" for i in range(2) for s in ("up", "down"))
    assert sorted(a_stats) == sorted(b_stats) == keys
    a_ref, b_ref = _reference(_params(model), X, stacked=False)
    for (i, s), want in b_ref.items():
        got = b_stats[f"layers/{i}/mlp/{s}_proj/kernel"]
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=B_ATOL * np.abs(want).max())
        np.testing.assert_allclose(a_stats[f"layers/{i}/mlp/{s}_proj/kernel"], a_ref[(i, s)],
                                   **TOL)
    # A is the input-side capture's; loss and gradients are the plain loss's
    (loss_in, a_in), g_in = nnx.jit(nnx.value_and_grad(with_input_stats(_loss, layers),
                                                       has_aux=True))(model, X)
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(u, v), a_stats, a_in)
    loss_plain, g_plain = nnx.jit(nnx.value_and_grad(_loss))(model, X)
    np.testing.assert_allclose(loss, loss_plain, rtol=1e-6)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-8),
                 grads, g_plain)
    assert jax.tree.structure(grads) == jax.tree.structure(g_plain)
    # the model is restored: same graph, plain classes, no temporary variables
    assert nnx.graphdef(model) == before
    for blk in model.layers:
        for mod in (blk.mlp.up_proj, blk.mlp.down_proj):
            assert type(mod) is nnx.Linear and not any(
                k.startswith("gift_") for k in vars(mod))
    # the stage accepts both statistics (two-sided Kronecker factors)
    tx = gift(optax.identity(), layers, rank=4, two_sided=True)
    g = nnx.to_pure_dict(grads)
    _, state = jax.jit(lambda g, s, a, b: tx.update(g, s, gift_stats=a, gift_output_stats=b))(
        g, tx.init(g), a_stats, b_stats)
    assert int(state.refreshes) == 1 and int(state.identity_fallbacks) == 0


def test_sum_reduction_aux_and_errors():
    model = ListModel(nnx.Rngs(1))
    layers = ["layers/1/mlp/down_proj"]
    (_, (_, b_mean)), _ = nnx.jit(kfac_value_and_grad(_loss, layers))(model, X)

    def sum_loss(m, x):  # Σ_t ℓ_t = N · (the mean loss), with an aux output
        per = jnp.mean(jnp.tanh(m(x)) ** 2, axis=-1)
        return jnp.sum(per), {"tokens": per.size}

    fn = nnx.jit(kfac_value_and_grad(sum_loss, layers, has_aux=True, reduction="sum"))
    ((loss, aux), (a, b_sum)), _ = fn(model, X)
    assert aux["tokens"] == B_ * T_ and loss.shape == ()
    # per-token convention: the same B whether the loss is the mean or the sum over tokens
    key = "layers/1/mlp/down_proj/kernel"
    np.testing.assert_allclose(b_sum[key], b_mean[key], rtol=1e-4,
                               atol=1e-6 * float(jnp.abs(b_mean[key]).max()))
    with pytest.raises(ValueError, match="reduction"):
        kfac_value_and_grad(_loss, layers, reduction="none")
    with pytest.raises(ValueError, match="match no"):
        kfac_value_and_grad(_loss, ["*/attn/q_proj"])(model, X)
    with pytest.raises(ValueError, match="output_probes keys"):
        install_capture(model, layers, output_probes={"x/kernel": jnp.zeros((DM, DM))})
    handle = install_capture(model, layers, output_probes=output_probes(model, layers))
    assert isinstance(vars(model.layers[1].mlp.down_proj)["gift_output_probe"], GiftOutputProbe)
    remove_capture(handle)
    assert type(model.layers[1].mlp.down_proj) is nnx.Linear


def test_scan_stacked_layers():
    model = ScanModel(nnx.Rngs(2))
    layers = ["layers/mlp/up_proj", "layers/mlp/down_proj"]
    (loss, (a_stats, b_stats)), grads = nnx.jit(kfac_value_and_grad(_loss, layers))(model, X)
    up, down = "layers/mlp/up_proj/kernel", "layers/mlp/down_proj/kernel"
    assert b_stats[up].shape == (NL, DF, DF) and b_stats[down].shape == (NL, DM, DM)
    assert a_stats[up].shape == (NL, DM, DM) and a_stats[down].shape == (NL, DF, DF)
    a_ref, b_ref = _reference(_params(model), X, stacked=True)
    for (i, s), want in b_ref.items():
        got = b_stats[up if s == "up" else down][i]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=B_ATOL * np.abs(want).max())
        np.testing.assert_allclose((a_stats[up if s == "up" else down])[i], a_ref[(i, s)],
                                   **TOL)
    _, g_plain = nnx.jit(nnx.value_and_grad(_loss))(model, X)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-8),
                 grads, g_plain)
    tx = gift(optax.identity(), layers, rank=4, two_sided=True,
              dimension_numbers={p: GiftDimensionNumbers(1, 2) for p in layers})
    g = nnx.to_pure_dict(grads)
    _, st = jax.jit(lambda g, s, a, b: tx.update(g, s, gift_stats=a, gift_output_stats=b))(
        g, tx.init(g), a_stats, b_stats)
    assert int(st.refreshes) == 1 and int(st.identity_fallbacks) == 0
    assert st.whitened[up].out_stats.shape == (NL, DF, DF)


def test_tiny_llama_keys_match_gift_selection():
    cfg = LlamaConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=48,
                      max_seq_len=16)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)), jnp.int32)
    layers = ("*/mlp/down_proj", "*/attn/q_proj")
    refresh = nnx.jit(kfac_value_and_grad(next_token_loss, layers))
    (loss, (a_stats, b_stats)), grads = refresh(model, tokens)
    tx = gift(optax.identity(), layers, rank=4, two_sided=True)
    g = nnx.to_pure_dict(grads)
    state = tx.init(g)
    assert sorted(a_stats) == sorted(b_stats) == sorted(state.whitened)
    assert sorted(state.member("out_stats")) == sorted(state.whitened)
    assert sorted(b_stats) == ["layers/0/attn/q_proj/kernel", "layers/0/mlp/down_proj/kernel"]
    for path, b in b_stats.items():
        m = 32
        assert b.shape == (m, m) and bool(jnp.all(jnp.isfinite(b)))
        np.testing.assert_allclose(b, b.T, rtol=1e-5, atol=1e-12)
        assert float(jnp.trace(b)) > 0, path
    loss_plain, g_plain = nnx.jit(nnx.value_and_grad(next_token_loss))(model, tokens)
    np.testing.assert_allclose(loss, loss_plain, rtol=1e-6)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-8),
                 grads, g_plain)
    out, state = jax.jit(lambda g, s, a, b: tx.update(g, s, gift_stats=a,
                                                      gift_output_stats=b))(
        g, state, a_stats, b_stats)
    assert int(state.refreshes) == 1 and int(state.identity_fallbacks) == 0
    # whiten → identity inner → unwhiten is the identity on the gradient
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-3, atol=1e-6), out, g)


def test_input_coverage_of_scanned_layers_matches_their_statistics():
    """GIFT's adaptive-refresh signal: the sample sums of ``with_input_coverage`` (every token
    here) give ``tr(BᵀSASB)/tr(SAS)`` of the same inputs' A, per stacked layer; gradients and
    the model are untouched."""
    from gift_jax.whitening.capture import with_input_coverage
    from gift_jax.whitening.stage import coverage_bases, input_coverage

    model = ScanModel(nnx.Rngs(3))
    layers = ["layers/mlp/down_proj"]
    down = "layers/mlp/down_proj/kernel"
    (_, a_stats), grads = nnx.jit(nnx.value_and_grad(with_input_stats(_loss, layers),
                                                     has_aux=True))(model, X)
    tx = gift(optax.identity(), layers, rank=4, factor="lowrank_diag",
              dimension_numbers={down: GiftDimensionNumbers(1, 2)})
    g = nnx.to_pure_dict(grads)
    _, st = jax.jit(lambda g, s, a: tx.update(g, s, gift_stats=a))(g, tx.init(g), a_stats)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    bases = coverage_bases(st)
    assert list(bases) == [down] and bases[down][0].shape == (NL, DF, 4)
    (_, sums), g_cov = nnx.jit(nnx.value_and_grad(with_input_coverage(_loss, bases),
                                                  has_aux=True))(model, X)
    assert sums[down].shape == (NL, 2)
    want = jax.vmap(input_coverage)(st.whitened[down].factor, a_stats[down])
    np.testing.assert_allclose(sums[down][:, 0] / sums[down][:, 1], want, rtol=1e-5)
    assert ((0 < want) & (want < 1)).all()
    jax.tree.map(lambda u, v: np.testing.assert_array_equal(u, v), nnx.to_pure_dict(g_cov),
                 g)
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))))
    (_, few), _ = nnx.jit(nnx.value_and_grad(with_input_coverage(_loss, bases, samples=5),
                                             has_aux=True))(model, X)  # every 2nd token
    assert (np.asarray(few[down][:, 1]) < np.asarray(sums[down][:, 1])).all()
    with pytest.raises(ValueError, match=r"samples=0 must be an int >= 1"):
        with_input_coverage(_loss, bases, samples=0)(model, X)
