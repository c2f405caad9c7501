"""gift_jax: faithful low-precision gradient communication for data-parallel JAX training.

Public API (the quantized all-reduce, the foundation of the GIFT and PLUMAGE stages):

* :func:`allreduce` — the Optax stage; :func:`quantized_psum`, :func:`quantized_reduce_scatter`,
  :func:`quantized_all_gather` — the same collectives as plain functions.
* :func:`get_codec`, :data:`CODEC_NAMES`, :func:`roundtrip` — wire formats.
* :func:`wire_bytes` — bytes per device of a compiled function's collectives, from its HLO.
"""

from gift_jax.codecs import CODEC_NAMES, Codec, get_codec, roundtrip
from gift_jax.collectives import (
    AllReduceSpec,
    quantized_all_gather,
    quantized_psum,
    quantized_reduce_scatter,
)
from gift_jax.comm_stage import (
    AllReduceState,
    allreduce,
    init_on_mesh,
    matrices_only,
    partition_specs,
)
from gift_jax.wire import WireReport, parse_hlo, wire_bytes

__version__ = "0.1.0"

__all__ = [
    "CODEC_NAMES",
    "AllReduceSpec",
    "AllReduceState",
    "Codec",
    "WireReport",
    "allreduce",
    "get_codec",
    "init_on_mesh",
    "matrices_only",
    "parse_hlo",
    "partition_specs",
    "quantized_all_gather",
    "quantized_psum",
    "quantized_reduce_scatter",
    "roundtrip",
    "wire_bytes",
]
