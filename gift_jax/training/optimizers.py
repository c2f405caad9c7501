"""The optimizer registry: every ``optimizer.name`` a run can take, each one entry.

An entry knows how to build its dense update rule from the config's ``optimizer`` group and a
learning-rate schedule, which settings of that group it reads (checked before the run starts),
which frame GIFT's router should measure its errors in (``gift.route_frame='optimizer'``), and
whether PLUMAGE, a low-rank Adam that replaces the optimizer on the projected layers, may stand
in for it. Nothing else in the trainer compares optimizer names: adding an optimizer is one
entry here.

===== ====================================================== =========== =========
name  update                                                 route frame PLUMAGE
===== ====================================================== =========== =========
adamw Adam with decoupled weight decay (Loshchilov & Hutter) adam        yes
muon  Muon on the matrices (Jordan et al.; optax.contrib),   muon        no
      AdamW on embeddings, head, norms and biases
lion  Lion, the sign of an interpolated momentum (Chen et    adam        no
      al. 2023, arXiv 2302.06675; optax.lion)
===== ====================================================== =========== =========

Lion's update ``sign(β₁ m + (1 − β₁) g)`` is a per-coordinate normalised step, like Adam's
``m / √v`` (Adam is sign descent with a variance adaptation, Balles & Hennig 2018), so the
router judges its errors in Adam's frame. Lion takes ``optimizer.b1``/``b2`` as its ``β₁``/``β₂``
and wants a learning rate 3–10× below AdamW's (the paper's advice).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from gift_jax.utils.tree_paths import leaf_path, matches

#: Leaves trained by the dense rule of every optimizer (never Muon's orthogonalised update, never
#: PLUMAGE's projection): the embedding and the output head.
DENSE_PATTERNS = ("embed/*", "lm_head/*")
#: ``(reduction, output)`` axes of a stacked ``(layers, in, out)`` kernel (model.scan_layers).
STACKED_AXES = (1, 2)

#: ``build(opt, schedule, scan_layers)``: the update rule from the typed optimizer settings
#: (:class:`~gift_jax.training.recipe.OptimizerOptions`; the fields are read by name).
Build = Callable[[Any, optax.Schedule, bool], optax.GradientTransformation]


def decay_mask(params):
    """Weight decay on matrices only.

    Args:
      params: the parameter tree (or the updates', same structure).

    Returns:
      A tree of bools like ``params``: ``True`` for the leaves with at least 2 dimensions.
    """
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def _adamw(opt, schedule, scan_layers: bool) -> optax.GradientTransformation:
    del scan_layers
    return optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                       weight_decay=opt.weight_decay, mask=decay_mask)


def _muon(opt, schedule, scan_layers: bool) -> optax.GradientTransformation:
    def muon_dims(params):
        def dims(path, x):
            if x.ndim == 2 and not matches(leaf_path(path), DENSE_PATTERNS):
                return MuonDimensionNumbers()
            if x.ndim == 3 and scan_layers:  # (layers, in, out)
                return MuonDimensionNumbers(*STACKED_AXES)
            return None

        return jax.tree_util.tree_map_with_path(dims, params)

    return optax.contrib.muon(
        schedule,
        beta=opt.momentum,
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        weight_decay_mask=decay_mask,
        nesterov=opt.nesterov,
        adam_b1=opt.b1,
        adam_b2=opt.b2,
        adam_weight_decay=opt.weight_decay,
        muon_weight_dimension_numbers=muon_dims,
        consistent_rms=(opt.muon_extra_scale_factor
                        if opt.muon_scale_mode == "spectral" else None),
    )


def _lion(opt, schedule, scan_layers: bool) -> optax.GradientTransformation:
    del scan_layers
    return optax.lion(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                      mask=decay_mask)


@dataclasses.dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer of the registry.

    Attributes:
      name: its ``optimizer.name``.
      build: the dense update rule (:data:`Build`).
      route_frame: the frame of its update, where ``gift.route_frame='optimizer'`` measures
        round-trip errors (a value of :data:`gift_jax.whitening.stage.ROUTE_FRAMES`).
      settings: ``optimizer.*`` fields it reads besides the learning-rate schedule,
        ``weight_decay`` and ``grad_clip_norm`` (each checked before the run starts, by
        :func:`gift_jax.training.config.validate_config`).
      plumage: whether ``comm.method='plumage'`` (a low-rank Adam) may replace it.
    """

    name: str
    build: Build
    route_frame: str
    settings: tuple[str, ...]
    plumage: bool = False


#: Every optimizer, by ``optimizer.name``.
OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry("adamw", _adamw, "adam", ("b1", "b2", "eps"), plumage=True),
    "muon": OptimizerEntry("muon", _muon, "muon",
                           ("b1", "b2", "eps", "momentum", "nesterov", "muon_scale_mode",
                            "muon_extra_scale_factor")),
    "lion": OptimizerEntry("lion", _lion, "adam", ("b1", "b2")),
}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)

def get_optimizer(name: str) -> OptimizerEntry:
    """The registry entry of ``optimizer.name``.

    Args:
      name: an ``optimizer.name``, one of :data:`OPTIMIZER_NAMES`.

    Returns:
      Its :class:`OptimizerEntry`.

    Raises:
      ValueError: an unknown name (naming the allowed ones).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={name!r} is not one of {', '.join(OPTIMIZER_NAMES)}")
    return OPTIMIZERS[name]

