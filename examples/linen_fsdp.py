"""A Flax linen LM trainer written the public way, and its ports to FP8 and GIFT.

``linen_fsdp.py``: a decoder whose kernels are boxed in ``nn.Partitioned``
(``nn.with_partitioning``) and FSDP-sharded on the ``data`` axis with ``nn.get_sharding``,
activations constrained with ``nn.with_logical_constraint`` (the batch on ``data``), a
token-weighted loss (the sum of the per-token losses over the batch's real tokens: rows are
padded to random lengths), the optimizer in ``optax.MultiSteps``, a flax ``TrainState``
checkpointed with orbax. Random tokens stand in for text; 8 simulated CPU devices.

``linen_fsdp_fp8.py``: the same file with 6 lines changed (``diff`` them): the gradient comes
from ``gift_jax.data_parallel_grad``, FP8 across ``data``, each kernel's gradient
reduce-scattered into its FSDP shard; ``loss_weight`` keeps the loss the global token mean.

``linen_fsdp_gift.py``: 12 lines changed: GIFT whitens the MLP output kernels (split over
``data`` on their output dimension, so each device unwhitens its own shard), refreshed from
the linen capture every ``REFRESH`` steps; the communication state is a field of the
``TrainState``, so the orbax checkpoint saves it and a resume continues bit for bit.

Run: ``python examples/linen_fsdp.py``.
"""

import functools
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB, SEQ, EMBED, HEADS, FF, LAYERS, BATCH, PAD = 256, 32, 64, 4, 256, 2, 32, 0
ACCUMULATE = 2  # optax.MultiSteps' k
RULES = (("batch", "data"), ("seq", None), ("embed", None), ("mlp", None))  # activations


def dense(features, names, name):  # FSDP: the embedding dimension of every kernel on 'data'
    init = nn.with_partitioning(nn.initializers.xavier_uniform(), names)
    return nn.Dense(features, use_bias=False, kernel_init=init, name=name)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        qkv = dense(3 * EMBED, ("data", None), "qkv")(nn.LayerNorm(use_bias=False)(x))
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * HEADS, -1), 3, axis=2)
        att = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
        x = x + dense(EMBED, (None, "data"), "attn_out")(att.reshape(b, t, EMBED))
        x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
        h = nn.gelu(dense(FF, ("data", None), "mlp_in")(nn.LayerNorm(use_bias=False)(x)))
        h = nn.with_logical_constraint(h, ("batch", "seq", "mlp"))
        return x + dense(EMBED, (None, "data"), "mlp_out")(h)


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        init = nn.with_partitioning(nn.initializers.normal(0.02), (None, "data"))
        x = nn.Embed(VOCAB, EMBED, embedding_init=init)(tokens)
        x = x + nn.Embed(SEQ, EMBED, embedding_init=init)(jnp.arange(tokens.shape[1]))
        for i in range(LAYERS):
            x = Block(name=f"blocks_{i}")(x)
        return dense(VOCAB, ("data", None), "head")(nn.LayerNorm(use_bias=False)(x))


class TrainState(train_state.TrainState):
    pass


def real_tokens(batch):
    return jnp.sum(batch["targets"] != PAD)


def loss_fn(apply_fn, params, batch):
    """The batch's token mean: the sum of its per-token losses over its real tokens."""
    logits = apply_fn({"params": params}, batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    tokens = real_tokens(batch)
    loss = jnp.sum(jnp.where(batch["targets"] != PAD, losses, 0.0)) / jnp.maximum(tokens, 1)
    return loss, {"tokens": tokens}


@functools.cache
def build(seed=0):
    """The mesh, the jitted train step and the initial train state (built once per seed)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    model = LM()
    boxed = jax.eval_shape(model.init, jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))
    shardings = nn.get_sharding(boxed["params"], mesh)
    params = jax.jit(lambda k: model.init(k, jnp.zeros((1, SEQ), jnp.int32))["params"],
                     out_shardings=shardings)(jax.random.key(seed))
    tx = optax.MultiSteps(optax.adamw(3e-3), every_k_schedule=ACCUMULATE)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)(
            state.apply_fn, state.params, batch)
        return state.apply_gradients(grads=grads), {"loss": loss, **aux}

    return mesh, train_step, state


def batch_at(mesh, step, seed=0):
    """Step ``step``'s rows: random tokens, each row padded after a random length."""
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(seed), step))
    tokens = jax.random.randint(k1, (BATCH, SEQ + 1), 1, VOCAB)
    lengths = jax.random.randint(k2, (BATCH, 1), 2, SEQ + 2)
    tokens = jnp.where(jnp.arange(SEQ + 1) < lengths, tokens, PAD)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return jax.device_put(batch, NamedSharding(mesh, P("data")))


def train(steps=6, seed=0, state=None, ckpt=None):
    """Train ``steps`` steps (from ``state``, or a fresh one), saving to ``ckpt`` at the end;
    returns the state and each step's metrics."""
    mesh, train_step, fresh = build(seed)
    state = fresh if state is None else state
    history = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        for _ in range(steps):
            state, metrics = train_step(state, batch_at(mesh, int(state.step), seed))
            history.append(jax.device_get(metrics))
    if ckpt is not None:
        save(ckpt, state)
    return state, history


def save(path, state):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)


def restore(path, like, mesh):
    """The checkpoint at ``path`` in ``like``'s structure and shardings (replicated over the
    mesh where ``like`` holds a host value or a one-device array: the step, optax's counts)."""

    def target(x):
        x = jnp.asarray(x)
        sharding = x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, jax.tree.map(target, like))


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    _, history = train(steps=int(sys.argv[1]) if len(sys.argv) > 1 else 20)
    print("losses", [round(float(m["loss"]), 4) for m in history])
    print("tokens", [int(m["tokens"]) for m in history])
