"""The run folder's checks before a run starts or resumes: its entries of the right kinds, a new run not over
an old one, a resumed run's recorded settings (``config.json``) and data build the same as now, every split
holding examples; and the moving aside of an old run for ``--restart``."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from comera.recipes.base import RecipeData
from comera.recipes.fingerprint import fingerprint_difference
from comera.recipes.settings import check_recorded_settings
from comera.recipes.spec import read_run_config
from comera.train.config import TrainConfig

__all__ = [
    "RUN_ENTRIES",
    "RUN_FOLDERS",
    "RUN_OUTPUTS",
    "KEEPING_SETTINGS",
    "header_difference",
    "check_data_identity",
    "aside_name",
    "move_run_aside",
    "check_run_folder",
    "check_splits",
]

RUN_ENTRIES = ("config.json", "metrics.jsonl", "checkpoints", "model", "results.json")
"""Entries of a run folder whose presence means the folder holds a run (finished or not)."""
RUN_FOLDERS = ("checkpoints", "model", "plots")
"""The entries of :data:`RUN_ENTRIES` and :data:`RUN_OUTPUTS` that are folders."""
RUN_OUTPUTS = ("plots", "report.txt")
"""The other entries a run writes."""


KEEPING_SETTINGS = {"train": frozenset({"checkpoint_every", "keep_checkpoints"})}
"""Settings that decide only how a run is kept on disk, not what it trains or records: a resume (or a
reused run of ``comera compare``) may give them other values, which then hold for the rest of the run."""


def _without_keeping_settings(header: dict[str, Any]) -> dict[str, Any]:
    settings = header.get("settings")
    if not isinstance(settings, dict):
        return header
    settings = dict(settings)
    for section, keys in KEEPING_SETTINGS.items():
        if isinstance(settings.get(section), dict):
            settings[section] = {key: value for key, value in settings[section].items() if key not in keys}
    return {**header, "settings": settings}


def header_difference(recorded: dict[str, Any], header: dict[str, Any]) -> str | None:
    """None when a run folder's ``config.json`` (``recorded``) matches ``header``; else what differs: the
    data file that changed (by name, size and hash), or the keys with other values. The
    :data:`KEEPING_SETTINGS` are not compared."""
    recorded, header = _without_keeping_settings(recorded), _without_keeping_settings(header)
    by_content = "data_files" in recorded  # a folder written before fingerprints has only the data's path
    if not by_content:
        recorded = {**recorded, "data_files": header.get("data_files")}
    recorded = {key: value for key, value in recorded.items() if key != "data_identity"}  # after the build
    if recorded == header:
        return None
    changed = fingerprint_difference(recorded.get("data_files"), header.get("data_files"))
    if changed is not None:
        return f"the data changed since the run started ({changed})"
    if by_content:  # the same data by content, wherever it lies now (a link, a renamed copy)
        recorded, header = (
            {key: value for key, value in each.items() if key not in ("data", "data_files")}
            for each in (recorded, header)
        )
        if recorded == header:
            return None
    keys = sorted(key for key in {*header, *recorded} if recorded.get(key) != header.get(key))
    changed = []
    for key in keys:
        if key == "settings":
            changed += _changed_settings(recorded.get("settings") or {}, header.get("settings") or {})
        else:
            changed.append(f"{key}: {_shown(recorded.get(key))} then, {_shown(header.get(key))} now")
    return f"it was started with other settings ({'; '.join(changed)})"


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _changed_settings(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"section.key: X then, Y now"`` for every setting whose value differs; a setting that one side
    does not name is shown as its default (:func:`_unset`)."""
    changed = []
    for section in sorted({*recorded, *now}):
        then_values, now_values = recorded.get(section) or {}, now.get(section) or {}
        for key in sorted({*then_values, *now_values}):
            if then_values.get(key) != now_values.get(key):
                then, later = (
                    repr(values[key]) if key in values else _unset(section, key)
                    for values in (then_values, now_values)
                )
                changed.append(f"{section}.{key}: {then} then, {later} now")
    return changed


_TRAIN_DEFAULTS = {field.name: field.default for field in fields(TrainConfig)}


def _unset(section: str, key: str) -> str:
    """How a setting that the preset, the TOML file and ``--set`` left out is shown: the value it takes
    (known for the ``train`` section, :class:`comera.train.config.TrainConfig`'s), else "unset"."""
    if section == "train" and key in _TRAIN_DEFAULTS:
        return f"unset (the default, {_TRAIN_DEFAULTS[key]!r})"
    return "unset (the default)"


