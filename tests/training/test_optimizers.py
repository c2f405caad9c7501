"""The optimizer registry: every entry builds a jitted update on the trainer's tree shapes,
declares settings the config checks and a route frame GIFT knows; Lion's first step is the
sign of the gradient; Muon orthogonalises the hidden matrices only."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gift_jax.training import config as C
from gift_jax.training import optimizers as O
from gift_jax.training.recipe import route_frame
from gift_jax.whitening.stage import ROUTE_FRAMES


def _params(scan_layers=False):
    ks = jax.random.split(jax.random.key(0), 4)
    hidden = (jax.random.normal(ks[0], (2, 16, 24)) if scan_layers
              else jax.random.normal(ks[0], (16, 24)))
    return {"embed": {"embedding": jax.random.normal(ks[1], (32, 16))},
            "layers" if scan_layers else "layer_0": {"kernel": hidden},
            "norm": {"scale": jnp.ones((16,))},
            "lm_head": {"kernel": jax.random.normal(ks[3], (16, 32))}}


def _opt(config, name, **overrides):
    config.optimizer.name = name
    for k, v in overrides.items():
        config.optimizer[k] = v
    return config.optimizer


@pytest.mark.parametrize("name", O.OPTIMIZER_NAMES)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_entry_builds_a_jitted_finite_step(tiny_config, name, scan_layers):
    entry = O.get_optimizer(name)
    assert entry.name == name and entry.route_frame in ROUTE_FRAMES
    params = _params(scan_layers)
    tx = entry.build(_opt(tiny_config, name), optax.constant_schedule(1e-3), scan_layers)
    grads = jax.tree.map(lambda p: jnp.cos(p) + 0.1, params)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
        assert u.shape == p.shape and bool(jnp.all(jnp.isfinite(u))) and bool(jnp.any(u != 0))


def test_every_declared_setting_is_checked_by_the_config():
    for entry in O.OPTIMIZERS.values():
        assert set(entry.settings) <= set(C._OPTIMIZER_SETTING_CHECKS), entry.name


def test_lion_first_step_is_the_sign_of_the_gradient(tiny_config):
    params = _params()
    lr = 3e-4
    tx = O.get_optimizer("lion").build(_opt(tiny_config, "lion", weight_decay=0.0),
                                       optax.constant_schedule(lr), False)
    grads = jax.tree.map(lambda p: jnp.sin(3 * p) + 1e-3, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), strict=True):
        np.testing.assert_array_equal(np.asarray(u), -lr * np.sign(np.asarray(g)))


def test_muon_orthogonalises_hidden_matrices_only(tiny_config):
    params = _params()
    tx = O.get_optimizer("muon").build(_opt(tiny_config, "muon", weight_decay=0.0),
                                       optax.constant_schedule(1.0), False)
    grads = jax.tree.map(lambda p: jnp.cos(2 * p), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    s_hidden = np.linalg.svd(np.asarray(updates["layer_0"]["kernel"]), compute_uv=False)
    s_head = np.linalg.svd(np.asarray(updates["lm_head"]["kernel"]), compute_uv=False)
    # Newton–Schulz: singular values pulled together (≈ 0.7–1.2 of each other); AdamW's
    # elementwise step on the head leaves them spread
    assert s_hidden.max() / s_hidden.min() < 2.0 < s_head.max() / s_head.min()


@pytest.mark.parametrize("name", O.OPTIMIZER_NAMES)
def test_route_frame_optimizer_resolves_through_the_registry(tiny_config, name):
    config = tiny_config
    config.optimizer.name = name
    config.gift.route_frame = "optimizer"
    assert route_frame(config) == O.get_optimizer(name).route_frame


@pytest.mark.parametrize("overrides,match", [
    ({"optimizer.name": "sgd"},
     r"optimizer\.name=.sgd. is not supported; allowed: adamw, muon, lion$"),
    ({"optimizer.name": "lion", "optimizer.b1": "1.0"},
     r"optimizer\.b1=1\.0 must be a finite number in \[0, 1\)"),
    ({"optimizer.name": "lion", "comm.method": "plumage"},
     r"optimizer\.name='lion' cannot be combined with comm\.method='plumage'"),
    ({"optimizer.name": "muon", "optimizer.muon_scale_mode": "rms"},
     r"optimizer\.muon_scale_mode='rms' is not supported; allowed: spectral, shape"),
])
def test_bad_optimizer_settings_name_the_setting(tiny_config, overrides, match):
    config = C.apply_overrides(tiny_config, list(overrides.items()))
    with pytest.raises(C.ConfigError, match=match):
        C.validate_config(config, 8)
