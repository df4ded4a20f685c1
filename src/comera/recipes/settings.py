"""A run's settings: a recipe preset, then a TOML file, then ``--set section.key=value`` entries, each key
known and of a type its field declares, checked before any data is read. Details: docs/recipes.md,
'Settings'.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from comera.data.files import GZIP_MAGIC, utf8_text
from comera.methods import Method, get_method, method_settings, settings_type, settings_values
from comera.recipes.base import get_recipe
from comera.tensorize_config import TensorizeConfig, fitted_preset, preset_names
from comera.train.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

__all__ = [
    "SECTIONS",
    "RUN_DATA_KEYS",
    "resolve_settings",
    "layered_settings",
    "typed_settings",
    "parse_assignment",
    "add_set_argument",
    "section_error",
    "tensorize_config",
    "check_recorded_settings",
    "with_run_data_keys",
]

SECTIONS = ("model", "data", "train", "tensorize", "method")
_RUN_OWNED = ("run_dir", "checkpoint_dir")
_NUMBER = (int, float)


def add_set_argument(parser: argparse.ArgumentParser, help: str | None) -> None:
    """Add the repeatable ``--set SECTION.KEY=VALUE`` option (read by :func:`parse_assignment`) to
    ``parser``; its values land in ``args.assignments`` (an empty list without the option). ``help``:
    the option's help text (``argparse.SUPPRESS`` hides it)."""
    parser.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help
    )


def parse_assignment(text: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> ``(section, key, value)``; the value is read as TOML (``16``, ``1e-3``,
    ``true``, ``[2, 3]``, ``"text"``), or kept as a plain string when it is not TOML."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ValueError(f"--set expects section.key=value (sections: {', '.join(SECTIONS)}), got {text!r}")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except ValueError as error:  # TOML that Python cannot hold: an integer of thousands of digits
        raise ValueError(f"--set {name.strip()}=...: the value cannot be read ({error})") from None
    return section, key, value


def _read_toml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ValueError(f"--config {path}: a folder; expected a TOML file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: file not found") from None
    except OSError as error:
        raise ValueError(f"--config {path}: cannot be read ({error.strerror or error})") from None
    if data[:2] == GZIP_MAGIC:
        raise ValueError(f"--config {path}: a gzip file; give the TOML text (gunzip it first)")
    try:
        return tomllib.loads(utf8_text(data, path))
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"--config {path}: not valid TOML ({error})") from None
    except ValueError as error:
        raise ValueError(f"--config {error}") from None


def _declared_types(config_class: type) -> dict[str, Any]:
    """``{field: its type annotation}`` of a settings dataclass."""
    return typing.get_type_hints(config_class)


_DECLARED = {"train": _declared_types(TrainConfig), "tensorize": _declared_types(TensorizeConfig)}


def _fits(value: Any, declared: Any) -> bool:
    """Whether a TOML ``value`` has the declared type (unions, Optional, tuples as lists, ints as floats)."""
    origin = typing.get_origin(declared)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(declared))
    if declared is type(None):
        return value is None
    if declared is bool or isinstance(value, bool):
        return declared is bool and isinstance(value, bool)
    if declared is float:
        return isinstance(value, _NUMBER)
    if origin in (tuple, list) or declared in (tuple, list):
        return isinstance(value, (list, tuple))
    if origin is not None and issubclass(origin, Mapping):
        return isinstance(value, Mapping)
    return isinstance(value, origin or declared)


def _type_name(declared: Any) -> str:
    options = (
        typing.get_args(declared) if typing.get_origin(declared) in (typing.Union, types.UnionType) else ()
    )
    if options:
        return " or ".join(_type_name(option) for option in options)
    if declared is type(None):
        return "None"
    return getattr(typing.get_origin(declared) or declared, "__name__", str(declared))


def _valid_keys(section: str, defaults: Mapping[str, Any], method: Method) -> dict[str, Any]:
    if section == "train":
        return {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name not in _RUN_OWNED}
    if section == "tensorize":
        return {"preset": "", **{f.name: None for f in dataclasses.fields(TensorizeConfig)}}
    if section == "method":
        return settings_values(settings_type(method.name)())
    return dict(defaults)