def check_data_identity(out: Path, identity: dict[str, str] | None, cache: Path) -> None:
    """Refuse a resume whose data build made something else than the run's (``RecipeData.info["identity"]``,
    recorded in ``config.json`` as ``data_identity``; folders written before it was recorded pass)."""
    recorded = read_run_config(out / "config.json")
    if "data_identity" not in recorded or recorded["data_identity"] == identity:
        return
    then, now = recorded["data_identity"] or {}, identity or {}
    name = next(key for key in sorted({*then, *now}) if then.get(key) != now.get(key))
    raise ValueError(
        f"--resume: the run in {out} cannot continue: the data build made another {name} than the run's "
        f"(sha256 {str(then.get(name))[:12]} then, {str(now.get(name))[:12]} now; it is trained on the "
        f"machine, and training it again need not give the same one): resume with the --cache folder the "
        f"run used (this command read {cache}), or start it again with --restart"
    )


def aside_name(out: Path) -> Path:
    out = out.resolve()
    number = 1
    while os.path.lexists(aside := out.with_name(f"{out.name}.old-{number}")):  # a dangling link is taken
        number += 1
    return aside


def move_run_aside(out: Path) -> Path | None:
    """Move the run's files in ``out`` into a new folder ``OUT.old-N`` beside it; returns that folder, or
    None when ``out`` holds no run. Other files in ``out`` stay."""
    if not any((out / name).exists() for name in RUN_ENTRIES):
        return None
    aside = aside_name(out)
    try:
        aside.mkdir()
    except OSError as error:
        raise ValueError(
            f"--restart: cannot make {aside.name[:24]}... beside the run to move its files to "
            f"({error.strerror or error}); move or rename the run folder {out} yourself"
        ) from None
    for name in (*RUN_ENTRIES, *RUN_OUTPUTS):
        if (out / name).exists():
            (out / name).rename(aside / name)
    return aside


def _entry_kind(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a symbolic link that leads nowhere"
    return "a folder" if path.is_dir() else "a file" if path.is_file() else "neither a file nor a folder"


def _check_entry_kinds(out: Path) -> None:
    """``ValueError`` naming an entry of a run folder that is not of its kind (``metrics.jsonl`` a folder or
    a pipe, ``checkpoints`` a file or a dangling link, ``plots`` a file, ...), before any data is read."""
    for name in (*RUN_ENTRIES, *RUN_OUTPUTS):
        path = out / name
        if not os.path.lexists(path):
            continue
        wanted = "a folder" if name in RUN_FOLDERS else "a file"
        found = _entry_kind(path)
        if found != wanted:
            raise ValueError(f"{path} should be {wanted} of the run but is {found}: move it away")


def check_run_folder(out: Path, header: dict[str, Any], resume: bool) -> None:
    """Check ``out`` for a new run, or with ``resume`` for the run to continue (a restart checks nothing
    here: :func:`comera.recipes.run.run_spec_folder` moves the old run aside once the data and the model are
    built, so that a start refused by them leaves it in place)."""
    _check_entry_kinds(out)
    config_path = out / "config.json"
    if resume:
        if not config_path.exists():
            left = sorted(name for name in RUN_ENTRIES if (out / name).exists())
            if left:
                raise FileNotFoundError(
                    f"--resume: {config_path} not found, so the run in {out} (its {', '.join(left)} are "
                    "there) cannot continue without its settings; start it again with --restart (its files "
                    "are moved aside)"
                )
            raise FileNotFoundError(f"--resume: {config_path} not found; there is no run to resume in {out}")
        recorded = read_run_config(config_path)
        check_recorded_settings(
            recorded, config_path, "start it again with --restart or choose another --out"
        )
        difference = header_difference(recorded, header)
        if difference is not None:
            raise ValueError(
                f"--resume: the run in {out} cannot continue: {difference}; resume with the same command "
                "and data, start it again with --restart, or start a new run with another --out"
            )
        return None
    if any((out / name).exists() for name in RUN_ENTRIES):
        raise FileExistsError(
            f"{out} already holds a run; continue it with --resume, start it again with --restart (its "
            "files are moved aside), or choose another --out"
        )
    return None


def check_splits(data: RecipeData, data_path: Path | None) -> None:
    """Every split must hold examples: an evaluation of none has no value (``ValueError`` naming it)."""
    source = "the embedded data" if data_path is None else f"--data {data_path}"
    for split, dataset in {"train": data.train, **data.evals}.items():
        if hasattr(dataset, "__len__") and len(dataset) == 0:
            counts = data.info.get("splits", {}).get(split)
            read = (
                ""
                if counts is None
                else f" ({counts.get('read', 0)} read, {counts.get('skipped', 0)} skipped)"
            )
            raise ValueError(f"{source}: the {split} split has no examples{read}; give data with some")
