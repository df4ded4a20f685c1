"""A dataset written by ``datasets.save_to_disk`` (``Dataset`` or ``DatasetDict``) read one document at a time
through ``pyarrow``'s memory maps, without the ``datasets`` package, its ``validation`` (else ``test``)
split held out: :func:`saved_dataset_documents`. Details: docs/llm.md, 'Bringing a corpus' ('What is
read').
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from comera.data.corpus import PARQUET_EXTRA
from comera.data.sources import CodeDocument, SkippedDocument, split_of

__all__ = [
    "DATASET_DICT_FILE",
    "DATASET_STATE_FILE",
    "HELD_OUT_SPLITS",
    "held_out_rule",
    "held_out_rule_text",
    "held_out_split_name",
    "is_saved_dataset",
    "saved_dataset_documents",
    "saved_dataset_files",
]

DATASET_DICT_FILE = "dataset_dict.json"
DATASET_STATE_FILE = "state.json"
_PLAIN_SPLIT = "data"
HELD_OUT_SPLITS = ("validation", "test")
"""The splits of a saved ``DatasetDict`` kept out of training, the first one present being the validation
split."""


def held_out_rule(held_out: str | None, validation_fraction: float) -> Callable[[str], str | None]:
    """``key -> "train" | "validation" | None`` (None: left out): by hash
    (:func:`comera.data.sources.split_of`), or, when ``held_out`` names a saved ``DatasetDict``'s split
    (keys ``split/...``), that split is validation, the other one of :data:`HELD_OUT_SPLITS` is left out
    and every other split is trained on."""
    if held_out is None:
        return lambda key: split_of(key, validation_fraction)

    def rule(key: str) -> str | None:
        name = key.partition("/")[0]
        if name == held_out:
            return "validation"
        return None if name in HELD_OUT_SPLITS else "train"

    return rule


def held_out_rule_text(held_out: str) -> str:
    """:func:`held_out_rule`'s rule for ``held_out``, as ``index.json`` states it."""
    left_out = [name for name in HELD_OUT_SPLITS if name != held_out]
    return (
        f"the saved dataset's own {held_out!r} split is the validation split; its "
        f"{', '.join(map(repr, left_out))} split, if any, is left out (held out); every other split is "
        "trained on; a record's key is split/row (rows from 0)"
    )


def is_saved_dataset(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder written by ``datasets.save_to_disk``."""
    if path is None:
        return False
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in (DATASET_DICT_FILE, DATASET_STATE_FILE))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--data: {path} cannot be read as datasets writes it ({error})") from None


def _splits(root: Path) -> list[tuple[str, Path]]:
    """``[(split name, its Dataset folder)]`` in the order the dataset records them."""
    if (root / DATASET_DICT_FILE).is_file():
        names = _read_json(root / DATASET_DICT_FILE).get("splits")
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            raise ValueError(f"--data: {root / DATASET_DICT_FILE} has no list of 'splits'")
        return [(name, root / name) for name in names]
    return [(_PLAIN_SPLIT, root)]


def saved_dataset_files(root: str | Path) -> list[tuple[str, Path]]:
    """``[(split name, Arrow file)]`` of the saved dataset at ``root``, in reading order.

    Raises:
        ValueError: a ``state.json`` or ``dataset_dict.json`` that does not list its files, or a listed
            file that is not there (named).
    """
    root = Path(root)
    files = []
    for split, folder in _splits(root):
        state = _read_json(folder / DATASET_STATE_FILE)
        entries = state.get("_data_files") if isinstance(state, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"--data: {folder / DATASET_STATE_FILE} has no '_data_files' list")
        for entry in entries:
            file = folder / str(entry.get("filename", "")) if isinstance(entry, dict) else None
            if file is None or not file.is_file():
                raise ValueError(f"--data: {folder / DATASET_STATE_FILE} lists {entry!r}, which is not there")
            files.append((split, file))
    return files


def held_out_split_name(root: str | Path) -> str | None:
    """The split of the saved ``DatasetDict`` at ``root`` that is the validation split (``"validation"``,
    else ``"test"``), or None (a plain ``Dataset``, or neither split: the split is by hash)."""
    names = {split for split, _ in _splits(Path(root))}
    return next((name for name in HELD_OUT_SPLITS if name in names), None)


def saved_dataset_documents(
    root: str | Path,
    skipped: Any,
    text_fields: tuple[str, ...],
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[CodeDocument]:
    """The records of the saved dataset at ``root`` as documents, one at a time; blank or
    missing texts are appended to ``skipped`` (a list or :class:`comera.data.corpus.SkipLog`).

    Raises:
        ImportError: ``pyarrow`` is not installed. ValueError: a split without a text column (named).
    """
    try:
        arrow = importlib.import_module("pyarrow")
    except ImportError:
        raise ImportError(
            f"--data {root} is a dataset written by datasets.save_to_disk; reading it needs pyarrow: "
            f"{PARQUET_EXTRA}"
        ) from None
    done = 0
    rows: dict[str, int] = {}
    for split, file in saved_dataset_files(root):
        with arrow.memory_map(str(file)) as source:
            reader = arrow.ipc.open_stream(source)
            columns = reader.schema.names
            column = next((name for name in text_fields if name in columns), None)
            if column is None:
                fields = " or ".join(map(repr, text_fields))
                raise ValueError(
                    f"--data {root}: split {split!r} has no {fields} column (columns: {columns})"
                )
            for batch in reader:
                for text in batch.column(column).to_pylist():
                    row = rows.get(split, 0)
                    rows[split] = row + 1
                    key = f"{split}/{row}"
                    if isinstance(text, str) and text.strip():
                        yield CodeDocument(key, text)
                    else:
                        skipped.append(SkippedDocument(key, "empty"))
        done += file.stat().st_size
        if on_bytes is not None:
            on_bytes(done)
