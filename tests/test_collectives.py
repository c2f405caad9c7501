"""The quantized all-reduce on 8 simulated CPU devices: accuracy bounds against an fp32
psum, bit-identity across replicas, HLO wire bytes, odd shapes, zeros, NaN, settings."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codegen import DEFAULT_CODEGEN
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax as gj
from gift_jax.comm import codecs as C

N = 8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def per_device(mesh, fn, tree, axes="data", check_vma=True):
    """Run ``fn`` on per-device slices (leading axis N) and return stacked per-device outputs."""

    def body(t):
        out = fn(jax.tree.map(lambda x: x[0], t))
        return jax.tree.map(lambda x: x[None], out)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                              check_vma=check_vma))
    placed = jax.device_put(tree, NamedSharding(mesh, P(axes)))
    return (lambda *a: jax.tree.map(np.asarray, f(*a))), placed


def local_grads(seed=0):
    """Per-device gradients with mixed shapes, scales and dtypes (leading axis = device)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    return {
        "w": jax.random.normal(ks[0], (N, 96, 40)) * 0.02,
        "attn": jax.random.normal(ks[1], (N, 33, 3, 7)) * 3.0,  # odd sizes
        "gain": jax.random.normal(ks[2], (N, 17)) * 1e-4,
        "scalar": jax.random.normal(ks[3], (N,)),
        "zero": jnp.zeros((N, 9, 2)),
        "half": (jax.random.normal(ks[4], (N, 64)) * 5).astype(jnp.bfloat16),
    }


def _identical_across_replicas(tree):
    for leaf in jax.tree.leaves(tree):
        a = leaf.astype(np.float32).view(np.uint32)
        np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))


CODECS = [(c.name, c.block_size if c.supports_block_scaling else None)
          for c in C.codec_variants(64)]


def test_fp32_codec_is_psum_bit_for_bit(mesh):
    grads = local_grads()
    f, g = per_device(mesh, lambda t: (gj.quantized_psum(t, "data", codec="fp32"),
                                       jax.lax.psum(t, "data")), grads)
    ours, ref = f(g)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("name,block", CODECS)
