"""The compiled train step (:mod:`gift_jax.training.step`): exactly one gradient all-reduce in
the HLO whatever the accumulation, error feedback or GIFT, and a non-finite update skipped on
every replica alike."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from trainer_kit import (
    FAST,
    SMOKE,
    assert_trees_equal,
    recipe_of,
    small_config,
)

import gift_jax as gj
from gift_jax.comm.codecs import get_codec
from gift_jax.training import (
    build_optimizer,
    complete_config,
    make_mesh,
)
from gift_jax.training.program import program_for

pytestmark = pytest.mark.slow  # end-to-end: `pytest -m "not slow"` skips it


def _grad_bytes_min(params):
    return min(4 * x.size for x in jax.tree.leaves(params) if x.ndim == 2)


@pytest.mark.parametrize("name", ["fp32_accum", "fp8_block_sr_ef", "gift_fp8_ef"])
def test_no_extra_gradient_allreduce_in_hlo(name):
    """The only gradient-sized reduction is the stage's: none in f32 for fp8 modes, exactly
    one gradient's worth of f32 all-reduce for fp32."""
    mode, optimizer, overrides = SMOKE[name]
    config = complete_config(small_config(mode, optimizer, **overrides))
    exact = get_codec(config.comm.codec).is_exact  # fp32: a plain psum of the gradients
    program = program_for(config, make_mesh(), FAST)
    params = jax.eval_shape(program.init_params)
    param_bytes = sum(4 * x.size for x in jax.tree.leaves(params))
    for variant in program.step.variants():
        report = program.step.wire_report(variant)
        f32_ar = [op for op in report.ops if op.kind == "all-reduce" and "f32" in op.dtypes]
        big = [op for op in f32_ar if op.buffer_bytes >= _grad_bytes_min(params)]
        if exact:
            # the loss's pmean may be fused into the same all-reduce (a few bytes)
            assert 0 <= sum(op.buffer_bytes for op in big) - param_bytes <= 64, report.table()
        elif not variant:
            assert not big, report.table()
        else:  # GIFT refresh: statistics are averaged in fp32 (d_ff × d_ff per layer), no grads
            stats = 4 * 64 * 64 + 64  # one down_proj input statistic (d_ff × d_ff)
            assert sum(op.buffer_bytes for op in big) <= stats, report.table()
        if not exact:
            assert report.total < 0.5 * 2 * 7 / 8 * param_bytes, report.table()


def optax_apply(params, updates):
    return jax.tree.map(lambda p, u: p + u, params, updates)


def test_nonfinite_gradient_skips_the_step_on_every_replica():
    config = complete_config(small_config("fp8", "adamw", **SMOKE["fp8_block_sr_ef"][2]))
    mesh = make_mesh()
    tx = build_optimizer(recipe_of(config), ("data",)).tx
    params = {"w": jnp.ones((8, 16)), "b": jnp.zeros((16,))}
    grads = {"w": jnp.ones((8, 8, 16)).at[3, 0, 0].set(jnp.inf), "b": jnp.ones((8, 16))}
    state = gj.init_on_mesh(tx, params, mesh)
    specs = gj.partition_specs(state, "data")

    def body(p, s, g):
        u, s2 = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax_apply(p, u), s2

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs), check_vma=False))
    shard = jax.sharding.NamedSharding(mesh, P("data"))
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
    new_params, new_state = step(params, state, jax.device_put(grads, shard))
    assert int(new_state.skipped) == 1 and bool(new_state.last_skipped)
    assert_trees_equal(new_params, params)
    assert_trees_equal(new_state.inner, state.inner)  # moments, EF buffers, keys untouched
    grads = {"w": jnp.ones((8, 8, 16)), "b": jnp.ones((8, 16))}
    new_params, new_state = step(params, state, jax.device_put(grads, shard))
    assert int(new_state.skipped) == 0 and np.all(np.isfinite(np.asarray(new_params["w"])))
    changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(new_state.inner), jax.tree.leaves(state.inner), strict=True)]
    assert any(changed)  # a finite step advances the state (lr is 0 at step 0 of warmup)
