"""The folders a run writes (``--out``, ``--cache``), made and checked before any data is read, and the lock
that keeps a second process from writing into a run folder while one trains in it."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path

__all__ = [
    "writable_folder",
    "lock_run_folder",
    "release_run_folder",
    "drop_if_only_locked",
    "missing_folders",
    "remove_empty_folders",
    "LOCK_NAME",
]

LOCK_NAME = ".comera.lock"
"""The file in a run folder that the process writing the run holds an exclusive ``flock`` on."""

_HELD: dict[Path, int] = {}


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


def _broken_link(path: Path) -> tuple[Path, str] | None:
    """The first of ``path`` and its parents that is a symbolic link leading nowhere (a loop, a missing
    target), with the system's reason, or None."""
    for candidate in reversed([path, *path.parents]):
        try:
            link = candidate.is_symlink()
        except OSError:  # a name the system refuses (too long): creating the folder says why
            return None
        if link:
            try:
                os.stat(candidate)
            except OSError as error:
                return candidate, error.strerror or str(error)
    return None


def writable_folder(path: Path, option: str) -> Path:
    """Create the folder ``path`` (with its parents) and check that a file can be written in it.

    Args:
        path: the folder.
        option: the command-line option naming it (``"--out"``), for the message.

    Returns:
        ``path``.

    Raises:
        ValueError: ``path`` or one of its parents is a file or a symbolic link leading nowhere, or the
            folder cannot be created or written (permissions, a read-only file system); the message names
            the option, the path and why.
    """
    broken = _broken_link(path)
    if broken is not None:
        link, reason = broken
        raise ValueError(f"{option} {path}: {link} is a symbolic link that leads nowhere ({reason})")
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


def lock_run_folder(path: Path) -> None:
    """Take the run folder ``path`` for this process (an exclusive ``flock`` on :data:`LOCK_NAME`, which the
    file names by process id) until :func:`release_run_folder`, or until the process ends, however it ends.

    Raises:
        ValueError: another process holds the folder (a run training there, or processes of a killed
            launcher that are still alive), or the lock file cannot be created; the message names the
            folder (and the process).
    """
    path = path.resolve()
    if path in _HELD:
        return
    lock = path / LOCK_NAME
    try:  # never through a link (it could lead to a file of the user's, which would be overwritten)
        handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as error:
        why = "a symbolic link" if error.errno == errno.ELOOP else error.strerror or error
        raise ValueError(
            f"--out {path}: cannot create or write its lock file {lock} ({why}); move it away"
        ) from None
    if not stat.S_ISREG(os.fstat(handle).st_mode):
        os.close(handle)
        raise ValueError(f"--out {path}: its lock file {lock} is not a regular file (a pipe?); move it away")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(handle, 32).decode(errors="replace").strip() or "unknown"
        os.close(handle)
        raise ValueError(
            f"--out {path} is in use by another process (pid {holder}) that is writing a run there: wait "
            "for it to finish, stop it, or choose another --out"
        ) from None
    os.ftruncate(handle, 0)
    os.write(handle, f"{os.getpid()}\n".encode())
    _HELD[path] = handle


def release_run_folder() -> None:
    """Release every run folder this process took with :func:`lock_run_folder` (the lock files stay)."""
    for handle in _HELD.values():
        os.close(handle)
    _HELD.clear()


def drop_if_only_locked(path: Path) -> None:
    """Remove the run folder ``path`` when it holds nothing but its lock file: what a command that made it
    and then stopped before the run started (bad settings, no data) would otherwise leave behind."""
    try:
        if [entry.name for entry in path.iterdir()] == [LOCK_NAME]:
            (path / LOCK_NAME).unlink()
            path.rmdir()
    except OSError:  # gone, not a folder, or taken by another process meanwhile: leave it
        return


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: the folders that creating
    ``path`` makes, for a command to remove again when it stops before writing anything in them."""
    missing = []
    for candidate in [path, *path.parents]:
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    return missing


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first, as :func:`missing_folders` gives them) while each is an empty
    folder; the first that is not (it holds something, or is gone) stops the removal."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return
