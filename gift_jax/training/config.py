"""Run configuration for the trainer: defaults, command-line overrides, validation, comparison.

A run is the defaults (:func:`gift_jax.training.defaults.default_config`, which
``configs/base.py`` is) + a model/experiment config + overrides. A config that lacks a setting
(an older config file, a checkpoint's stored config) gets its default from
:func:`complete_config` (so ``--config.train.grad_accum_steps=4`` works on any config file).

Gradient communication is two settings: ``comm.codec`` (the wire format) and ``comm.method``
(``none | gift | plumage``; :mod:`gift_jax.training.method`). Config files and checkpoints
written with the former single ``comm.mode`` are translated (:data:`LEGACY_COMM_MODES`,
:func:`translate_legacy_mode`); a ``--config.comm.mode=...`` override is refused with the
equivalent pair.

Every check raises :class:`ConfigError` (a ``ValueError``) with one line naming the setting
and what is allowed.
"""

from __future__ import annotations

import ast
import copy
import json
import logging
import math
import numbers
import os
import pathlib
import runpy
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import ml_collections
from etils import epath

from gift_jax.comm.codecs import CODEC_NAMES, get_codec, low_precision_codecs
from gift_jax.comm.collectives import EXCHANGES, PACKS, stale_scales
from gift_jax.data.storage import is_remote, local_or_url
from gift_jax.data.text_files import corpus_bytes
from gift_jax.models import DEFAULT_FAMILY, MODELS, model_config_of
from gift_jax.training.defaults import default_config
from gift_jax.training.mesh import mesh_shape
from gift_jax.training.optimizers import OPTIMIZER_NAMES, get_optimizer
from gift_jax.utils.tree_paths import unmatched
from gift_jax.whitening.factors import EIG_METHODS
from gift_jax.whitening.stage import EMA_SCHEMES

log = logging.getLogger(__name__)

#: ``comm.codec`` values (the all-reduce's wire format).
CODECS = CODEC_NAMES
#: ``comm.method`` values (what is done around the all-reduce: :mod:`gift_jax.training.method`).
METHODS = ("none", "gift", "plumage")
#: The one table of named communication modes → ``(comm.codec, comm.method)``; codec ``None``:
#: a low-precision codec, the config's own (:func:`resolve_comm_mode`). These are the former
#: ``comm.mode`` values, the demo's modes and (``plumage`` labelled ``plumage_fp8``) the pod
#: compile's.
COMM_MODES: dict[str, tuple[str | None, str]] = {
    "fp32": ("fp32", "none"),
    "bf16": ("bf16", "none"),
    "fp8": (None, "none"),
    "gift_fp8": (None, "gift"),
    "plumage": (None, "plumage"),
}
#: The former ``comm.mode`` values (all of :data:`COMM_MODES`).
LEGACY_COMM_MODES = COMM_MODES
#: The codec a mode with codec ``None`` takes when the config's own codec is fp32 or bf16.
DEFAULT_LOW_PRECISION_CODEC = "fp8_e4m3"
#: ``optimizer.name`` values (:mod:`gift_jax.training.optimizers`).
OPTIMIZERS = OPTIMIZER_NAMES
SCHEDULES = ("cosine", "linear", "constant")
SCALINGS = ("tensor", "block")
PROJECTORS = ("plumage", "galore", "flora")
#: ``data.pipeline`` values (:func:`gift_jax.training.loop.data_batches`); ``"auto"`` (the
#: default) is resolved to one of the others by :func:`resolve_data_pipeline`.
PIPELINES = ("auto", "grid", "stream")
#: The bundled corpus: the plays (about 5 MB; its grid pass takes a few seconds with any
#: tokenizer), which ``data.pipeline='auto'`` reads with the grid.
BUNDLED_CORPUS = "shakespeare"
#: The largest ``text:DIR`` corpus ``data.pipeline='auto'`` reads with the grid: its one pass
#: before step 1 (tokenizing the train split) takes a few seconds up to this size, about what
#: starting the stream's worker processes takes, and the grid then costs nothing per step.
GRID_AUTO_BYTES = 16_000_000
#: Settings whose default changed, with the value they had before: a checkpoint that lacks
#: one ran with it (:func:`config_differences`, :func:`resolve_data_pipeline`).
FORMER_DEFAULTS: dict[str, Any] = {"data.pipeline": "grid", "gift.ema_scheme": "artifact"}
#: ``gift.ema_scheme`` values (:data:`gift_jax.whitening.stage.EMA_SCHEMES`).
GIFT_EMA_SCHEMES = EMA_SCHEMES
GIFT_REMAINDERS = {"diagonal": "lowrank_diag", "isotropic": "lowrank_isotropic"}
#: ``gift.route_frame`` values: :data:`gift_jax.whitening.stage.ROUTE_FRAMES` plus
#: ``"optimizer"`` (``"adam"`` for AdamW, ``"muon"`` for Muon).
GIFT_ROUTE_FRAMES = ("off", "euclidean", "whitened", "adam", "muon", "optimizer")
GIFT_REFRESH_RULES = ("fixed", "adaptive")
#: ``gift.eig_method`` values (:func:`gift_jax.whitening.factors.top_eigenpairs`).
GIFT_EIG_METHODS = EIG_METHODS
MUON_SCALE_MODES = ("spectral", "shape")
#: How each ``optimizer.*`` setting an optimizer declares (:attr:`OptimizerEntry.settings`) is
#: checked.
_OPTIMIZER_SETTING_CHECKS = {
    "b1": lambda c, n: _number(c, n, low=0, high=1, high_open=True),
    "b2": lambda c, n: _number(c, n, low=0, high=1, high_open=True),
    "eps": lambda c, n: _number(c, n, low=0, low_open=True),
    "momentum": lambda c, n: _number(c, n, low=0, high=1, high_open=True),
    "nesterov": lambda c, n: _bool(c, n),
    "muon_scale_mode": lambda c, n: _choice(c, n, MUON_SCALE_MODES),
    "muon_extra_scale_factor": lambda c, n: _number(c, n, low=0, low_open=True),
}

