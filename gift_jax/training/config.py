"""Run configuration for the trainer: defaults, command-line overrides, validation, comparison.

A run is ``configs/base.py`` + a model/experiment config + overrides. The trainer needs a few
settings that older config files may lack; :func:`complete_config` fills them in from
:data:`TRAINER_DEFAULTS` (so ``--config.train.grad_accum_steps=4`` works on any config file).

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
import os
import pathlib
import runpy
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections

from gift_jax.comm.codecs import CODEC_NAMES

#: ``comm.codec`` values (the all-reduce's wire format).
CODECS = CODEC_NAMES
#: ``comm.method`` values (what is done around the all-reduce: :mod:`gift_jax.training.method`).
METHODS = ("none", "gift", "plumage")
#: The former ``comm.mode`` values → ``(comm.codec, comm.method)``; ``None`` keeps the
#: config's ``comm.codec`` (which those modes required to be a low-precision codec).
LEGACY_COMM_MODES: dict[str, tuple[str | None, str]] = {
    "fp32": ("fp32", "none"),
    "bf16": ("bf16", "none"),
    "fp8": (None, "none"),
    "gift_fp8": (None, "gift"),
    "plumage": (None, "plumage"),
}
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant")
SCALINGS = ("tensor", "block")
PROJECTORS = ("plumage", "galore", "flora")
GIFT_REMAINDERS = {"diagonal": "lowrank_diag", "isotropic": "lowrank_isotropic"}
MUON_SCALE_MODES = ("spectral", "shape")

#: Settings the trainer adds when a config file does not define them.
TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    "mesh": {
        "intra_size": 1,  # >1: hierarchical all-reduce; mesh ('data', 'intra') of this size
    },
    "comm": {
        "intra_codec": "fp32",  # codec of the intra-node reduce-scatter (hierarchical only)
        "distribute_refresh": True,  # spread GIFT/PLUMAGE refresh decompositions over replicas
    },
    "train": {
        "grad_accum_steps": 1,  # microbatches per optimizer step (one all-reduce per step)
        "diagnostics_every": 100,  # steps between wire-bytes/fidelity logs; 0 disables
        "keep_checkpoints": 3,  # most recent checkpoints kept on disk
    },
    "gift": {
        "two_sided": False,  # gift_fp8: also whiten the output side with B = E[g gᵀ]
    },
    "plumage": {
        "gift": False,  # plumage: GIFT-whiten the projected coordinates of gift.layers
    },
    "data": {
        "tokenizer": "byte",  # byte | PATH.model | PATH/tokenizer.json | spm:N | bpe:N
    },
}

#: Fields that may differ between a checkpoint and the run resuming it (cadence and output).
RUN_CONTROL_FIELDS = frozenset({
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.diagnostics_every",
    "train.workdir",
})


class ConfigError(ValueError):
    """A bad setting; the message is one line naming it and what is allowed."""


def translate_legacy_mode(mode: Any, codec: Any) -> tuple[Any, str]:
    """``(comm.codec, comm.method)`` of the former ``comm.mode=mode`` with ``comm.codec=codec``.

    Raises:
      ConfigError: ``mode`` is not one of :data:`LEGACY_COMM_MODES`.
    """
    if mode not in LEGACY_COMM_MODES:
        raise ConfigError(
            f"comm.mode={mode!r} is not supported: comm.mode was replaced by comm.codec "
            f"({', '.join(CODECS)}) and comm.method ({', '.join(METHODS)})")
    new_codec, method = LEGACY_COMM_MODES[mode]
    return (codec if new_codec is None else new_codec), method


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

    Raises :class:`ConfigError` naming the file when it is missing or defines no
    ``get_config()``.
    """
    path = pathlib.Path(name_or_path)
    if config_dir is not None and not path.suffix and len(path.parts) == 1:
        path = pathlib.Path(config_dir) / f"{path}.py"
    if not path.is_file():
        raise ConfigError(f"config {str(name_or_path)!r}: no such file ({path})")
    get_config = runpy.run_path(str(path)).get("get_config")
    if not callable(get_config):
        raise ConfigError(f"config file {str(path)!r} defines no get_config()")
    return get_config()