def test_allreduce_error_bound_and_replica_identity(mesh, name, block):
    codec = C.get_codec(name, block)
    grads = local_grads()
    f, g = per_device(mesh, lambda t: gj.quantized_psum(t, "data", codec=name,
                                                        block_size=block), grads)
    out = f(g)
    _identical_across_replicas(out)
    assert out["half"].dtype == jnp.bfloat16 and out["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["zero"]), 0.0)  # zeros stay exact zeros
    # Each element passes two roundings (local quantization, re-quantization of the sum).
    # Per element: |err| ≤ u(Σ_p|x_p| + |S|)(1+u) + saturation-free scaled-subnormal slack;
    # checked in norm for the fp8 formats whose grid is relative, and e2m1 (u = 1/4).
    u = 2.0 ** -(codec.mantissa_bits + 1)
    for k in ("w", "attn", "gain", "scalar"):
        x = np.asarray(grads[k], np.float64)
        exact = x.sum(0)
        err = np.asarray(out[k][0], np.float64) - exact
        budget = u * (np.abs(x).sum(0) + np.abs(exact)) * (1 + u)
        # subnormal / block-scale slack: half the smallest spacing of each scaled group
        slack = 2.0 ** (codec.min_exponent - codec.mantissa_bits) * np.abs(x).max() * N / (
            codec.fmax if name != "bf16" else np.inf)
        if name == "nvfp4":  # the e4m3 block scale itself is rounded: one more relative ulp
            budget *= 2
        if codec.is_integer:  # an absolute grid: half a step of each scale (a block's amax
            # is at most its leaf's), locally and for the re-quantized sum
            budget = (np.abs(x).max(axis=tuple(range(1, x.ndim))).sum()
                      + np.abs(exact).max()) / (2 * codec.fmax) * (1 + 1e-3)
        assert np.all(np.abs(err) <= budget + slack + 1e-30), (k, np.abs(err).max())
        rel = np.linalg.norm(err) / np.linalg.norm(np.abs(x).sum(0))  # cancellation-proof
        assert rel < {"bf16": 5e-3, "nvfp4": 0.25}.get(name, 0.1), (k, rel)


def test_mean_is_sum_over_replicas(mesh):
    grads = local_grads()
    f, g = per_device(mesh, lambda t: (gj.quantized_psum(t, "data", mean=True),
                                       gj.quantized_psum(t, "data", mean=False)), grads)
    mean, total = f(g)
    # the mean is formed in fp32 before re-quantization: mean ≈ sum / N within fp8 precision
    np.testing.assert_allclose(np.asarray(mean["w"]) * N, np.asarray(total["w"]),
                               rtol=0.07, atol=1e-3)


def test_nan_in_one_replica_poisons_its_leaf_identically_everywhere(mesh):
    grads = local_grads()
    grads["w"] = grads["w"].at[3, 5, 7].set(jnp.nan)
    grads["attn"] = grads["attn"].at[6, 0, 0, 0].set(jnp.inf)
    f, g = per_device(mesh, lambda t: gj.quantized_psum(t, "data", mean=True), grads)
    out = f(g)
    assert np.isnan(np.asarray(out["w"])).all()  # never finite garbage
    assert np.isnan(np.asarray(out["attn"])).all()
    assert np.isfinite(np.asarray(out["gain"])).all()  # other leaves are unaffected
    _identical_across_replicas({"gain": out["gain"], "scalar": out["scalar"]})


def test_block_scaled_nan_stays_in_its_block(mesh):
    grads = {"w": jax.random.normal(jax.random.key(1), (N, 4096))}
    grads["w"] = grads["w"].at[2, 100].set(jnp.nan)
    f, g = per_device(mesh, lambda t: gj.quantized_psum(t, "data", codec="mxfp8"), grads)
    out = np.asarray(f(g)["w"])
    assert np.isnan(out[:, 100]).all()  # on every replica
    assert np.isfinite(np.delete(out, np.s_[96:128], axis=1)).all()  # other blocks intact
    grads["w"] = grads["w"].at[2, 100].set(jnp.inf)  # an Inf poisons its whole block
    out = np.asarray(f(jax.device_put(grads, g["w"].sharding))["w"])
    assert np.isnan(out[:, 96:128]).all()
    assert np.isfinite(np.delete(out, np.s_[96:128], axis=1)).all()


def test_reduce_scatter_and_all_gather(mesh):
    x = jax.random.normal(jax.random.key(3), (N, 1000))

    def fn(v):
        shard = gj.quantized_reduce_scatter(v, "data", codec="fp8_e4m3")
        return shard, gj.quantized_all_gather(v[:77], "data", codec="fp8_e4m3", block_size=32)

    f, g = per_device(mesh, fn, x)
    shards, gathered = f(g)
    total = np.asarray(x).sum(0)
    flat = np.asarray(shards).reshape(-1)[:1000]
    assert np.linalg.norm(flat - total) / np.linalg.norm(total) < 0.05
    _identical_across_replicas(gathered)
    want = np.asarray(x)[:, :77].reshape(-1)
    assert gathered.shape == (N, N * 77)
    assert np.linalg.norm(np.asarray(gathered[0]) - want) / np.linalg.norm(want) < 0.05


def test_policy_by_callable_and_by_pytree(mesh):
    grads = local_grads()
    policy = gj.matrices_only("fp8_e4m3", other="fp32")
    tree_policy = jax.tree.map(lambda x: "fp8_e4m3" if x.ndim >= 3 else "fp32", grads)

    def fn(t):
        return (gj.quantized_psum(t, "data", policy=policy),
                gj.quantized_psum(t, "data", policy=tree_policy),
                jax.lax.psum(t, "data"))

    f, g = per_device(mesh, fn, grads)
    by_fn, by_tree, exact = f(g)
    for out in (by_fn, by_tree):
        for k in ("gain", "scalar"):  # vectors and scalars stayed in fp32: exact psum
            np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(exact[k]))
        assert not np.array_equal(np.asarray(out["w"]), np.asarray(exact["w"]))


@pytest.mark.parametrize("name,block,accumulate", [
    ("fp8_e4m3", None, "fp32"), ("fp8_e5m2", None, "fp8"), ("fp8_e4m3", 32, "fp32"),
    ("nvfp4", None, "fp32")])
