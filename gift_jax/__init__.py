"""gift_jax: faithful low-precision gradient communication for data-parallel JAX training.

Public API (the quantized all-reduce, the foundation of the GIFT and PLUMAGE stages):

* :func:`allreduce` — the Optax stage; :func:`quantized_psum`, :func:`quantized_reduce_scatter`,
  :func:`quantized_all_gather` — the same collectives as plain functions.
* :func:`get_codec`, :data:`CODEC_NAMES`, :func:`roundtrip` — wire formats.
* :func:`wire_bytes` — bytes per device of a compiled function's collectives, from its HLO.
* :func:`gift` — GIFT: whiten selected layers' gradients with their input-side K-FAC factor
  around any all-reduce stage (:mod:`gift_jax.whitening`, :mod:`gift_jax.whitening.capture` for the
  statistics, :mod:`gift_jax.whitening.fidelity` for round-trip metrics).
* :func:`plumage` / :func:`scale_by_plumage` — PLUMAGE low-rank gradients with Adam moment
  realignment (GaLore and FLORA as projector strategies), :mod:`gift_jax.lowrank`.
* :mod:`gift_jax.models` — the Flax NNX Llama.

Importing the package limits OpenBLAS to one thread unless ``OPENBLAS_NUM_THREADS`` is set
(:mod:`gift_jax.utils.cpu_threads`: jaxlib's CPU decompositions otherwise oversubscribe the cores).
"""

from gift_jax.utils.cpu_threads import limit_openblas_threads

limit_openblas_threads()

# ruff: noqa: E402  (the limit must precede imports that may load OpenBLAS)

from gift_jax.comm.codecs import CODEC_NAMES, Codec, get_codec, roundtrip
from gift_jax.comm.collectives import (
    AllReduceSpec,
    local_roundtrip,
    quantized_all_gather,
    quantized_psum,
    quantized_reduce_scatter,
)
from gift_jax.comm.data_parallel import DataParallelGrad, data_parallel_grad, reduce_gradients
from gift_jax.comm.stage import (
    AllReduceState,
    AllReduceTransformation,
    LocalShards,
    allreduce,
    allreduce_axis,
    allreduce_spec,
    init_on_mesh,
    matrices_only,
    partition_specs,
    reframe_error_feedback,
    reset_error_feedback,
)
from gift_jax.comm.wire import WireReport, parse_hlo, wire_bytes
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
    scale_by_plumage,
    systematic_sample,
)
from gift_jax.lowrank import refresh_due as plumage_refresh_due
from gift_jax.whitening.capture import (
    install_capture,
    kfac_value_and_grad,
    remove_capture,
    with_input_stats,
)
from gift_jax.whitening.fidelity import fidelity_report
from gift_jax.whitening.stage import (
    GiftDimensionNumbers,
    GiftLeafState,
    GiftState,
    gift,
    select_layers,
)
from gift_jax.whitening.stage import refresh_due as gift_refresh_due

__version__ = "0.1.0"

__all__ = [
    "AdaptiveRefresh",
    "AllReduceSpec",
    "AllReduceState",
    "AllReduceTransformation",
    "CODEC_NAMES",
    "Codec",
    "DataParallelGrad",
    "GiftDimensionNumbers",
    "GiftLeafState",
    "GiftState",
    "LocalShards",
    "LowRankDimensionNumbers",
    "PlumageState",
    "WireReport",
    "allreduce",
    "allreduce_axis",
    "allreduce_spec",
    "data_parallel_grad",
    "expected_squared_error",
    "fidelity_report",
    "find_plumage_state",
    "get_codec",
    "gift",
    "gift_refresh_due",
    "inclusion_probabilities",
    "init_on_mesh",
    "install_capture",
    "kfac_value_and_grad",
    "local_roundtrip",
    "lowrank_estimate",
    "mask_excluding",
    "matrices_only",
    "parse_hlo",
    "partition_specs",
    "plumage",
    "plumage_projector",
    "plumage_refresh_due",
    "quantized_all_gather",
    "quantized_psum",
    "quantized_reduce_scatter",
    "reduce_gradients",
    "reframe_error_feedback",
    "remove_capture",
    "reset_error_feedback",
    "roundtrip",
    "scale_by_plumage",
    "select_layers",
    "systematic_sample",
    "wire_bytes",
    "with_input_stats",
]