def complete_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``config`` with every missing :data:`TRAINER_DEFAULTS` field added, and a
    former ``comm.mode`` translated into ``comm.codec`` + ``comm.method``."""
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
            for name, value in fields.items():
                if name not in config[group]:
                    config[group][name] = value
    return config


# ---- command-line overrides -----------------------------------------------------------------


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
        raise ConfigError(
            f"--config.{name}={text!r}: expected a {type(current).__name__}"
        ) from None
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, tuple | list) and isinstance(value, str):
        value = (value,)
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    if current is not None and not isinstance(value, type(current)):
        raise ConfigError(
            f"--config.{name}={text!r}: expected a {type(current).__name__}, "
            f"got a {type(value).__name__}"
        )
    return value


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Iterable[tuple[str, str]]
) -> ml_collections.ConfigDict:
    """Applies ``(dotted.name, text)`` overrides to a copy of ``config``.

    Values are parsed to the type of the existing field (bools accept true/false, tuples a
    Python literal or a single string). An unknown field raises :class:`ConfigError`.
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


def _validate_plumage_gift(config) -> None:
    """``plumage.gift``: GIFT whitening of PLUMAGE's projected coordinates, with the
    ``gift.*`` settings (its factors refresh with the projection, every
    ``plumage.refresh_every`` steps; ``gift.refresh_every`` does not apply)."""
    use = config.plumage.get("gift", False)
    if not isinstance(use, bool):
        raise ConfigError(f"plumage.gift={use!r} must be a bool (true/false)")
    if not use:
        return
    _choice(config, "gift.remainder", tuple(GIFT_REMAINDERS))
    _positive_int(config, "gift.rank")
    if not tuple(config.gift.layers):
        raise ConfigError("gift.layers=() must name at least one layer when plumage.gift=True")
    if config.gift.get("two_sided", False):
        raise ConfigError(
            "gift.two_sided=True cannot be combined with plumage.gift=True (GIFT whitens the "
            "projected input side only); set gift.two_sided=false"
        )