def _same_kind(value: Any, default: Any) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, _NUMBER)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def _apply(
    settings: dict[str, Any],
    section: str,
    key: str,
    value: Any,
    valid: dict[str, Any],
    where: str,
    declared_types: dict[str, dict[str, Any]],
):
    if key not in valid:
        owners = [other for other, types in declared_types.items() if other != section and key in types]
        hint = "".join(f"; {key} is a [{other}] setting: set {other}.{key}" for other in owners)
        raise ValueError(
            f"{where}: unknown key {section}.{key}; valid keys of [{section}]: {sorted(valid)}{hint}"
        )
    default = settings[section].get(key, valid[key])
    declared = declared_types.get(section, {}).get(key)
    if declared is not None and not _fits(value, declared):
        raise ValueError(f"{where}: {section}.{key} must be of type {_type_name(declared)}, got {value!r}")
    if declared is None and not _same_kind(value, default):
        raise ValueError(
            f"{where}: {section}.{key} must be of type {type(default).__name__} like its default "
            f"{default!r}, got {value!r}"
        )
    settings[section][key] = (
        float(value) if isinstance(default, float) and not isinstance(value, bool) else value
    )


def resolve_settings(
    presets: Mapping[str, dict[str, Any]],
    preset: str,
    method: Method,
    *,
    config_file: str | Path | None = None,
    assignments: Iterable[str] = (),
) -> dict[str, Any]:
    """The checked settings of a run: sections ``model``, ``data``, ``train``, ``tensorize``, ``method``
    (:func:`layered_settings`, each section then checked by :func:`typed_settings`). A run resolves them
    with :func:`comera.recipes.spec.run_spec`, which keeps the typed sections."""
    settings = layered_settings(presets, preset, method, config_file=config_file, assignments=assignments)
    typed_settings(settings, method)
    return settings


def layered_settings(
    presets: Mapping[str, dict[str, Any]],
    preset: str,
    method: Method,
    *,
    config_file: str | Path | None = None,
    assignments: Iterable[str] = (),
) -> dict[str, Any]:
    """A run's settings by section, layered: the preset, then the TOML file, then the assignments; every key
    known and of its declared type (the values' ranges are checked by :func:`typed_settings`).

    Args:
        presets: the recipe's presets.
        preset: the chosen preset's name.
        method: the run's method (its per-method overrides from the preset are applied; the fields of its
            settings dataclass are the valid ``method`` keys, their defaults the section's start).
        config_file: a TOML file with ``[model]``, ``[data]``, ``[train]``, ``[tensorize]``, ``[method]``
            tables, applied over the preset.
        assignments: ``"section.key=value"`` strings applied last.
    """
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
    base = copy.deepcopy(dict(presets[preset]))
    per_method = base.pop("method", {}) or {}
    settings: dict[str, Any] = {section: dict(base.get(section, {})) for section in SECTIONS}
    settings["method"] = settings_values(settings_type(method.name)())
    defaults = {section: dict(settings[section]) for section in SECTIONS}
    valid = {section: _valid_keys(section, defaults[section], method) for section in SECTIONS}
    declared = {**_DECLARED, "method": _declared_types(settings_type(method.name))}
    for section, values in (per_method.get(method.name) or {}).items():
        for key, value in values.items():
            _apply(settings, section, key, value, valid[section], f"preset {preset!r}", declared)
    if config_file is not None:
        path = Path(config_file)
        for section, values in _read_toml(path).items():
            if section not in SECTIONS:
                raise ValueError(
                    f"--config {path}: unknown table [{section}]; valid tables: {list(SECTIONS)}"
                )
            if not isinstance(values, dict):
                raise ValueError(
                    f"--config {path}: {section} = {values!r} at the top level; [{section}] must be a table "
                    f"of settings (e.g. [{section}] then key = value lines)"
                )
            for key, value in values.items():
                _apply(settings, section, key, value, valid[section], f"--config {path}", declared)
    for text in assignments:
        section, key, value = parse_assignment(text)
        if section not in SECTIONS:
            raise ValueError(f"--set {text!r}: unknown section {section!r}; valid sections: {list(SECTIONS)}")
        _apply(settings, section, key, value, valid[section], f"--set {text!r}", declared)
    name = settings["tensorize"].get("preset")
    if name not in preset_names():
        raise ValueError(
            f"tensorize.preset {name!r} is not registered; registered presets: {list(preset_names())}"
        )
    return settings