def test_stacked_leaf_is_quantized_like_its_tensors_unstacked(mesh, name, block, accumulate):
    """``stack_axes``: a ``(layers, in, out)`` leaf whose layers differ in magnitude by 10⁵
    reduces bit for bit like its layers as separate leaves (each on its own scales). With one
    fp8_e4m3 scale per tensor the small layer keeps its precision, where one scale for the
    whole stack flushes it to subnormals."""
    ks = jax.random.split(jax.random.key(7), 3)
    big = jax.random.normal(ks[0], (N, 64, 8))
    small = jax.random.normal(ks[1], (N, 64, 8)) * 1e-5
    bias = jax.random.normal(ks[2], (N, 5))
    stacked = {"bias": bias, "layers": jnp.stack([big, small], axis=1)}
    apart = {"bias": bias, "layers": {"0": big, "1": small}}
    kw = dict(codec=name, block_size=block, accumulate=accumulate,
              global_scale=accumulate == "fp8")
    by_layer = lambda path, leaf: 1 if len(leaf.shape) == 3 else 0

    def fn(t):
        return (gj.quantized_psum(t[0], "data", stack_axes=by_layer, **kw),
                gj.quantized_psum(t[0], "data", **kw),
                gj.quantized_psum(t[1], "data", **kw))

    f, g = per_device(mesh, fn, (stacked, apart))
    per_layer, one_scale, separate = f(g)
    np.testing.assert_array_equal(per_layer["layers"][:, 0], separate["layers"]["0"])
    np.testing.assert_array_equal(per_layer["layers"][:, 1], separate["layers"]["1"])
    np.testing.assert_array_equal(per_layer["bias"], separate["bias"])
    if name == "fp8_e4m3" and block is None:
        exact = np.asarray(small, np.float64).sum(0)
        err = lambda x: np.linalg.norm(x[0] - exact) / np.linalg.norm(exact)
        assert err(per_layer["layers"][:, 1]) < 0.05 < 0.3 < err(one_scale["layers"][:, 1])


def test_hierarchical_two_axes():
    mesh2 = jax.make_mesh((2, 4), ("node", "local"))
    grads = local_grads()
    fn = lambda t: gj.quantized_psum(t, "node", intra_axis="local", codec="fp8_e4m3", mean=True)
    f, g = per_device(mesh2, fn, grads, axes=("node", "local"))
    out = f(g)
    _identical_across_replicas(out)
    exact = np.asarray(grads["w"]).mean(0)
    assert np.linalg.norm(np.asarray(out["w"][0]) - exact) / np.linalg.norm(exact) < 0.05
    # a tuple of axes reduces over both as one group
    f2, g2 = per_device(mesh2, lambda t: gj.quantized_psum(t, ("node", "local"), mean=True),
                        grads, axes=("node", "local"))
    out2 = f2(g2)
    _identical_across_replicas(out2)
    assert np.linalg.norm(np.asarray(out2["w"][0]) - exact) / np.linalg.norm(exact) < 0.05


def test_pallas_backend_collective_equals_xla(mesh):
    grads = {"w": jax.random.normal(jax.random.key(4), (N, 300)),
             "b": jax.random.normal(jax.random.key(5), (N, 7))}
    for name, block in [("fp8_e4m3", None), ("mxfp8", None)]:
        outs = []
        for backend in ("xla", "pallas"):
            # Pallas' interpreter trips over varying-axis checks (jax asks for
            # check_vma=False); trainers use check_vma=False anyway for per-device grads
            f, g = per_device(mesh, lambda t, b=backend, c=name, k=block: gj.quantized_psum(
                t, "data", codec=c, block_size=k, backend=b), grads, check_vma=False)
            outs.append(f(g))
        # Same bytes on the wire; the fp32 sums may differ in the last bit because XLA may
        # contract "decode × scale + partial sum" into an FMA in one fusion and not in the
        # other (each backend is bit-identical across replicas, tested above).
        for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
            np.testing.assert_allclose(a, b, rtol=4 * 2.0**-23 * N, atol=0)


