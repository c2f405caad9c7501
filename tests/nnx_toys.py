"""Small Flax NNX models shared by the capture tests: a list of residual MLP blocks and the
same blocks stacked with ``nnx.vmap`` and applied with ``nnx.scan``."""

import jax
from flax import nnx

DM, DF, NL = 8, 24, 3  # d_model, d_ff (the only 24: its 24×24 dot is the statistic), layers


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up_proj = nnx.Linear(DM, DF, rngs=rngs)
        self.down_proj = nnx.Linear(DF, DM, rngs=rngs)

    def hidden(self, x):
        return jax.nn.relu(self.up_proj(x))

    def __call__(self, x):
        return self.down_proj(self.hidden(x))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.mlp = MLP(rngs)

    def __call__(self, x):
        return x + self.mlp(x)


class ListModel(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([Block(rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ScanModel(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=NL)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x)

        return body(x, self.layers)
