"""A prepared corpus on disk: ``index.json``, ``tokenizer.json`` and token shards (flat little-endian
``uint16`` or ``uint32`` arrays, each document followed by the end-of-document id); a shard whose size or
SHA-256 differs from its entry is never read. Details: docs/llm.md, 'Bringing a corpus' ('The folder').
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from comera.atomic import fsync_directory
from comera.data.sources import SKIP_REASONS

__all__ = [
    "split_counts",
    "INDEX_FILE",
    "INDEX_FORMAT",
    "SPLITS",
    "TOKENIZER_FILE",
    "ShardWriter",
    "file_sha256",
    "is_prepared",
    "open_shard",
    "read_index",
    "shard_name",
    "shard_problem",
    "token_dtype",
]

INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
INDEX_FORMAT = 1
"""The version of ``index.json``'s layout; another one is refused by name."""
SPLITS = ("train", "validation")
_READ_CHUNK = 2**22


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of a ``vocab_size``-token vocabulary fits (``vocab_size <= 65536``), else
    ``uint32``; little-endian either way."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def shard_name(split: str, number: int) -> str:
    """``train-00003.bin``: the file name of shard ``number`` of ``split``."""
    return f"{split}-{number:05d}.bin"


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a folder holding an ``index.json`` (a prepared corpus)."""
    return path is not None and (Path(path) / INDEX_FILE).is_file()


def read_index(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``index.json`` of ``folder``, checked for the keys the readers use.

    Raises:
        FileNotFoundError: there is none. ValueError: it is not JSON, has another format version, or lacks a
            key (the message names the folder and what is wrong).
    """
    path = Path(folder) / INDEX_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no index; prepare the corpus with comera prepare") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a JSON index ({error}); prepare the corpus again") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ValueError(f"{path}: index format {found!r}, this comera reads format {INDEX_FORMAT}")
    missing = [key for key in ("dtype", "eos_id", "pad_id", "splits", "tokenizer") if key not in index]
    missing += [split for split in SPLITS if split not in index.get("splits", {})]
    if missing:
        raise ValueError(f"{path}: the index lacks {missing}; prepare the corpus again")
    return index


def split_counts(index: dict[str, Any], split: str) -> dict[str, int]:
    """``{"read": documents}`` of ``split`` in a prepared corpus's ``index``, plus ``"skipped"`` and
    ``"skipped_<reason>"`` for each of :data:`comera.data.sources.SKIP_REASONS` where the index counts the
    split's skipped records (indexes written since 2026-12-05)."""
    recorded = index["splits"][split]
    counts = {"read": recorded["documents"]}
    if isinstance(recorded.get("skipped"), dict):
        by_reason = recorded["skipped"]
        counts["skipped"] = sum(by_reason.values())
        counts.update({f"skipped_{reason}": by_reason.get(reason, 0) for reason in SKIP_REASONS})
    return counts


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a file's bytes, read in 4 MiB pieces."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def shard_problem(folder: str | os.PathLike, entry: dict[str, Any], *, hash_bytes: bool = True) -> str | None:
    """What is wrong with the shard of index entry ``entry`` in ``folder`` (missing, another size, another
    SHA-256), or None when it matches; ``hash_bytes=False`` compares the size only."""
    path = Path(folder) / entry["name"]
    try:
        size = path.stat().st_size
    except OSError as error:
        return f"{entry['name']} cannot be read ({error.strerror})"
    if size != entry["bytes"]:
        return f"{entry['name']} holds {size:,} bytes, the index records {entry['bytes']:,}"
    if hash_bytes and file_sha256(path) != entry["sha256"]:
        return f"{entry['name']}'s SHA-256 differs from the one the index records (its bytes changed)"
    return None


def open_shard(folder: str | os.PathLike, entry: dict[str, Any], dtype: np.dtype) -> np.ndarray:
    """The shard of ``entry`` as a read-only ``numpy.memmap`` of ``(entry["tokens"],)`` ids of ``dtype``
    (an empty array for an empty shard, which ``numpy.memmap`` cannot map)."""
    if entry["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(Path(folder) / entry["name"], dtype=dtype, mode="r", shape=(entry["tokens"],))


class ShardWriter:
    """One shard written atomically: the ids go to a hidden temporary file, hashed as they are written;
    :meth:`close` syncs it and renames it into place, :meth:`abort` deletes it.

    Args:
        folder: the prepared corpus's folder.
        name: the shard's file name.
        dtype: the ids' type (:func:`token_dtype`).
        first_document: the split's documents before this shard.
    """

    def __init__(self, folder: Path, name: str, dtype: np.dtype, first_document: int) -> None:
        self.folder, self.name, self.dtype = folder, name, dtype
        self.first_document = first_document
        self.tokens = 0
        self.documents = 0
        self._digest = hashlib.sha256()
        self._temporary = folder / f".{name}.{uuid.uuid4().hex}.tmp"
        self._file = open(self._temporary, "wb")  # noqa: SIM115 (closed by close or abort)

    def write(self, ids: np.ndarray, documents: int) -> None:
        """Append ``ids`` (``(n,)``, cast to the shard's type), which end ``documents`` documents."""
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._digest.update(data)
        self.tokens += int(ids.size)
        self.documents += documents

    def close(self) -> dict[str, Any]:
        """Sync and rename the shard into place; returns its index entry."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temporary, self.folder / self.name)
        fsync_directory(self.folder)
        return {
            "name": self.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "first_document": self.first_document,
            "bytes": self.tokens * self.dtype.itemsize,
            "sha256": self._digest.hexdigest(),
        }

    def abort(self) -> None:
        """Delete the temporary file; nothing is renamed into place."""
        self._file.close()
        self._temporary.unlink(missing_ok=True)
