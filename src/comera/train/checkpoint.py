"""Training checkpoints: atomic files that ``torch.load(weights_only=True)`` reads (tensors and plain values,
named ``step-XXXXXXXX.pt``, written to a temporary file, fsynced and renamed, so a crash leaves the old set or
the new one), holding the whole state whatever the number of processes that wrote it; a sharded (FSDP) run
writes a folder ``step-XXXXXXXX.dcp`` of per-rank shards instead (:mod:`comera.train.sharded_checkpoint`).
The keys are listed in docs/training.md, "The loop"."""

from __future__ import annotations

import io
import os
import random
import re
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comera.atomic import atomic_write

__all__ = [
    "foreign_entry",
    "misplaced_entries",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "SHARDED_SUFFIX",
    "TRAINER_FILE",
    "checkpoint_path",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "remove_checkpoint",
    "capture_rng",
    "restore_rng",
    "NoReadableCheckpointError",
    "ForeignCheckpointError",
]

CHECKPOINT_FORMAT = "comera-train-checkpoint"
CHECKPOINT_VERSION = 1
SHARDED_SUFFIX = ".dcp"
"""The name ending of a sharded checkpoint folder (``step-XXXXXXXX.dcp``)."""
_NAME = re.compile(r"step-(\d{8,})\.(pt|dcp)")
TRAINER_FILE = "trainer.pt"
"""The file of a sharded checkpoint folder that holds everything but the model and optimizer state."""


class NoReadableCheckpointError(ValueError):
    """A resume found ``count`` checkpoint files in ``directory``, none of them readable (each truncated or
    corrupt)."""

    def __init__(self, directory: str | os.PathLike, count: int) -> None:
        self.directory = Path(directory)
        self.count = count
        super().__init__(
            f"no readable checkpoint in {self.directory}: all {count} are truncated or corrupt; start fresh "
            "with resume=False"
        )


class ForeignCheckpointError(ValueError):
    """A readable checkpoint whose structure does not fit the model being trained: it was written by
    another model (a resume skips it, as it skips an unreadable one)."""


def _bond_shrunk(mine: tuple[int, ...], theirs: tuple[int, ...]) -> bool:
    """Whether ``theirs`` is ``mine`` with its bond (first and last) sizes shrunk, as pruning does."""
    if len(mine) != len(theirs):
        return False
    if len(mine) == 1:
        return theirs[0] <= mine[0]
    return mine[1:-1] == theirs[1:-1] and theirs[0] <= mine[0] and theirs[-1] <= mine[-1]


def foreign_entry(
    state: Mapping[str, Any],
    own: Mapping[str, torch.Tensor],
    structure: Mapping[str, Any],
    shapes: Mapping[int, tuple[int, ...] | None] | None = None,
) -> str | None:
    """Why a checkpoint's model ``state`` cannot be this model's (another model, another width, an edited
    file), or None; checked before the checkpoint's structure is applied. Every entry must be the model's
    with its shape and dtype, but for the shapes ``shapes`` gives (by parameter ``id``, after the
    structure; None: the layer is removed) or, without ``shapes``, the removed layers and shrunk bonds of
    the layers the structure names; ``own`` is the model's ``state_dict(keep_vars=True)``.
    """
    shapes = shapes or {}
    layers = tuple(structure)
    removed = tuple(
        name for name, spec in structure.items() if isinstance(spec, Mapping) and spec.get("removed")
    )

    def under(key: str, names: tuple[str, ...]) -> bool:
        return any(key.startswith(f"{name}.") for name in names)

    prunable = {id(value) for key, value in own.items() if under(key, layers)}
    for key, value in state.items():
        if key not in own:
            return f"its entry {key!r} is not in this model"
        if not isinstance(value, torch.Tensor):
            return f"its entry {key!r} is not a tensor ({type(value).__name__})"
        if value.dtype != own[key].dtype:
            return f"its entry {key!r} is {value.dtype}, this model's {own[key].dtype}"
        theirs = tuple(value.shape)
        mine = tuple(own[key].shape)
        if id(own[key]) in shapes and shapes[id(own[key])] is None:
            return f"its entry {key!r} belongs to a layer its structure records as removed"
        expected = shapes.get(id(own[key]))
        if expected is not None:
            if theirs != tuple(expected):
                return f"its entry {key!r} has shape {list(theirs)}, its structure gives {list(expected)}"
            continue
        shrinkable = under(key, layers) or id(own[key]) in prunable
        if mine != theirs and not (shrinkable and _bond_shrunk(mine, theirs)):
            return f"its entry {key!r} has shape {list(theirs)}, this model's {list(mine)}"
    missing = [key for key in own if key not in state and not under(key, removed)]
    if missing:
        return f"it lacks this model's entry {missing[0]!r}"
    return None


def checkpoint_path(directory: str | os.PathLike, step: int, sharded: bool = False) -> Path:
    """The name of the checkpoint taken after ``step`` steps: a file, or a folder for a ``sharded`` one."""
    return Path(directory) / f"step-{step:08d}{SHARDED_SUFFIX if sharded else '.pt'}"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint in ``directory`` (files and sharded folders), oldest first (empty
    if there is no folder); of a file and a folder for the same step, the folder comes last. An entry with a
    checkpoint's name but of the other kind is not listed (:func:`misplaced_entries`)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.fullmatch(path.name)
        if match and (path.is_dir() if match.group(2) == "dcp" else path.is_file()):
            found.append((int(match.group(1)), match.group(2) == "dcp", path))
    return [(step, path) for step, _, path in sorted(found)]


