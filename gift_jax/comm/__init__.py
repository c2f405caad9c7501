"""The communication core: one data-parallel gradient reduction, from floats to wire bytes.

``codecs`` (wire formats and their element math) → ``buckets`` (static packing of a pytree
into row buffers) → ``kernels`` (Pallas quantize / dequantize-accumulate and the backend
choice) → ``collectives`` (quantized reduce-scatter, all-gather, all-reduce) → ``stage``
(``allreduce``, the Optax stage) ; ``wire`` reads the bytes each collective sends from
compiled HLO.
"""
