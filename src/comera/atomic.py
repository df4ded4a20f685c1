"""Atomic file writes: a temporary file in the target folder, fsync, ``os.replace``, then a folder fsync.

A reader (or a resumed run) sees either the old file or the complete new one, never a partial write, even
if the process is killed mid-write.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_bytes"]


def _fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create or replace ``path`` with what ``write(file)`` writes to a binary file object; returns the path.

    The parent folder is created if missing. On any error the temporary file is removed and ``path`` is left
    as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write` of a bytes payload."""
    return atomic_write(path, lambda file: file.write(data))