#: Every setting's default by group (:func:`gift_jax.training.defaults.default_config`, the one
#: table): what :func:`complete_config` adds when a config does not define a setting.
TRAINER_DEFAULTS: dict[str, dict[str, Any]] = default_config().to_dict()

#: How a resumed run whose ``train.num_steps`` changed lays out its learning-rate schedule
#: (see :func:`extend_schedule`).
EXTEND_SCHEDULE = ("keep", "stretch")

#: The run's length: it may change on resume, its schedule resolved by :func:`extend_schedule`.
EXTENSION_FIELDS = frozenset({"train.num_steps", "train.extend_schedule",
                              "optimizer.schedule_steps"})

#: Fields that may differ between a checkpoint and the run resuming it (cadence and output, and
#: how the stream pipeline computes its batches, which never changes what they are).
RUN_CONTROL_FIELDS = frozenset({
    "data.workers",
    "data.id_cache",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.diagnostics_every",
    "train.max_consecutive_skips",
    "train.skip_warning_fraction",
    "train.workdir",
})

#: Settings a run may change when it resumes: the mesh's shape and sharding rules (the state
#: is restored onto the new layout; see :mod:`gift_jax.training.checkpoint`).
RESHARDABLE_FIELDS = frozenset({"mesh.data", "mesh.fsdp", "mesh.tensor"})
RESHARDABLE_PREFIXES = ("mesh.rules.",)


class ConfigError(ValueError):
    """A bad setting; the message is one line naming it and what is allowed."""


def translate_legacy_mode(mode: Any, codec: Any) -> tuple[Any, str]:
    """``(comm.codec, comm.method)`` of the former ``comm.mode=mode`` with ``comm.codec=codec``.

    Args:
      mode: the former ``comm.mode`` (a key of :data:`LEGACY_COMM_MODES`).
      codec: the config's ``comm.codec`` (``None`` where it sets none), kept by the modes
        without a codec of their own (``fp8``, ``gift_fp8``, ``plumage``).

    Returns:
      ``(comm.codec, comm.method)``.

    Raises:
      ConfigError: ``mode`` is not one of :data:`LEGACY_COMM_MODES`.
    """
    if mode not in LEGACY_COMM_MODES:
        raise ConfigError(
            f"comm.mode={mode!r} is not supported: comm.mode was replaced by comm.codec "
            f"({', '.join(CODECS)}) and comm.method ({', '.join(METHODS)})")
    new_codec, method = LEGACY_COMM_MODES[mode]
    return (codec if new_codec is None else new_codec), method


def resolve_comm_mode(mode: str, codec: str) -> tuple[str, str]:
    """``(comm.codec, comm.method)`` of named mode ``mode`` (:data:`COMM_MODES`) for a config
    whose ``comm.codec`` is ``codec``: a mode without a codec of its own keeps ``codec`` when
    it is a low-precision one, else takes :data:`DEFAULT_LOW_PRECISION_CODEC`.

    Args:
      mode: a key of :data:`COMM_MODES` (``fp32``, ``bf16``, ``fp8``, ``gift_fp8``,
        ``plumage``).
      codec: the config's ``comm.codec``, one of :data:`CODECS`.

    Returns:
      ``(comm.codec, comm.method)``.

    Raises:
      ValueError: ``mode`` is not one of :data:`COMM_MODES` (or, for a mode without a codec
        of its own, ``codec`` is not a codec name).
    """
    if mode not in COMM_MODES:
        raise ValueError(f"communication mode {mode!r} is not one of {', '.join(COMM_MODES)}")
    own, method = COMM_MODES[mode]
    if own is None:
        own = codec if get_codec(codec).is_scaled else DEFAULT_LOW_PRECISION_CODEC
    return own, method


def _legacy_mode_error(mode: str) -> ConfigError:
    """The error for a ``comm.mode`` set where it cannot be translated (an override): names
    the two new settings, their values, and each former mode's pair."""
    pairs = "; ".join(
        f"{m} = comm.codec={c or '<the former comm.codec, e.g. fp8_e4m3>'} comm.method={meth}"
        for m, (c, meth) in LEGACY_COMM_MODES.items())
    return ConfigError(
        f"comm.mode={mode!r}: comm.mode was replaced by comm.codec ({', '.join(CODECS)}) and "
        f"comm.method ({', '.join(METHODS)}); {pairs}")


def load_config(name_or_path: str | os.PathLike,
                config_dir: str | os.PathLike | None = None) -> ml_collections.ConfigDict:
    """``get_config()`` of a config file: a path, or with ``config_dir`` a bare name such as
    ``"tiny"`` for ``<config_dir>/tiny.py``. The one config loader of the package; it reads only
    what the caller names (scripts pass the repository's ``configs/``).

    Args:
      name_or_path: a config file's path or, with ``config_dir``, a bare name (no suffix, no
        folder).
      config_dir: the folder bare names are looked up in, or ``None`` (``name_or_path`` is a
        path).

    Returns:
      What the file's ``get_config()`` returns (not yet completed: see
      :func:`complete_config`).

    Raises:
      ConfigError: naming the file when it is missing (listing the names in ``config_dir``)
        or defines no ``get_config()``.
    """
    path = pathlib.Path(name_or_path)
    if config_dir is not None and not path.suffix and len(path.parts) == 1:
        path = pathlib.Path(config_dir) / f"{path}.py"
    if not path.is_file():
        known = ("" if config_dir is None else "; the names in " + str(config_dir) + ": " +
                 ", ".join(sorted(p.stem for p in pathlib.Path(config_dir).glob("*.py")
                                  if not p.stem.startswith("_"))))
        raise ConfigError(f"config {str(name_or_path)!r}: no such file ({path}){known}")
    get_config = runpy.run_path(str(path)).get("get_config")
    if not callable(get_config):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    return get_config()


