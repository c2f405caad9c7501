"""Experiments of the GIFT paper (arXiv 2607.07494) on real gradients of a small Llama.

* :mod:`gift_jax.apps.experiments.roundtrip` — train a model briefly, take per-replica gradients and
  layer-input statistics (R simulated data-parallel replicas on one device), simulate the
  quantized all-reduce (fp32 or FP8 ring accumulation, error feedback) and measure the round
  trip of every whitening frame (Tables I/II), plus the factor-staleness ablation.
* :mod:`gift_jax.apps.experiments.profile` — per-layer vulnerability profile (saturation, underflow,
  round-trip error under the artifact's stale synced scales), top-n layer selection and its
  stability across checkpoints; and the step-cost benchmark of the GIFT stage.

Scripts: ``scripts/roundtrip.py``, ``scripts/profile_layers.py``, ``scripts/bench_gift.py``.
"""
