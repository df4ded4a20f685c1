"""``RunSpec``: one run resolved once, at the command's edge, into typed objects (``TrainConfig``,
``TensorizeConfig``, the method's settings) by :func:`run_spec`; every later step reads it, and its
:meth:`RunSpec.header` is the run folder's ``config.json``. Details: docs/recipes.md, 'Settings'.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comera.data.files import check_data_path
from comera.methods import get_method
from comera.recipes.base import get_recipe
from comera.recipes.fingerprint import data_fingerprint
from comera.recipes.settings import (
    layered_settings,
    section_error,
    typed_settings,
    with_run_data_keys,
)
from comera.tensorize_config import TensorizeConfig
from comera.train.config import TrainConfig

__all__ = ["RunSpec", "run_spec", "resumed", "read_run_config", "default_cache_dir", "default_run_dir"]


def default_cache_dir() -> Path:
    """``$COMERA_CACHE``, else ``~/.cache/comera``: vocabularies and binary data caches kept between runs."""
    return Path(os.environ.get("COMERA_CACHE") or Path.home() / ".cache" / "comera")


def default_run_dir(recipe: str, preset: str, method: str) -> Path:
    """``runs/RECIPE-PRESET-METHOD`` under the current folder."""
    return Path("runs") / f"{recipe}-{preset}-{method}"


@dataclass(frozen=True)
class RunSpec:
    """A run as resolved by :func:`run_spec`; nothing in it is checked again.

    Attributes:
        recipe, method, preset: the registered names.
        data: the recipe's data file or folder as given; None for its embedded data.
        data_files: the data's fingerprint (:func:`comera.recipes.fingerprint.data_fingerprint`).
        out: the run folder; cache_dir: the cache folder.
        resume, restart, progress: as :func:`comera.recipes.run.run` takes them.
        settings: the layered sections ``model``, ``data``, ``train``, ``tensorize``, ``method`` as the run
            folder's ``config.json`` records them (only the keys that were set; ``model`` and ``data`` are
            the recipe's, read by its builders).
        train: the ``train`` section as :class:`comera.TrainConfig` (``run_dir`` = ``out``, ``batch_size``
            the global batch).
        tensorize: the run's :class:`comera.TensorizeConfig` (its preset fitted to the model section).
        method_settings: the ``method`` section as the method's settings object.
    """

    recipe: str
    method: str
    preset: str
    data: Path | None
    data_files: Any
    out: Path
    cache_dir: Path
    resume: bool
    restart: bool
    progress: bool | None
    settings: Mapping[str, dict[str, Any]]
    train: TrainConfig
    tensorize: TensorizeConfig
    method_settings: Any

    def header(self) -> dict[str, Any]:
        """The run folder's ``config.json``: recipe, method, preset, the data's resolved path and
        fingerprint (``data_files``), and the layered ``settings``."""
        return {
            "recipe": self.recipe,
            "method": self.method,
            "preset": self.preset,
            "data": None if self.data is None else str(self.data.resolve()),
            "data_files": self.data_files,
            "settings": dict(self.settings),
        }


def run_spec(
    recipe: str,
    method: str = "comera",
    preset: str = "small",
    *,
    data: str | Path | None = None,
    config_file: str | Path | None = None,
    assignments: Iterable[str] = (),
    out: str | Path | None = None,
    resume: bool = False,
    restart: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
) -> RunSpec:
    """The :class:`RunSpec` of a run, checked without building anything: ``ValueError`` naming the setting
    for an unknown recipe, method, preset or key, or a value out of its range; ``FileNotFoundError`` for a
    missing data path or TOML file. It reads the data files once (their fingerprint); with ``resume`` it
    keeps the data settings the run folder recorded (:func:`comera.recipes.settings.with_run_data_keys`).
    ``out`` defaults to :func:`default_run_dir`, ``cache_dir`` to :func:`default_cache_dir`."""
    if resume and restart:
        raise ValueError("--resume and --restart exclude each other: continue the run, or start it again")
    chosen = get_method(method)
    recipe_class = get_recipe(recipe)
    settings = layered_settings(
        recipe_class.presets, preset, chosen, config_file=config_file, assignments=assignments
    )
    folder = Path(out) if out is not None else default_run_dir(recipe, preset, method)
    train, method_settings, tensorize = typed_settings(
        settings, chosen, run_dir=str(folder), progress=progress
    )
    try:
        recipe_class.check_model_settings(settings["model"])
    except ValueError as error:
        raise section_error("model", error, settings["model"]) from None
    data_path = None if data is None else Path(data)
    if data_path is not None:
        check_data_path(data_path)
    spec = RunSpec(
        recipe=recipe,
        method=method,
        preset=preset,
        data=data_path,
        data_files=data_fingerprint(data_path),
        out=folder,
        cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
        resume=resume,
        restart=restart,
        progress=progress,
        settings=settings,
        train=train,
        tensorize=tensorize,
        method_settings=method_settings,
    )
    return resumed(spec) if resume else spec


def resumed(spec: RunSpec) -> RunSpec:
    """``spec`` continuing the run in ``spec.out``: ``resume`` set, and the data settings the folder's
    ``config.json`` recorded kept (:func:`comera.recipes.settings.with_run_data_keys`; none when it has no
    readable one, which the folder check then names)."""
    spec = dataclasses.replace(spec, resume=True)
    recorded = _recorded_header(spec.out)
    if recorded is None:
        return spec
    return dataclasses.replace(spec, settings=with_run_data_keys(spec.header(), recorded)["settings"])


def _recorded_header(out: Path) -> dict[str, Any] | None:
    """The run folder's ``config.json``, or None when it has no readable one (the folder check then says
    what is wrong)."""
    try:
        return read_run_config(out / "config.json")
    except (OSError, ValueError):
        return None


def _json_type(value: Any) -> str:
    """The JSON name of ``value``'s type (``"array"`` for a list, ``"null"`` for None, ...)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _shape_problem(recorded: Any) -> str | None:
    """What makes ``recorded`` unlike the ``config.json`` a run writes (an object whose ``settings`` is an
    object of objects), or None."""
    if not isinstance(recorded, dict):
        return f"holds a JSON {_json_type(recorded)}, not the object a run writes"
    settings = recorded.get("settings")
    if settings is not None and not isinstance(settings, dict):
        return f"holds a JSON {_json_type(settings)} under 'settings', where a run writes an object"
    for section, values in (settings or {}).items():
        if values is not None and not isinstance(values, dict):
            return (
                f"holds a JSON {_json_type(values)} under 'settings.{section}', where a run writes an object"
            )
    return None


def read_run_config(config_path: Path) -> dict[str, Any]:
    """A run folder's ``config.json``; ``ValueError`` naming the file (and the key) when it is not valid JSON
    or not shaped as a run writes it."""
    try:
        recorded = json.loads(config_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        problem = f"is not valid JSON ({error})"
    else:
        problem = _shape_problem(recorded)
        if problem is None:
            return recorded
    raise ValueError(
        f"{config_path} {problem}, so the run in its folder cannot be checked against this command; repair "
        "the file, or use another --out"
    ) from None
