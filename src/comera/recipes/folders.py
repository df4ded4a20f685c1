"""The folders a run writes (``--out``, ``--cache``), made and checked before any data is read."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["writable_folder"]


def _file_on_the_way(path: Path) -> Path | None:
    """The first of ``path`` and its parents that exists but is not a folder, or None (also when one cannot
    be looked at, e.g. a name too long: creating the folder then fails and says why)."""
    for candidate in reversed([path, *path.parents]):
        try:
            if candidate.exists() and not candidate.is_dir():
                return candidate
        except OSError:
            return None
    return None


def writable_folder(path: Path, option: str) -> Path:
    """Create the folder ``path`` (with its parents) and check that a file can be written in it.

    Args:
        path: the folder.
        option: the command-line option naming it (``"--out"``), for the message.

    Returns:
        ``path``.

    Raises:
        ValueError: ``path`` or one of its parents is a file, or the folder cannot be created or written
            (permissions, a read-only file system); the message names the option, the path and why.
    """
    blocker = _file_on_the_way(path)
    if blocker == path:
        raise ValueError(f"{option} {path} is a file, not a folder")
    if blocker is not None:
        raise ValueError(f"{option} {path}: {blocker} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(
            f"{option} {path}: cannot create or write to it ({error.strerror or error})"
        ) from None
    return path
