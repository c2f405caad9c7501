"""miniGPT trained GSPMD style, and its port to the FP8 + GIFT gradient reduction.

``minigpt_gspmd.py``: one ``jax.jit`` with ``NamedSharding`` s, the kernels split over the
``model`` axis (``nnx.with_partitioning``), the batch over ``data``, the gradient reduction
left to XLA. Written fresh after the shape of the jax-ai-stack miniGPT tutorial (a Flax NNX
decoder on a ``(data, model)`` mesh); random tokens stand in for text.

``minigpt_gspmd_gift.py``: the same file with 10 lines changed (``diff`` them): the gradient
comes from ``gift_jax.data_parallel_grad``, an FP8 reduce-scatter + all-gather across ``data``
of each device's own shard, with the MLP ``down`` kernels whitened by GIFT (refreshed every
step here, for brevity) and GIFT's state carried in the train state.

Run: ``python examples/minigpt_gspmd.py`` (8 simulated CPU devices).
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gift_jax

VOCAB, SEQ, EMBED, HEADS, FF, LAYERS, BATCH = 256, 32, 64, 4, 128, 2, 32
MESH = (4, 2)  # (data, model)
COMM, GIFT = "fp8_e4m3", lambda ar: gift_jax.gift(ar, ["*/down"], rank=8, axis_name="data")


def dense(n_in, n_out, spec, rngs):
    init = nnx.with_partitioning(nnx.initializers.xavier_uniform(), spec)
    return nnx.Linear(n_in, n_out, kernel_init=init, use_bias=False, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(EMBED, rngs=rngs), nnx.LayerNorm(EMBED, rngs=rngs)
        self.qkv = dense(EMBED, 3 * EMBED, (None, "model"), rngs)
        self.proj = dense(EMBED, EMBED, ("model", None), rngs)
        self.up = dense(EMBED, FF, (None, "model"), rngs)
        self.down = dense(FF, EMBED, ("model", None), rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * HEADS, -1), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.proj(att.reshape(b, t, EMBED))
        return x + self.down(nnx.relu(self.up(self.norm2(x))))


class MiniGPT(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.pos = nnx.Embed(SEQ, EMBED, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(EMBED, rngs=rngs)
        self.head = dense(EMBED, VOCAB, (None, "model"), rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(seed=0):
    """The mesh, the jitted train step and the initial train state."""
    mesh = jax.make_mesh(MESH, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(MiniGPT(nnx.Rngs(seed)), nnx.Param)
    specs = nnx.get_partition_spec(params)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    tx = optax.adamw(1e-3)

    def model_loss(model, tokens):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def loss_fn(p, tokens):
        return gift_jax.with_input_stats(model_loss, ["*/down"])(nnx.merge(graphdef, p), tokens)

    grad_fn = gift_jax.data_parallel_grad(loss_fn, mesh, comm=COMM, param_specs=specs, wrap=GIFT,
        has_aux=True, aux_reduce="mean", stage_args=lambda stats: {"gift_stats": stats})
    state = {"params": params, "opt": tx.init(params), "comm": grad_fn.init(params)}

    @jax.jit
    def train_step(state, tokens):
        loss, grads, comm, _ = grad_fn(state["params"], tokens, state["comm"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return dict(state, params=params, opt=opt, comm=comm), loss

    return mesh, train_step, state


def batches(mesh, steps, seed=0):
    key = jax.random.key(seed)
    for _ in range(steps):
        key, sub = jax.random.split(key)
        tokens = jax.random.randint(sub, (BATCH, SEQ + 1), 0, VOCAB)
        yield jax.device_put(tokens, NamedSharding(mesh, P("data")))


def train(steps=5, seed=0):
    mesh, train_step, state = build(seed)
    losses = []
    for tokens in batches(mesh, steps, seed):
        state, loss = train_step(state, tokens)
        losses.append(float(loss))
    return state["params"], losses


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    print("losses", train(steps=20)[1])