def _validate_tokenizer(config) -> None:
    """``data.tokenizer`` has one of the forms of :data:`gift_jax.data.tokenizer.TOKENIZER_HELP`
    (its vocabulary is checked against ``model.vocab_size`` where the trainer uses the data
    pipeline)."""
    from gift_jax.data.tokenizer import TOKENIZER_HELP, parse_tokenizer

    value = config.data.get("tokenizer", "byte")
    if parse_tokenizer(value) is None:
        raise ConfigError(f"data.tokenizer={value!r} is not supported; allowed: {TOKENIZER_HELP}")


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """Checks every trainer setting against ``num_devices`` data-parallel devices.

    Raises:
      ConfigError: with one line naming the setting and what is allowed.
    """
    if "mode" in config.comm:
        raise _legacy_mode_error(config.comm.mode)
    _choice(config, "comm.codec", CODECS)
    _choice(config, "comm.method", METHODS)
    _choice(config, "optimizer.name", OPTIMIZERS)
    _choice(config, "optimizer.schedule", SCHEDULES)
    _choice(config, "optimizer.muon_scale_mode", MUON_SCALE_MODES)
    _choice(config, "comm.scaling", SCALINGS)
    _choice(config, "comm.intra_codec", CODEC_NAMES)
    _validate_tokenizer(config)
    method = config.comm.method
    if method == "plumage":
        _choice(config, "plumage.projector", PROJECTORS)
        _positive_int(config, "plumage.rank")
        _positive_int(config, "plumage.refresh_every")
        if config.optimizer.name != "adamw":
            raise ConfigError(
                f"optimizer.name={config.optimizer.name!r} cannot be combined with "
                "comm.method='plumage' (PLUMAGE is a low-rank Adam); use optimizer.name='adamw'"
            )
        _validate_plumage_gift(config)
    if method == "gift":
        _choice(config, "gift.remainder", tuple(GIFT_REMAINDERS))
        _positive_int(config, "gift.rank")
        _positive_int(config, "gift.refresh_every")
        if not isinstance(config.gift.two_sided, bool):
            raise ConfigError(
                f"gift.two_sided={config.gift.two_sided!r} must be a bool (true/false)")
    if not isinstance(config.comm.distribute_refresh, bool):
        raise ConfigError(
            f"comm.distribute_refresh={config.comm.distribute_refresh!r} must be a bool "
            "(true/false)")
    if config.comm.scaling == "block" and config.comm.codec in ("fp8_e4m3", "fp8_e5m2"):
        _positive_int(config, "comm.block_size")
    for name in ("train.global_batch_size", "train.seq_len", "train.num_steps",
                 "train.grad_accum_steps", "train.log_every", "mesh.intra_size"):
        _positive_int(config, name)
    for name in ("train.eval_every", "train.eval_batches", "train.checkpoint_every",
                 "train.diagnostics_every", "optimizer.warmup_steps"):
        _positive_int(config, name, minimum=0)
    _positive_int(config, "train.keep_checkpoints")
    intra = config.mesh.intra_size
    if num_devices % intra:
        raise ConfigError(
            f"mesh.intra_size={intra} must divide the number of devices ({num_devices})"
        )
    if intra > 1 and config.comm.error_feedback:
        raise ConfigError(
            "comm.error_feedback=True is not supported with mesh.intra_size > 1 (hierarchical)"
        )
    if (method == "none" and config.comm.codec in ("fp32", "bf16") and intra > 1
            and config.comm.intra_codec != "fp32"):
        raise ConfigError(
            f"comm.intra_codec={config.comm.intra_codec!r} applies to low-precision "
            f"communication, not to comm.codec={config.comm.codec!r}; keep it 'fp32'")
    batch, accum = config.train.global_batch_size, config.train.grad_accum_steps
    if batch % num_devices:
        raise ConfigError(
            f"train.global_batch_size={batch} must be divisible by the data-parallel size "
            f"{num_devices} (number of devices)"
        )
    if (batch // num_devices) % accum:
        raise ConfigError(
            f"train.grad_accum_steps={accum} must divide the per-device batch "
            f"{batch // num_devices} (train.global_batch_size / {num_devices} devices)"
        )
    if config.train.seq_len > config.model.max_seq_len:
        raise ConfigError(
            f"train.seq_len={config.train.seq_len} exceeds model.max_seq_len="
            f"{config.model.max_seq_len}"
        )


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
    """The config as a JSON object string (tuples become lists)."""
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


def config_differences(stored_json: str, config: ml_collections.ConfigDict) -> list[str]:
    """``"name: stored != current"`` for every field that matters for resuming.

    A field the checkpoint lacks whose current value is its :data:`TRAINER_DEFAULTS` value is
    not a difference: the checkpoint predates the setting and ran with that behaviour. A
    checkpoint's former ``comm.mode`` is compared as its ``comm.codec`` + ``comm.method``
    (:data:`LEGACY_COMM_MODES`), so runs written before the split resume bit-exactly."""
    stored = _translate_flat(json.loads(stored_json))
    current = json.loads(to_json(config))
    defaults = json.loads(json.dumps(_flatten(TRAINER_DEFAULTS)))
    names = sorted((set(stored) | set(current)) - RUN_CONTROL_FIELDS)
    missing = object()
    diffs = []
    for name in names:
        a, b = stored.get(name, missing), current.get(name, missing)
        if a is missing and name in defaults and b == defaults[name]:
            continue
        if a != b:
            a = "<absent>" if a is missing else repr(a)
            b = "<absent>" if b is missing else repr(b)
            diffs.append(f"{name}: {a} (checkpoint) != {b} (now)")
    return diffs