def complete_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` with every missing :data:`TRAINER_DEFAULTS` field added, and a
    former ``comm.mode`` translated into ``comm.codec`` + ``comm.method``.

    Args:
      config: a config, possibly lacking settings.

    Returns:
      The completed copy.

    Raises:
      ConfigError: ``comm.mode`` set together with ``comm.method``, or a ``comm.mode`` that
        is not one of :data:`LEGACY_COMM_MODES`.
    """
    config = copy.deepcopy(config)
    with config.unlocked():
        if "comm" in config and "mode" in config.comm:
            if "method" in config.comm:
                raise ConfigError(
                    "comm.mode and comm.method are both set: comm.mode was replaced by "
                    "comm.codec + comm.method; remove comm.mode")
            codec, method = translate_legacy_mode(config.comm.mode, config.comm.get("codec"))
            del config.comm["mode"]
            with config.comm.ignore_type():
                config.comm.codec = codec
            config.comm.method = method
        for group, fields in TRAINER_DEFAULTS.items():
            if group not in config:
                config[group] = ml_collections.ConfigDict()
            if group == "model":
                fields = _model_defaults(config.model)
            for name, value in fields.items():
                if name not in config[group]:
                    config[group][name] = value
    return config


def _model_defaults(model: ml_collections.ConfigDict) -> dict[str, Any]:
    """The defaults of the ``model`` group of ``model.family`` (the Llama's for a group
    without one; nothing but the family for an unknown one, which validation reports)."""
    family = model.get("family", DEFAULT_FAMILY)
    if family == DEFAULT_FAMILY:
        return TRAINER_DEFAULTS["model"]
    return MODELS[family].defaults() if family in MODELS else {"family": family}


# ---- command-line overrides -----------------------------------------------------------------


def _a(noun: str) -> str:
    """``noun`` with its indefinite article (``an int``, ``a float``)."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _parse_value(text: str, current: Any, name: str) -> Any:
    """``text`` converted to the type of the field's current value."""
    if isinstance(current, bool):
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{name}={text!r}: expected a bool (true/false)")
    if isinstance(current, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        if current is None:
            return text
        if isinstance(current, tuple | list):  # a bare string: one pattern, one name
            return (text,)
        raise ConfigError(
            f"--config.{name}={text!r}: expected {_a(type(current).__name__)}"
        ) from None
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, tuple | list) and isinstance(value, str):
        value = (value,)
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    if current is not None and not isinstance(value, type(current)):
        raise ConfigError(
            f"--config.{name}={text!r}: expected {_a(type(current).__name__)}, "
            f"got {_a(type(value).__name__)}"
        )
    return value


def set_fields(config: ml_collections.ConfigDict,
               fields: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """Sets typed values ``{"group.field": value}`` on ``config`` in place (types are not
    checked: a tuple may replace a tuple of another length, an int a float) and returns it;
    :func:`apply_overrides` is the command-line form, parsing strings.

    Args:
      config: the config to change, in place; the groups on each name's path must exist.
      fields: ``{"group.field": value}``, e.g. ``{"comm.method": "gift"}``; a field the group
        lacks is added.

    Returns:
      ``config`` itself.
    """
    with config.unlocked():
        for name, value in fields.items():
            *groups, field = name.split(".")
            node = config
            for group in groups:
                node = node[group]
            with node.ignore_type():
                node[field] = value
    return config


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Iterable[tuple[str, str]]
) -> ml_collections.ConfigDict:
    """Applies ``(dotted.name, text)`` overrides to a copy of ``config``.

    Values are parsed to the type of the existing field (bools accept true/false, tuples a
    Python literal or a single string). An unknown field raises :class:`ConfigError`.

    Args:
      config: a config (not changed).
      overrides: ``(dotted name, text)`` pairs, e.g. ``("comm.codec", "fp8_e4m3")``.

    Returns:
      The overridden copy.
    """
    config = copy.deepcopy(config)
    for name, text in overrides:
        *groups, leaf = name.split(".")
        node = config
        for i, group in enumerate(groups):
            if not isinstance(node, ml_collections.ConfigDict) or group not in node:
                known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else ""
                raise ConfigError(
                    f"unknown config field {'.'.join(groups[: i + 1])!r} (in --config.{name}); "
                    f"known: {known}"
                )
            node = node[group]
        if name == "comm.mode" and "mode" not in node:
            raise _legacy_mode_error(text)
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else ""
            raise ConfigError(f"unknown config field {name!r}; known in this group: {known}")
        value = _parse_value(text, node[leaf], name)
        with node.ignore_type():
            node[leaf] = value
    return config


# ---- validation -----------------------------------------------------------------------------


def _choice(config, name: str, allowed: Iterable[str]) -> None:
    value = _get(config, name)
    if value not in tuple(allowed):
        raise ConfigError(f"{name}={value!r} is not supported; allowed: {', '.join(allowed)}")


def _positive_int(config, name: str, minimum: int = 1) -> None:
    value = _get(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")


def _get(config, name: str) -> Any:
    node = config
    for part in name.split("."):
        node = node[part]
    return node


def _range_text(low: float, low_open: bool, high: float | None, high_open: bool) -> str:
    """``> 0``, ``>= 0`` or ``in [0, 1)``: the allowed range in one phrase."""
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _number(config, name: str, *, low: float, low_open: bool = False,
            high: float | None = None, high_open: bool = False) -> float:
    """The setting ``name`` as a float; a :class:`ConfigError` unless it is a finite number in
    the range (``inf`` from ``1e400``, NaN and bools are refused)."""
    value = _get(config, name)
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value)
          and (value > low if low_open else value >= low)
          and (high is None or (value < high if high_open else value <= high)))
    if not ok:
        raise ConfigError(f"{name}={value!r} must be a finite number "
                          f"{_range_text(low, low_open, high, high_open)}")
    return float(value)


def _bool(config, name: str) -> None:
    value = _get(config, name)
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be a bool (true/false)")


def _validate_optimizer(config) -> None:
    """The optimizer and its schedule: a positive finite peak learning rate, a final rate in
    ``[0, learning_rate]`` (unless the schedule is constant), a warmup shorter than the run,
    non-negative weight decay and clipping, and the settings the optimizer's registry entry
    reads (Adam's decays in ``[0, 1)``, a positive epsilon, Muon's momentum and scale…). A
    negative rate would train uphill and an infinite one would skip every step, both
    silently."""
    opt = "optimizer"
    peak = _number(config, f"{opt}.learning_rate", low=0, low_open=True)
    final = _number(config, f"{opt}.final_learning_rate", low=0)
    if config.optimizer.schedule != "constant" and final > peak:
        raise ConfigError(
            f"optimizer.final_learning_rate={final:g} must be <= optimizer.learning_rate="
            f"{peak:g} (the {config.optimizer.schedule} schedule decays from the peak to it)")
    _positive_int(config, f"{opt}.warmup_steps", minimum=0)
    _positive_int(config, f"{opt}.schedule_steps", minimum=0)
    _choice(config, "train.extend_schedule", EXTEND_SCHEDULE)
    fraction = _number(config, f"{opt}.warmup_fraction", low=0)
    if fraction >= 1:
        raise ConfigError(f"optimizer.warmup_fraction={fraction:g} must be in [0, 1) (the "
                          "longest warmup, as a share of the schedule; 0: no cap)")
    warmup, steps = warmup_length(config), schedule_length(config)
    length = ("train.num_steps" if not config.optimizer.schedule_steps
              else "optimizer.schedule_steps")
    if warmup >= steps:
        raise ConfigError(
            f"optimizer.warmup_steps={warmup} must be < {length}={steps} (the warmup "
            "would end after the run, never reaching optimizer.learning_rate)")
    _number(config, f"{opt}.weight_decay", low=0)
    _number(config, f"{opt}.grad_clip_norm", low=0)
    for field in get_optimizer(config.optimizer.name).settings:
        _OPTIMIZER_SETTING_CHECKS[field](config, f"{opt}.{field}")


def _validate_model(config) -> None:
    """``model.family`` names a family of :data:`gift_jax.models.MODELS`, and ``model.*`` are
    settings of its config dataclass as it checks them (``num_heads`` dividing ``d_model``,
    positive sizes, known dtypes), reported as the config's settings."""
    _choice(config, "model.family", tuple(MODELS))
    name = MODELS[config.model.family].config_type.__name__
    try:
        model_config_of(config.model)
    except (ValueError, TypeError) as e:
        message = str(e).replace(f"{name}.", "model.").replace(name, "model").rstrip(".")
        if message.startswith("Unknown"):  # a setting of another family
            message += f" (model.family={config.model.family!r})"
        raise ConfigError(message) from None


def _validate_gift_numbers(config) -> None:
    """GIFT's remainder, eigensolver, rank, damping (> 0: the floor of the factor's remainder)
    and EMA decay (in ``[0, 1)``)."""
    _choice(config, "gift.remainder", tuple(GIFT_REMAINDERS))
    _choice(config, "gift.eig_method", GIFT_EIG_METHODS)
    _positive_int(config, "gift.rank")
    _number(config, "gift.damping", low=0, low_open=True)
    _number(config, "gift.ema", low=0, high=1, high_open=True)
    _choice(config, "gift.ema_scheme", GIFT_EMA_SCHEMES)
    if config.gift.ema_scheme == "bias_corrected":
        _positive_int(config, "gift.stats_every")
        _number(config, "gift.stats_half_life", low=0, low_open=True)


def _validate_plumage_gift(config) -> None:
    """``plumage.gift``: GIFT whitening of PLUMAGE's projected coordinates, with the
    ``gift.*`` settings (its factors refresh with the projection, every
    ``plumage.refresh_every`` steps; ``gift.refresh_every`` does not apply)."""
    use = config.plumage.get("gift", False)
    if not isinstance(use, bool):
        raise ConfigError(f"plumage.gift={use!r} must be a bool (true/false)")
    if not use:
        return
    _validate_gift_numbers(config)
    if not tuple(config.gift.layers):
        raise ConfigError("gift.layers=() must name at least one layer when plumage.gift=True")
    if config.gift.get("two_sided", False):
        raise ConfigError(
            "gift.two_sided=True cannot be combined with plumage.gift=True (GIFT whitens the "
            "projected input side only); set gift.two_sided=false"
        )
    _choice(config, "gift.route_frame", GIFT_ROUTE_FRAMES)
    if config.gift.get("refresh", "fixed") != "fixed":
        raise ConfigError(
            f"gift.refresh={config.gift.refresh!r} cannot be combined with plumage.gift=True "
            "(GIFT's factors refresh with PLUMAGE's projection, every plumage.refresh_every "
            "steps); set gift.refresh='fixed'")


def _validate_tokenizer(config) -> None:
    """``data.tokenizer`` has one of the forms of :data:`gift_jax.data.tokenizer.TOKENIZER_HELP`
    (its vocabulary is checked against ``model.vocab_size`` where the trainer uses the data
    pipeline); ``data.pipeline``, ``data.workers`` and ``data.id_cache`` are valid."""
    from gift_jax.data.tokenizer import TOKENIZER_HELP, parse_tokenizer

    value = config.data.get("tokenizer", "byte")
    if parse_tokenizer(value) is None:
        raise ConfigError(f"data.tokenizer={value!r} is not supported; allowed: {TOKENIZER_HELP}")
    _choice(config, "data.pipeline", PIPELINES)
    line = resolve_data_pipeline(config)
    if line is not None:
        log.info(line)
    workers = config.data.workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < -1:
        raise ConfigError(f"data.workers={workers!r} must be an int >= -1 (-1: the host's "
                          "cores; 0: read and tokenize in the training process)")
    id_cache = config.data.id_cache
    if not isinstance(id_cache, str) or is_remote(id_cache):
        raise ConfigError(f"data.id_cache={id_cache!r} must be a local directory or '' (no "
                          "cache): a cached read is a random read per document, slower than "
                          "tokenizing on object storage")
    if id_cache and config.data.pipeline != "stream":
        raise ConfigError(f"data.id_cache={id_cache!r} needs data.pipeline='stream' (the grid "
                          "pipeline caches its whole token stream by itself)")


def _checkpoint_pipeline(workdir: str) -> str | None:
    """The ``data.pipeline`` of the newest checkpoint in ``workdir`` whose stored config reads
    (:data:`FORMER_DEFAULTS`'s ``grid`` for one written before the setting), or ``None``
    where there is none. Reads the metadata file that
    :class:`~gift_jax.training.checkpoint.Checkpointer` writes for each step
    (``<workdir>/checkpoints/<step>/meta/metadata``, orbax's JSON item); anything unreadable is
    passed over (a damaged checkpoint is the restore's to report)."""
    if not workdir:
        return None
    root = epath.Path(local_or_url(workdir)) / "checkpoints"
    try:
        steps = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit()), reverse=True)
    except OSError:
        return None
    for step in steps:
        try:
            stored = json.loads(json.loads((root / str(step) / "meta" / "metadata")
                                           .read_text())["config"])
            return str(stored.get("data.pipeline", FORMER_DEFAULTS["data.pipeline"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def resolve_data_pipeline(config: ml_collections.ConfigDict) -> str | None:
    """Resolves ``data.pipeline='auto'`` in place, and says how in one line.

    ``auto`` becomes, in this order:

    * the pipeline the newest checkpoint in ``train.workdir`` was written with (``grid`` for one
      written before the setting existed, when ``grid`` was the default), so that a run
      resumes with the batches it was reading;
    * ``grid`` for the bundled corpus (:data:`BUNDLED_CORPUS`) and for a ``text:DIR`` corpus of
      at most :data:`GRID_AUTO_BYTES`: its pass over the train split before step 1 is as short
      as the stream's start-up, and it costs nothing per step after;
    * ``stream`` for a larger ``text:DIR`` corpus and for ``tfds:NAME`` corpora (of any size):
      nothing is read before step 1 but the first batch's documents.

    An explicit ``grid`` or ``stream`` is left as it is. The resolved value is what the run
    stores with its checkpoints.

    Args:
      config: a completed config (``data.source`` and ``train.workdir`` as the run has them).

    Returns:
      The line to log (``None`` where ``data.pipeline`` was not ``auto``).
    """
    if config.data.pipeline != "auto":
        return None
    workdir = config.train.get("workdir", "")
    stored = _checkpoint_pipeline(workdir)
    source = config.data.get("source", BUNDLED_CORPUS)
    scheme, _, directory = source.partition(":")
    size = corpus_bytes(os.path.expanduser(directory)) if scheme == "text" else None
    stream_why = "nothing is read before step 1 but the first batch's documents"
    if stored in ("grid", "stream"):
        pipeline, why = stored, f"the pipeline of the checkpoints in {workdir}"
    elif source == BUNDLED_CORPUS:
        pipeline, why = "grid", (f"the bundled corpus ({BUNDLED_CORPUS}) is small enough to "
                                 "read whole before step 1")
    elif size is not None and size <= GRID_AUTO_BYTES:
        pipeline, why = "grid", (f"{source} holds {size / 1e6:.1f} MB, at most "
                                 f"{GRID_AUTO_BYTES / 1e6:.1f} MB: its one pass before step 1 "
                                 "is as short as the stream's start-up")
    elif size is not None:
        pipeline, why = "stream", (f"{source} holds {size / 1e6:.1f} MB, more than "
                                   f"{GRID_AUTO_BYTES / 1e6:.1f} MB, the grid's pass would "
                                   f"delay step 1; {stream_why}")
    else:
        pipeline, why = "stream", f"{source} may be of any size; {stream_why}"
    with config.unlocked():
        config.data.pipeline = pipeline
    return f"data.pipeline=auto -> {pipeline!r}: {why}"


#: ``comm.reduce_in`` values: when the gradient is reduced (:mod:`gift_jax.comm.overlap`).
REDUCE_IN = ("after", "backward")


def _validate_reduce_in(config: ml_collections.ConfigDict) -> None:
    """``comm.reduce_in`` and ``comm.bucket_elems``: a known value, a positive bucket size, and
    the in-backward reduction only where it is built (the all-reduce stage alone, GIFT on the
    fixed refresh clock, PLUMAGE without ``plumage.gift``)."""
    _choice(config, "comm.reduce_in", REDUCE_IN)
    _choice(config, "comm.exchange", EXCHANGES)
    _choice(config, "comm.pack", PACKS)
    _positive_int(config, "comm.bucket_elems")
    if config.comm.reduce_in != "backward":
        return
    if config.comm.method == "plumage" and config.plumage.get("gift", False) is True:
        raise ConfigError(
            "comm.reduce_in='backward' with comm.method='plumage' needs plumage.gift=False "
            "(GIFT whitens PLUMAGE's coordinates after the backward); or set "
            "comm.reduce_in='after'")
    if config.comm.method == "gift" and config.gift.get("refresh", "fixed") != "fixed":
        raise ConfigError(
            f"comm.reduce_in='backward' with comm.method='gift' needs gift.refresh='fixed' "
            f"(got {config.gift.refresh!r}: the adaptive rule measures every step's input "
            "coverage in the forward pass); or set comm.reduce_in='after'")


def _validate_scale_sync(config: ml_collections.ConfigDict, sizes: Mapping[str, int]) -> None:
    """``comm.scale_sync_every``: an int >= 1; above 1 (stale synced per-tensor scales,
    :func:`gift_jax.allreduce`'s ``scale_sync_every``) only where such scales exist and the
    reduction is the flat one after the backward pass over whole leaves."""
    _positive_int(config, "comm.scale_sync_every")
    every = config.comm.scale_sync_every
    if every == 1:
        return
    codec = get_codec(config.comm.codec)
    block = config.comm.scaling == "block" and codec.supports_block_scaling
    if not stale_scales(codec) or block:
        raise ConfigError(
            f"comm.scale_sync_every={every} reuses per-tensor scales; allowed with comm.codec "
            "fp8_e4m3, fp8_e5m2 or int8 and comm.scaling='tensor' (got comm.codec="
            f"{config.comm.codec!r}, comm.scaling={config.comm.scaling!r}); or set it to 1")
    for name, bad, why in (
            ("mesh.intra_size", config.mesh.intra_size > 1, "a flat reduction"),
            ("comm.reduce_in", config.comm.reduce_in != "after", "the reduction after the "
             "backward pass"),
            ("mesh.fsdp", sizes.get("fsdp", 1) > 1, "whole leaves on every device"),
            ("mesh.tensor", sizes.get("tensor", 1) > 1, "whole leaves on every device")):
        if bad:
            raise ConfigError(
                f"comm.scale_sync_every={every} needs {why}: set "
                f"{name}={'after' if name == 'comm.reduce_in' else 1}, or "
                "comm.scale_sync_every=1")


def _validate_fsdp_codecs(config: ml_collections.ConfigDict, sizes: Mapping[str, int]) -> None:
    """``comm.fsdp_codec`` and ``comm.fsdp_weight_codec`` (:mod:`gift_jax.comm.fsdp`): known
    codecs, a mesh that splits weights over ``fsdp``, whole layers on each device."""
    comm = config.comm
    _choice(config, "comm.fsdp_codec", ("", *CODECS))
    _choice(config, "comm.fsdp_weight_codec", ("", *low_precision_codecs()))
    if not comm.fsdp_codec:
        if comm.fsdp_weight_codec:
            raise ConfigError(
                f"comm.fsdp_weight_codec={comm.fsdp_weight_codec!r} needs comm.fsdp_codec (the "
                f"blocks' fsdp collectives): set comm.fsdp_codec to one of {', '.join(CODECS)}, "
                "or comm.fsdp_weight_codec=''")
        return
    if sizes.get("fsdp", 1) == 1:
        raise ConfigError(
            f"comm.fsdp_codec={comm.fsdp_codec!r} reduce-scatters gradients over mesh.fsdp, "
            "which this mesh does not have (mesh.fsdp=1): set mesh.fsdp > 1, or "
            "comm.fsdp_codec=''")
    if config.mesh.rules.get("layers", "") == "fsdp":
        raise ConfigError(
            "comm.fsdp_codec needs each layer whole on a device's fsdp group, but "
            "mesh.rules.layers='fsdp' splits the stacked layer axis: set mesh.rules.layers='' "
            "or comm.fsdp_codec=''")


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Checks every trainer setting against ``num_devices`` data-parallel devices, and
    resolves ``data.pipeline='auto'`` in place (:func:`resolve_data_pipeline`: the one
    setting that depends on ``data.source`` and ``train.workdir``, known only here), logging
    the choice in one line.

    Args:
      config: a completed config.
      num_devices: the number of devices of the run's mesh.

    Raises:
      ConfigError: with one line naming the setting and what is allowed.
    """
    if "mode" in config.comm:
        raise _legacy_mode_error(config.comm.mode)
    _choice(config, "comm.codec", CODECS)
    _choice(config, "comm.method", METHODS)
    _choice(config, "optimizer.name", OPTIMIZERS)
    _choice(config, "optimizer.schedule", SCHEDULES)
    _choice(config, "comm.scaling", SCALINGS)
    _choice(config, "comm.intra_codec", CODEC_NAMES)
    _validate_tokenizer(config)
    method = config.comm.method
    if method == "plumage":
        _choice(config, "plumage.projector", PROJECTORS)
        _positive_int(config, "plumage.rank")
        _positive_int(config, "plumage.refresh_every")
        _number(config, "plumage.scale", low=0, low_open=True)
        if not get_optimizer(config.optimizer.name).plumage:
            raise ConfigError(
                f"optimizer.name={config.optimizer.name!r} cannot be combined with "
                "comm.method='plumage' (PLUMAGE is a low-rank Adam); use optimizer.name="
                + " or ".join(repr(n) for n in OPTIMIZER_NAMES if get_optimizer(n).plumage)
            )
        _validate_plumage_gift(config)
    if method == "gift":
        _validate_gift_numbers(config)
        _positive_int(config, "gift.refresh_every")
        _choice(config, "gift.route_frame", GIFT_ROUTE_FRAMES)
        _choice(config, "gift.refresh", GIFT_REFRESH_RULES)
        if config.gift.refresh == "adaptive":
            _number(config, "gift.refresh_threshold", low=0, low_open=True, high=1,
                    high_open=True)
            _positive_int(config, "gift.min_refresh_every")
            _positive_int(config, "gift.max_refresh_every")
            if config.gift.min_refresh_every > config.gift.max_refresh_every:
                raise ConfigError(
                    f"gift.min_refresh_every={config.gift.min_refresh_every} must be <= "
                    f"gift.max_refresh_every={config.gift.max_refresh_every}")
        if not isinstance(config.gift.two_sided, bool):
            raise ConfigError(
                f"gift.two_sided={config.gift.two_sided!r} must be a bool (true/false)")
    _validate_reduce_in(config)
    if not isinstance(config.comm.distribute_refresh, bool):
        raise ConfigError(
            f"comm.distribute_refresh={config.comm.distribute_refresh!r} must be a bool "
            "(true/false)")
    if config.comm.scaling == "block" and get_codec(config.comm.codec).supports_block_scaling:
        _positive_int(config, "comm.block_size")
    for name in ("train.global_batch_size", "train.seq_len", "train.num_steps",
                 "train.grad_accum_steps", "train.log_every", "mesh.intra_size"):
        _positive_int(config, name)
    for name in ("train.eval_every", "train.eval_batches", "train.checkpoint_every",
                 "train.diagnostics_every", "train.max_consecutive_skips", "train.seed",
                 "data.shuffle_seed"):
        _positive_int(config, name, minimum=0)
    _positive_int(config, "train.keep_checkpoints")
    fraction = config.train.skip_warning_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, int | float)
            or not 0 <= fraction < 1):
        raise ConfigError(
            f"train.skip_warning_fraction={fraction!r} must be a number in [0, 1) (the share of "
            "a logged window's steps that may be skipped before a warning)")
    _validate_optimizer(config)
    _validate_model(config)
    intra = config.mesh.intra_size
    try:
        sizes = mesh_shape(num_devices, config.mesh.data, config.mesh.fsdp, config.mesh.tensor,
                           intra)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if intra > 1 and config.comm.error_feedback:
        raise ConfigError(
            "comm.error_feedback=True is not supported with mesh.intra_size > 1 (hierarchical)"
        )
    _validate_scale_sync(config, sizes)
    _validate_fsdp_codecs(config, sizes)
    if (method == "none" and not get_codec(config.comm.codec).is_scaled and intra > 1
            and config.comm.intra_codec != "fp32"):
        raise ConfigError(
            f"comm.intra_codec={config.comm.intra_codec!r} applies to low-precision "
            f"communication, not to comm.codec={config.comm.codec!r}; keep it 'fp32'")
    batch, accum = config.train.global_batch_size, config.train.grad_accum_steps
    # the batch is split over data x fsdp (tensor-parallel devices share their rows)
    splits = sizes["data"] * sizes["fsdp"]
    what = ("data-parallel size", f"{splits} (number of devices)") if splits == num_devices \
        else ("batch split", f"mesh.data x mesh.fsdp = {splits}")
    if batch % splits:
        raise ConfigError(
            f"train.global_batch_size={batch} must be divisible by the {what[0]} {what[1]}")
    if (batch // splits) % accum:
        raise ConfigError(
            f"train.grad_accum_steps={accum} must divide the per-device batch "
            f"{batch // splits} (train.global_batch_size / {what[1]})")
    if config.train.seq_len > config.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={config.train.seq_len} exceeds model.max_seq_len="
            f"{config.model.max_seq_len}"
        )


def gift_runs(config: ml_collections.ConfigDict) -> bool:
    """Whether the run whitens ``gift.layers`` (``comm.method='gift'``, or PLUMAGE with
    ``plumage.gift``).

    Args:
      config: a completed config.

    Returns:
      ``True`` when a GIFT stage runs.
    """
    method = config.comm.method
    return method == "gift" or (method == "plumage" and config.plumage.get("gift", False) is True)


def validate_layer_patterns(config: ml_collections.ConfigDict,
                            param_paths: Iterable[str]) -> None:
    """Checks that every ``gift.layers`` pattern selects a parameter of the model (whose
    parameter paths are ``param_paths``, e.g. ``layers/0/mlp/down_proj/kernel``) when GIFT
    runs. The trainer calls it before anything is written to disk, so a typo in a pattern
    ends the run with one line instead of an error inside the optimizer's initialisation.

    Args:
      config: a completed config (nothing is checked unless :func:`gift_runs`).
      param_paths: the model's '/'-joined parameter paths.

    Raises:
      ConfigError: naming the patterns that match nothing and showing what paths look like.
    """
    if not gift_runs(config):
        return
    paths = list(param_paths)
    missing = unmatched(tuple(config.gift.layers), paths)
    if missing:
        sample = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
        raise ConfigError(
            f"gift.layers pattern(s) {', '.join(map(repr, missing))} match no parameter of the "
            f"model; allowed: fnmatch patterns of parameter or module paths such as "
            f"'*/mlp/down_proj' (paths look like: {sample})")


def nothing_to_communicate(config: ml_collections.ConfigDict, replicas: int) -> str | None:
    """The warning for a run that asks for low-precision or method-shaped communication on a
    data-parallel size of 1, where no all-reduce happens (wire bytes 0, and the codec and
    method change nothing a multi-device run would see); ``None`` otherwise.

    Args:
      config: a completed config (``comm.codec`` and ``comm.method`` are read).
      replicas: the run's data-parallel size
        (:func:`~gift_jax.training.mesh.data_parallel_size` of its mesh; not the device
        count, since ``fsdp`` and ``tensor`` devices share one replica).

    Returns:
      The one-line warning, or ``None`` when ``replicas > 1`` or the run asks for fp32 and
      no method.
    """
    codec, method = config.comm.codec, config.comm.method
    if replicas > 1 or (codec == "fp32" and method == "none"):
        return None
    return (
        f"comm.codec={codec!r} comm.method={method!r} on a data-parallel size of 1: there is "
        "nothing to communicate (wire bytes 0), so this run does not show the effect of the "
        "wire format; run on several devices (on CPU: --cpu_devices 8, or XLA_FLAGS="
        "--xla_force_host_platform_device_count=8)")


# ---- comparison (resume) --------------------------------------------------------------------


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def to_json(config: ml_collections.ConfigDict) -> str:
    """The config as a JSON object string (tuples become lists).

    Args:
      config: the config.

    Returns:
      ``{"group.field": value}`` of every setting (nested groups flattened with ``.``), keys
      sorted; values JSON cannot hold are written as their ``str``.
    """
    return json.dumps(_flatten(config.to_dict()), sort_keys=True, default=str)


def _translate_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A stored (flat) config with a former ``comm.mode`` translated to ``comm.codec`` +
    ``comm.method`` (an unknown mode is left as it is, to show up as a difference)."""
    if "comm.mode" not in flat or "comm.method" in flat:
        return flat
    flat = dict(flat)
    if flat["comm.mode"] in LEGACY_COMM_MODES:
        flat["comm.codec"], flat["comm.method"] = translate_legacy_mode(
            flat.pop("comm.mode"), flat.get("comm.codec"))
    return flat


def warmup_length(config: ml_collections.ConfigDict) -> int:
    """Steps of the linear warmup: ``optimizer.warmup_steps``, capped by
    ``optimizer.warmup_fraction`` of the schedule (at least one step) when that is set, so a
    short run of a config keeps a warmup that fits it.

    Args:
      config: a completed config.

    Returns:
      The warmup's length in steps.
    """
    warmup, fraction = config.optimizer.warmup_steps, config.optimizer.get("warmup_fraction", 0)
    if fraction:
        warmup = min(warmup, max(1, int(fraction * schedule_length(config))))
    return int(warmup)


def schedule_length(config: ml_collections.ConfigDict) -> int:
    """Steps the learning-rate schedule decays over: ``optimizer.schedule_steps``, or
    ``train.num_steps`` when it is 0.

    Args:
      config: a completed config.

    Returns:
      The schedule's length in steps.
    """
    return int(config.optimizer.get("schedule_steps", 0) or config.train.num_steps)


class Extension(NamedTuple):
    """What :func:`extend_schedule` returns."""

    config: ml_collections.ConfigDict  # with optimizer.schedule_steps made explicit
    message: str | None  # a line to log; None: the run's length did not change
    old_length: int  # the schedule length the checkpoint was written with


def extend_schedule(stored_json: str, config: ml_collections.ConfigDict) -> Extension:
    """The config of a run resuming a checkpoint written with ``stored_json``, with its
    learning-rate schedule made explicit, and a line to log.

    ``train.num_steps`` may change on resume ("train it longer", or stop earlier). What the
    schedule then means is ``train.extend_schedule``:

    * ``keep``: the schedule keeps the length it had (``optimizer.schedule_steps`` is set to
      it); past its end cosine and linear decays stay at ``optimizer.final_learning_rate``,
      so the learning rate continues without a jump;
    * ``stretch``: the schedule is laid out anew over the new ``train.num_steps``; the
      learning rate jumps at the resumed step (the line says from what to what).

    An ``optimizer.schedule_steps`` set explicitly is used as given.

    Args:
      stored_json: the checkpoint's config (the :func:`to_json` text of its metadata); a
        former ``comm.mode`` is translated.
      config: the resuming run's completed config (not changed).

    Returns:
      An :class:`Extension`: a copy of ``config`` (``optimizer.schedule_steps`` set to the
      checkpoint's schedule length under ``keep`` or an unchanged ``train.num_steps``, to 0
      under ``stretch``; left as it is when set explicitly or when neither length changed),
      the line to log (``None`` when ``train.num_steps`` did not change) and the schedule
      length the checkpoint was written with.
    """
    stored = _translate_flat(json.loads(stored_json))
    old_steps = int(stored["train.num_steps"])
    old_length = int(stored.get("optimizer.schedule_steps", 0) or old_steps)
    new_steps = int(config.train.num_steps)
    config = copy.deepcopy(config)
    if config.optimizer.schedule_steps or old_length == new_steps == old_steps:
        return Extension(config, None, old_length)
    keep = new_steps == old_steps or config.train.extend_schedule == "keep"
    with config.unlocked():
        config.optimizer.schedule_steps = old_length if keep else 0
    change = f"train.num_steps: {old_steps} (checkpoint) -> {new_steps}: the learning-rate"
    if new_steps == old_steps:  # an earlier extension's kept length, recorded
        message = None
    elif keep:
        message = (f"{change} schedule keeps its {old_length}-step length "
                   "(train.extend_schedule=keep); past it the rate stays at its final value")
    else:
        message = (f"{change} schedule is stretched from {old_length} to {new_steps} steps "
                   "(train.extend_schedule=stretch), so the learning rate jumps where the run "
                   "resumes")
    return Extension(config, message, old_length)


def config_differences(stored_json: str, config: ml_collections.ConfigDict) -> list[str]:
    """``"name: stored != current"`` for every field that matters for resuming.

    A field the checkpoint lacks whose current value is its :data:`TRAINER_DEFAULTS` value is
    not a difference: the checkpoint predates the setting and ran with that behaviour (with
    its :data:`FORMER_DEFAULTS` value where the default has changed since; a ``gift.*`` one
    only where the resuming run whitens, :func:`gift_runs`: a run without GIFT never read
    it). A current ``data.pipeline='auto'`` (a config not yet resolved by
    :func:`validate_config`) matches any stored pipeline: resuming, it resolves to the
    checkpoint's. A
    checkpoint's former ``comm.mode`` is compared as its ``comm.codec`` + ``comm.method``
    (:data:`LEGACY_COMM_MODES`), so runs written before the split resume bit-exactly.

    Args:
      stored_json: the checkpoint's config (the :func:`to_json` text of its metadata).
      config: the resuming run's config.

    Returns:
      One ``"name: <stored> (checkpoint) != <current> (now)"`` line per differing field
      (``<absent>`` where a side lacks it), sorted by name; :data:`RUN_CONTROL_FIELDS`,
      :data:`EXTENSION_FIELDS`, :data:`RESHARDABLE_FIELDS` and ``mesh.rules.*`` are not
      compared. Empty: the checkpoint belongs to this config.
    """
    stored = _translate_flat(json.loads(stored_json))
    current = json.loads(to_json(config))
    defaults = json.loads(json.dumps(_flatten(TRAINER_DEFAULTS)))
    names = sorted(n for n in (set(stored) | set(current)) - RUN_CONTROL_FIELDS
                   - EXTENSION_FIELDS
                   - RESHARDABLE_FIELDS if not n.startswith(RESHARDABLE_PREFIXES))
    missing = object()
    diffs = []
    for name in names:
        a, b = stored.get(name, missing), current.get(name, missing)
        if name == "data.pipeline" and b == "auto":
            continue  # auto resolves to the checkpoint's pipeline (resolve_data_pipeline)
        if a is missing and name in FORMER_DEFAULTS and (
                not name.startswith("gift.") or gift_runs(config)):
            a = FORMER_DEFAULTS[name]
        elif a is missing and name in defaults and b == defaults[name]:
            continue
        if a != b:
            a = "<absent>" if a is missing else repr(a)
            b = "<absent>" if b is missing else repr(b)
            diffs.append(f"{name}: {a} (checkpoint) != {b} (now)")
    return diffs