def typed_settings(
    settings: Mapping[str, dict[str, Any]], method: Method, **run_owned: Any
) -> tuple[TrainConfig, Any, TensorizeConfig]:
    """The ``train``, ``method`` and ``tensorize`` sections of layered ``settings`` built into the objects
    that read them (:class:`comera.TrainConfig` with the ``run_owned`` fields such as ``run_dir``, the
    method's settings, :func:`tensorize_config`); the constructors' ``ValueError`` is given the section's
    name (``train.lr_other must be ...``)."""
    try:
        train = TrainConfig.from_dict({**settings["train"], **run_owned})
    except ValueError as error:  # its messages name the field alone: say which section it is in
        raise ValueError(f"train.{error}") from None
    try:
        chosen = method_settings(method.name, settings["method"])
    except ValueError as error:
        raise section_error("method", error, settings["method"]) from None
    try:
        tensorize = tensorize_config(settings)
    except ValueError as error:
        keys = ["preset", *(field.name for field in dataclasses.fields(TensorizeConfig))]
        raise section_error("tensorize", error, keys) from None
    return train, chosen, tensorize


def section_error(section: str, error: ValueError | FileNotFoundError, keys: Iterable[str]) -> Exception:
    """``error`` with ``section.`` put before its message when the message opens with one of the section's
    ``keys`` (``rank must be ...`` -> ``tensorize.rank must be ...``, ``tokenizer_file X does not exist``
    -> ``data.tokenizer_file X does not exist``), so that the user sees where the setting lives; a
    :class:`FileNotFoundError` stays one. Any other message (a file's, already qualified) is returned as
    it is."""
    message = str(error)
    if not any(message.startswith(f"{key} ") for key in keys):
        return error
    kind = FileNotFoundError if isinstance(error, FileNotFoundError) else ValueError
    return kind(f"{section}.{message}")


RUN_DATA_KEYS: tuple[str, ...] = ("layout",)
"""Data settings a resumed run takes from its own folder whatever the command says (how its ``--data`` was
laid out into token shards, which decides the tokens it trains on): :func:`with_run_data_keys`."""


def with_run_data_keys(header: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """``header`` (a resuming command's ``config.json``) with the :data:`RUN_DATA_KEYS` of ``recorded`` (the
    run folder's) where both data sections have the key."""
    then = (recorded.get("settings") or {}).get("data")
    now = (header.get("settings") or {}).get("data")
    if not isinstance(then, dict) or not isinstance(now, dict):
        return header
    kept = {key: then[key] for key in RUN_DATA_KEYS if key in then and key in now}
    if not kept:
        return header
    return {**header, "settings": {**header["settings"], "data": {**now, **kept}}}


def check_recorded_settings(recorded: Mapping[str, Any], where: str | Path, way_out: str) -> None:
    """Refuse a run folder's ``config.json`` (``recorded``, read from ``where``) whose settings sections do
    not have the keys the current code writes: ``method`` exactly its method's settings, ``model`` and
    ``data`` exactly its recipe preset's (when the recipe is registered), ``train`` and ``tensorize`` only
    keys they take. Folders of an earlier comera are not converted.

    Raises:
        ValueError: one line naming the missing and unknown ``section.key`` entries, then ``way_out``.
    """
    settings = recorded.get("settings") or {}
    try:
        method = get_method(recorded.get("method"))
    except (ValueError, TypeError):
        raise ValueError(f"{where}: method {recorded.get('method')!r} is not registered; {way_out}") from None
    try:
        preset = get_recipe(recorded.get("recipe")).presets[recorded.get("preset")]
    except (KeyError, ValueError, TypeError):
        preset = None  # an unregistered recipe: the command names its own, and the headers differ there
    missing, unknown = [], []
    for section in SECTIONS:
        keys = set(settings.get(section) or {})
        if section in ("model", "data") and preset is None:
            continue
        valid = set(_valid_keys(section, (preset or {}).get(section, {}), method))
        unknown += [f"{section}.{key}" for key in sorted(keys - valid)]
        if section not in ("train", "tensorize"):
            missing += [f"{section}.{key}" for key in sorted(valid - keys)]
    if missing or unknown:
        named = (("missing", missing), ("unknown", unknown))
        found = "; ".join(f"{kind} {', '.join(names)}" for kind, names in named if names)
        raise ValueError(f"{where}: settings written by an earlier comera ({found}); {way_out}")


def tensorize_config(settings: dict[str, Any]) -> TensorizeConfig:
    """The run's :class:`comera.TensorizeConfig`: its named preset fitted to the run's ``model`` section
    (:func:`comera.tensorize_config.fitted_preset`), with the section's other keys applied."""
    overrides = {key: value for key, value in settings["tensorize"].items() if key != "preset"}
    return fitted_preset(settings["tensorize"]["preset"], settings.get("model") or {}, **overrides)