def misplaced_entries(directory: str | os.PathLike) -> list[Path]:
    """Entries of ``directory`` with a checkpoint's name but not of its kind (a folder named ``step-N.pt``,
    a file named ``step-N.dcp``, a pipe), sorted: no checkpoint, and in the way of the one that step will
    write."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(
        path
        for path in directory.iterdir()
        if (match := _NAME.fullmatch(path.name))
        and not (path.is_dir() if match.group(2) == "dcp" else path.is_file())
    )


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete the checkpoint file or sharded folder ``path`` (nothing if it is gone)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint with the highest step in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``payload`` to ``path`` atomically (temporary file, fsync, ``os.replace``, folder fsync)."""
    return atomic_write(path, lambda file: torch.save(payload, file))


def _damaged_entry(path: Path) -> str | None:
    """The first entry of a checkpoint file's zip archive (``torch.save``'s format) whose bytes do not match
    their stored CRC-32, or None. ``torch.load`` does not check the CRCs, so bytes damaged inside a tensor's
    record would load as wrong values without this; a file that is not a zip archive is left to
    ``torch.load``. The shards of a sharded folder are checked by :func:`_damaged_shards`."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        return archive.testzip()


def _damaged_shards(folder: Path) -> str | None:
    """What is wrong with the shards of a sharded checkpoint folder, or None. ``torch.distributed.checkpoint``
    writes an index (``.metadata``) of where each saved item lies in the ``.distcp`` files, each item a
    ``torch.save`` zip archive with its CRC-32s, and checks none of it on loading: a missing index, a shard
    cut short or bytes changed inside an item are found here, before anything is loaded, so a resume skips
    the folder as it skips a damaged file."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # any failure to read the index makes the folder unreadable
        return f"its index .metadata cannot be read: {type(error).__name__}: {error}"
    for key, where in metadata.storage_data.items():
        shard = folder / where.relative_path
        try:
            with shard.open("rb") as file:
                file.seek(where.offset)
                item = file.read(where.length)
        except OSError as error:
            return f"{where.relative_path} cannot be read: {error.strerror or error}"
        if len(item) < where.length:
            end = where.offset + where.length
            return f"{where.relative_path} is cut short: {key.fqn} needs bytes up to {end}"
        try:
            with zipfile.ZipFile(io.BytesIO(item)) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, ValueError, EOFError) as error:  # a garbled archive fails in many ways
            return f"{where.relative_path}: the record of {key.fqn} is not a readable archive ({error})"
        if bad is not None:
            return f"{where.relative_path}: the record of {key.fqn} fails the CRC-32 check"
    return None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)`` onto the CPU and check its format; for a
    sharded folder its ``trainer.pt``, with ``"shards"`` set to the folder."""
    path = Path(path)
    if path.is_dir() and path.suffix != SHARDED_SUFFIX:
        raise ValueError(f"{path}: not a checkpoint, a folder with a checkpoint file's name")
    if path.is_dir():
        if not (path / TRAINER_FILE).is_file():
            raise ValueError(f"{path}: not a readable checkpoint, no {TRAINER_FILE} in the sharded folder")
        payload = load_checkpoint(path / TRAINER_FILE)
        damage = _damaged_shards(path)
        if damage is not None:
            raise ValueError(f"{path}: not a readable checkpoint, truncated or corrupt ({damage})")
        return {**payload, "shards": str(path)}
    if not path.is_file():
        raise FileNotFoundError(f"{path}: checkpoint file not found")
    try:
        damaged = _damaged_entry(path)
        payload = None if damaged is not None else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        why = str(error) or ("an empty file" if path.stat().st_size == 0 else type(error).__name__)
        raise ValueError(f"{path}: not a readable checkpoint, truncated or corrupt ({why})") from None
    if damaged is not None:
        raise ValueError(
            f"{path}: not a readable checkpoint, truncated or corrupt (its entry {damaged!r} fails the "
            "CRC-32 check: bytes changed after it was written)"
        )
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a comera training checkpoint (missing format {CHECKPOINT_FORMAT!r})")
    if "rank_adaptation" in payload:
        raise ValueError(
            f"{path}: a checkpoint of an earlier comera (its objective's state under 'rank_adaptation'), "
            "which this comera does not read: start the run again (--restart)"
        )
    if payload.get("format_version", 0) > CHECKPOINT_VERSION:
        raise ValueError(
            f"{path}: key 'format_version' is {payload['format_version']!r}; this comera reads versions "
            f"up to "
            f"{CHECKPOINT_VERSION}"
        )
    return payload


def capture_rng() -> dict[str, Any]:
    """The states of torch (CPU and every CUDA device), ``random`` and numpy, as tensors and plain values."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["kind"],
            saved["keys"].numpy().astype(np.uint32),
            saved["position"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