def test_stochastic_rounding_is_unbiased_across_steps(mesh):
    x = jnp.full((N, 256), 0.3, jnp.float32) * (1 + jnp.arange(N)[:, None] / 7)
    x = x.at[:, 0].set(2.0)  # the amax: 0.3… is then not at the format maximum
    exact = float(np.asarray(x).sum(0)[1])

    def fn(v):
        keys = jax.random.split(jax.random.key(0), 64)
        outs = jax.lax.map(lambda k: gj.quantized_psum(v, "data", codec="fp8_e5m2", key=k), keys)
        return outs.mean(0), gj.quantized_psum(v, "data", codec="fp8_e5m2")

    f, g = per_device(mesh, fn, x)
    sr_mean, rtn = f(g)
    sr_err = abs(float(np.asarray(sr_mean)[:, 1:].mean()) - exact)
    rtn_err = abs(float(np.asarray(rtn)[:, 1:].mean()) - exact)
    assert sr_err < rtn_err / 4, (sr_err, rtn_err)


def test_fp8_accumulation_emulation_is_worse_than_fp32_accumulation(mesh):
    grads = {"w": jax.random.normal(jax.random.key(6), (N, 2048))}

    def fn(t):
        return (gj.quantized_psum(t, "data", global_scale=True, accumulate="fp8"),
                gj.quantized_psum(t, "data", global_scale=True))

    f, g = per_device(mesh, fn, grads)
    fp8_acc, fp32_acc = f(g)
    _identical_across_replicas(fp8_acc)
    exact = np.asarray(grads["w"]).sum(0)
    e8 = np.linalg.norm(np.asarray(fp8_acc["w"][0]) - exact)
    e32 = np.linalg.norm(np.asarray(fp32_acc["w"][0]) - exact)
    assert e8 > 1.5 * e32


def test_unbound_axis_and_bad_leaves():
    with pytest.raises(ValueError, match="axis_name='data' is not bound"):
        jax.jit(lambda x: gj.quantized_psum(x, "data"))(jnp.ones(3))
    mesh = jax.make_mesh((N,), ("data",))
    f, g = per_device(mesh, lambda t: gj.quantized_psum(t, "data"), {"i": jnp.ones((N, 3),
                                                                                 jnp.int32)})
    with pytest.raises(TypeError, match=r"\['i'\] has dtype int32"):
        f(g)
    with pytest.raises(ValueError, match="accumulate='fp16'"):
        gj.AllReduceSpec("data", accumulate="fp16")
    with pytest.raises(ValueError, match="needs global_scale"):
        gj.AllReduceSpec("data", accumulate="fp8")
    with pytest.raises(ValueError, match="per-tensor codec"):
        gj.AllReduceSpec("data", codec="mxfp8", accumulate="fp8", global_scale=True)


def test_axis_none_is_identity():
    tree = {"a": jnp.arange(5.0)}
    out = jax.jit(lambda t: gj.quantized_psum(t, None))(tree)
    np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(5.0))


