"""Atomic writes of a file (temporary file, fsync, ``os.replace``, folder fsync) or of a set of files that
must change together (a new folder swapped in), so a reader sees either the old files or the complete new
ones, even if the writer is killed. Details: docs/internals.md, "Atomic writes"."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_replace_folder",
    "fsync_directory",
    "install_folder",
    "remove_stale_temporaries",
]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# the names this module gives its temporaries: .NAME.<uuid hex>.tmp (files and staging folders) and
# .NAME.<mkdtemp suffix>.old (a replaced folder set aside)
_TEMPORARY = re.compile(r"\..+\.([0-9a-f]{32}\.tmp|[a-z0-9_]{8}\.old)")


def fsync_directory(directory: str | os.PathLike) -> None:
    """Flush ``directory``'s entries (a rename or a new file in it) to disk."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create or replace ``path`` with what ``write(file)`` writes to a binary file object; returns the path.
    The parent is created if missing, a new file gets ``open``'s permission bits and a replaced one keeps its
    own; on any error ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # 0o666 less the umask, as open() gives a new file; a replaced file keeps its own permission bits
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as file:
            if path.exists():
                os.fchmod(file.fileno(), stat.S_IMODE(path.stat().st_mode))
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """:func:`atomic_write` of a bytes payload."""
    return atomic_write(path, lambda file: file.write(data))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    return result == 0


def atomic_replace_folder(directory: str | os.PathLike, files: Mapping[str, bytes]) -> Path:
    """Make ``directory`` hold ``files`` (``{file name: content}``) in one step, by a new folder beside it
    exchanged atomically (docs/internals.md, "Atomic writes"); returns it as a ``Path``, unchanged on an error
    before the exchange."""
    directory = Path(directory)
    if directory.is_symlink():  # replace the folder the link points to, keep the link
        directory = directory.resolve()
    for name in files:
        if name in ("", ".", "..") or Path(name).name != name:
            raise ValueError(f"files must map plain file names to bytes, got name {name!r}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.{uuid.uuid4().hex}.tmp"
    staging.mkdir()  # the process's umask applies, as for a folder made by mkdir
    try:
        if directory.is_dir():
            shutil.copymode(directory, staging)
            for entry in directory.iterdir():
                if entry.name in files:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=_link_or_copy)
                elif entry.is_symlink():
                    os.symlink(os.readlink(entry), staging / entry.name)
                else:
                    _link_or_copy(str(entry), str(staging / entry.name))
        elif directory.exists():
            raise NotADirectoryError(f"{directory} exists and is not a folder")
        for name, data in files.items():
            with open(staging / name, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return install_folder(staging, directory)


def install_folder(staging: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """Put the completely written folder ``staging`` (beside ``directory``, in the same parent) in place of
    ``directory`` in one step (synced, renamed or exchanged, the old folder deleted, the parent synced);
    returns ``directory`` as a ``Path``; on an error ``staging`` is removed and ``directory`` is unchanged."""
    staging, directory = Path(staging), Path(directory)
    try:
        fsync_directory(staging)
        if not directory.exists():
            os.rename(staging, directory)
            staging = None
        elif not _exchange(staging, directory):
            _swap_aside(directory, staging)
            staging = None
    finally:
        if staging is not None:  # the old folder after an exchange, or the new one after an error
            shutil.rmtree(staging, ignore_errors=True)
    fsync_directory(directory.parent)
    return directory


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files and folders that writes of this module left in ``directory`` (not in its
    sub-folders) when their process was killed; returns the paths deleted. Call it only while no write into
    ``directory`` is running (for a run folder: before training starts)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        if not _TEMPORARY.fullmatch(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _swap_aside(directory: Path, staging: Path) -> None:
    """Rename ``directory`` aside, ``staging`` in its place, then delete the old one (restored on failure)."""
    aside = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".old"))
    try:
        os.rename(directory, aside / "old")
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.rename(staging, directory)
    except BaseException:
        os.rename(aside / "old", directory)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
