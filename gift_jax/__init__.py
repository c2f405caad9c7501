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

import importlib

from gift_jax.utils.cpu_threads import limit_openblas_threads

limit_openblas_threads()

#: Every public name of the package: ``name -> (module, attribute)``, imported on first use
#: (PEP 562), so that ``import gift_jax.data`` (what the data pipeline's worker processes
#: load) does not import JAX, Optax and Flax.
_EXPORTS: dict[str, tuple[str, str]] = {
    "CODEC_NAMES": ("gift_jax.comm.codecs", "CODEC_NAMES"),
    "Codec": ("gift_jax.comm.codecs", "Codec"),
    "get_codec": ("gift_jax.comm.codecs", "get_codec"),
    "roundtrip": ("gift_jax.comm.codecs", "roundtrip"),
    "AllReduceSpec": ("gift_jax.comm.collectives", "AllReduceSpec"),
    "local_roundtrip": ("gift_jax.comm.collectives", "local_roundtrip"),
    "quantized_all_gather": ("gift_jax.comm.collectives", "quantized_all_gather"),
    "quantized_psum": ("gift_jax.comm.collectives", "quantized_psum"),
    "quantized_reduce_scatter": ("gift_jax.comm.collectives", "quantized_reduce_scatter"),
    "DataParallelGrad": ("gift_jax.comm.data_parallel", "DataParallelGrad"),
    "data_parallel_grad": ("gift_jax.comm.data_parallel", "data_parallel_grad"),
    "reduce_gradients": ("gift_jax.comm.data_parallel", "reduce_gradients"),
    "AllReduceState": ("gift_jax.comm.stage", "AllReduceState"),
    "AllReduceTransformation": ("gift_jax.comm.stage", "AllReduceTransformation"),
    "LocalShards": ("gift_jax.comm.stage", "LocalShards"),
    "allreduce": ("gift_jax.comm.stage", "allreduce"),
    "allreduce_axis": ("gift_jax.comm.stage", "allreduce_axis"),
    "allreduce_spec": ("gift_jax.comm.stage", "allreduce_spec"),
    "init_on_mesh": ("gift_jax.comm.stage", "init_on_mesh"),
    "matrices_only": ("gift_jax.comm.stage", "matrices_only"),
    "partition_specs": ("gift_jax.comm.stage", "partition_specs"),
    "reframe_error_feedback": ("gift_jax.comm.stage", "reframe_error_feedback"),
    "reset_error_feedback": ("gift_jax.comm.stage", "reset_error_feedback"),
    "WireReport": ("gift_jax.comm.wire", "WireReport"),
    "parse_hlo": ("gift_jax.comm.wire", "parse_hlo"),
    "wire_bytes": ("gift_jax.comm.wire", "wire_bytes"),
    "AdaptiveRefresh": ("gift_jax.lowrank", "AdaptiveRefresh"),
    "LowRankDimensionNumbers": ("gift_jax.lowrank", "LowRankDimensionNumbers"),
    "PlumageState": ("gift_jax.lowrank", "PlumageState"),
    "expected_squared_error": ("gift_jax.lowrank", "expected_squared_error"),
    "find_plumage_state": ("gift_jax.lowrank", "find_plumage_state"),
    "inclusion_probabilities": ("gift_jax.lowrank", "inclusion_probabilities"),
    "lowrank_estimate": ("gift_jax.lowrank", "lowrank_estimate"),
    "mask_excluding": ("gift_jax.lowrank", "mask_excluding"),
    "plumage": ("gift_jax.lowrank", "plumage"),
    "plumage_projector": ("gift_jax.lowrank", "plumage_projector"),
    "scale_by_plumage": ("gift_jax.lowrank", "scale_by_plumage"),
    "systematic_sample": ("gift_jax.lowrank", "systematic_sample"),
    "plumage_refresh_due": ("gift_jax.lowrank", "refresh_due"),
    "install_capture": ("gift_jax.whitening.capture", "install_capture"),
    "kfac_value_and_grad": ("gift_jax.whitening.capture", "kfac_value_and_grad"),
    "remove_capture": ("gift_jax.whitening.capture", "remove_capture"),
    "with_input_stats": ("gift_jax.whitening.capture", "with_input_stats"),
    "fidelity_report": ("gift_jax.whitening.fidelity", "fidelity_report"),
    "GiftDimensionNumbers": ("gift_jax.whitening.stage", "GiftDimensionNumbers"),
    "GiftLeafState": ("gift_jax.whitening.stage", "GiftLeafState"),
    "GiftState": ("gift_jax.whitening.stage", "GiftState"),
    "gift": ("gift_jax.whitening.stage", "gift"),
    "select_layers": ("gift_jax.whitening.stage", "select_layers"),
    "gift_refresh_due": ("gift_jax.whitening.stage", "refresh_due"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The public name ``name``, imported from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gift_jax' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"