def test_permute_exchanges_equal_all_to_all_and_all_gather(mesh):
    """The outer axis of the hierarchical reduction moves its bytes by shifted ppermutes
    (what a multi-slice TPU job sends as is); they are the all_to_all and all_gather."""
    from gift_jax.comm.collectives import exchange_chunks, gather_chunks

    x = jax.random.randint(jax.random.key(7), (N, N, 5), 0, 256).astype(jnp.uint8)

    def body(chunks):
        chunks = chunks[0]
        return jnp.stack([exchange_chunks(chunks, "data", True),
                          exchange_chunks(chunks, "data", False),
                          gather_chunks(chunks[0], "data", True),
                          gather_chunks(chunks[0], "data", False)])[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = np.asarray(f(x))
    np.testing.assert_array_equal(out[:, 0], out[:, 1])
    np.testing.assert_array_equal(out[:, 2], out[:, 3])
    np.testing.assert_array_equal(out[3, 1, 5], np.asarray(x)[5, 3])  # row i from replica i
    np.testing.assert_array_equal(out[3, 3, 5], np.asarray(x)[5, 0])
    hlo = f.lower(x).as_text()
    assert "collective_permute" in hlo or "collective-permute" in hlo


def _stage_steps(mesh, tx, grads, steps=3):
    """``tx`` (a :func:`gift_jax.allreduce` stage) over ``steps`` steps of per-device
    ``grads`` scaled by ``1 + step`` (on the host: in the program, XLA may keep a bf16
    product in excess precision in one fusion and not in another), compiled at XLA's default
    code generation; the per-device outputs and the final state of every device."""
    per_step = jax.tree.map(lambda x: jnp.stack([
        (np.asarray(x, np.float32) * (1 + t)).astype(x.dtype) for t in range(steps)]), grads)

    def body(g, st):
        outs = []
        for t in range(steps):
            out, st = tx.update(jax.tree.map(lambda x, t=t: x[t, 0], g), st)
            outs.append(out)
        return (jax.tree.map(lambda *x: jnp.stack(x)[None], *outs),
                jax.tree.map(lambda x: jnp.asarray(x)[None], st))

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                 check_vma=False))
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "data"), P()),
                                out_specs=(P("data"), P("data")), check_vma=False))
    placed = jax.device_put(per_step, NamedSharding(mesh, P(None, "data")))
    state = init(jax.tree.map(lambda x: x[0], grads))
    # compared across programs bit for bit: XLA's default code generation (tests/codegen.py)
    return jax.device_get(run.lower(placed, state).compile(DEFAULT_CODEGEN)(placed, state))


@pytest.mark.parametrize("codec,settings", [
    ("fp8_e4m3", dict(error_feedback=True)),
    ("fp8_e5m2", dict(global_scale=True, accumulate="fp8")),
    ("int8", dict(scale_sync_every=2)),
    ("fp8_e4m3", dict(exchange="permute", bucket_elems=3000)),
])
def test_bytes_packing_is_the_float_packing_bit_for_bit(mesh, codec, settings):
    """``pack="bytes"`` (each tensor scaled and cast where it lies, only its bytes packed, the
    gathered bytes decoded where each tensor lies) reduces to the same bits as packing the
    float32 gradients into rows first — outputs, error-feedback buffers, held scales and
    saturation — on odd shapes, a stacked leaf, bf16, zeros and buckets whose tensors span
    several owners; and the float gradients are never concatenated into a bucket."""
    grads = {**local_grads(), "stack": jax.random.normal(jax.random.key(9), (N, 3, 40, 24))
             * jnp.asarray([1.0, 1e-4, 30.0])[None, :, None, None]}
    by_layer = lambda path, leaf: 1 if leaf.ndim == 3 and leaf.shape[0] == 3 else 0
    runs = [_stage_steps(mesh, gj.allreduce("data", codec, pack=pack, stack_axes=by_layer,
                                            **settings), grads)
            for pack in ("bytes", "floats")]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1]), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    exact = np.asarray(grads["w"]).mean(0)
    assert np.linalg.norm(runs[0][0]["w"][0, 0] - exact) < 0.4 * np.linalg.norm(exact)  # a mean

    def float_packing(pack):
        """The concatenations of float32 arrays into something of a bucket's size."""
        text = jax.jit(jax.shard_map(
            lambda t: gj.quantized_psum(t, "data", codec=codec, pack=pack), mesh=mesh,
            in_specs=P("data"), out_specs=P("data"))).lower(
                jax.device_put(grads, NamedSharding(mesh, P("data")))).as_text()
        out = re.compile(r"-> tensor<(?P<n>\d+)xf32>")
        return [l for l in text.splitlines() if "concatenate" in l
                and (m := out.search(l)) and int(m["n"]) >= 128]

    assert float_packing("floats") and not float_packing("bytes")


def test_pack_setting_is_validated():
    from trainer_kit import recipe_of, small_config

    from gift_jax.training import ConfigError

    with pytest.raises(ValueError, match="pack=.rows. is not supported; allowed: bytes, floats"):
        gj.allreduce("data", "fp8_e4m3", pack="rows")
    with pytest.raises(ConfigError, match="comm.pack"):
        recipe_of(small_config("fp8", **{"comm.pack": "rows"}))
    assert recipe_of(small_config("fp8", **{"comm.pack": "floats"})).comm.pack == "floats"
