"""gift_jax: faithful low-precision gradient communication for data-parallel JAX training.

Public API (the quantized all-reduce, the foundation of the GIFT and PLUMAGE stages):

* :func:`allreduce` — the Optax stage; :func:`quantized_psum`, :func:`quantized_reduce_scatter`,
  :func:`quantized_all_gather` — the same collectives as plain functions.
* :func:`get_codec`, :data:`CODEC_NAMES`, :func:`roundtrip` — wire formats.
* :func:`wire_bytes` — bytes per device of a compiled function's collectives, from its HLO.
* :func:`plumage` / :func:`scale_by_plumage` — PLUMAGE low-rank gradients with Adam moment
  realignment (GaLore and FLORA as projector strategies), :mod:`gift_jax.lowrank`.
* :mod:`gift_jax.models` — the Flax NNX Llama.
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
from gift_jax.lowrank import (
    AdaptiveRefresh,
    LowRankDimensionNumbers,
    PlumageState,
    expected_squared_error,
    find_plumage_state,
    inclusion_probabilities,
    lowrank_estimate,
    mask_excluding,
    plumage,
    plumage_projector,
    refresh_due,
    scale_by_plumage,
    systematic_sample,
)
from gift_jax.wire import WireReport, parse_hlo, wire_bytes

__version__ = "0.1.0"

__all__ = [
    "AdaptiveRefresh",
    "AllReduceSpec",
    "AllReduceState",
    "CODEC_NAMES",
    "Codec",
    "LowRankDimensionNumbers",
    "PlumageState",
    "WireReport",
    "allreduce",
    "expected_squared_error",
    "find_plumage_state",
    "get_codec",
    "inclusion_probabilities",
    "init_on_mesh",
    "lowrank_estimate",
    "mask_excluding",
    "matrices_only",
    "parse_hlo",
    "partition_specs",
    "plumage",
    "plumage_projector",
    "quantized_all_gather",
    "quantized_psum",
    "quantized_reduce_scatter",
    "refresh_due",
    "roundtrip",
    "scale_by_plumage",
    "systematic_sample",
    "wire_bytes",
]
