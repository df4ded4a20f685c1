"""Entries of the cache folder (``--cache``): files and folders derived from a run's data, named by a digest
of what they came from and written atomically; an entry that cannot be read is a cache miss (a
``RuntimeWarning``, then rebuilt in place). Details: docs/recipes.md, 'Resuming and restarting a run'.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from comera.atomic import install_folder

__all__ = ["read_entry", "building_folder", "read_json"]

T = TypeVar("T")


def read_entry(path: Path, read: Callable[[Path], T], *, folder: bool = False) -> T | None:
    """``read(path)`` of the cache entry ``path`` (a folder if ``folder``, else a file); None where there is
    none or where ``read`` fails (damaged: a warning names it and the caller rebuilds it), so ``read`` must
    only read and parse, the caller's setting checks coming after it.

    Raises:
        ValueError: ``path`` is a folder where a file belongs, or the reverse (it is not replaced).
    """
    if not os.path.lexists(path):
        return None
    if path.is_dir() != folder:
        kind = "folder" if folder else "file"
        raise ValueError(f"cache entry {path} is not a {kind}, so it cannot be rebuilt; delete it")
    odd = _irregular(path, folder)
    if odd is not None:  # reading a pipe would wait forever
        message = f"cache entry {path} is damaged and is rebuilt from the data ({odd} is not a regular file)"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return None
    try:
        return read(path)
    except Exception as error:  # whatever the reader's library raises: zipfile, numpy, tokenizers (Exception)
        message = f"cache entry {path} is damaged and is rebuilt from the data ({error})"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return None


def _irregular(path: Path, folder: bool) -> Path | None:
    """The entry itself, or (for a folder) the first thing in it, that is neither a regular file nor a
    folder once links are followed: a pipe, a device, a socket, a broken or looping link; None if none."""
    for entry in [path, *(sorted(path.rglob("*")) if folder else ())]:
        if not (entry.is_file() or entry.is_dir()):
            return entry
    return None


@contextmanager
def building_folder(path: Path) -> Iterator[Path]:
    """A new empty folder beside the folder entry ``path`` to write the entry into; when the block ends
    without an error it is put in place of ``path`` in one step (:func:`comera.atomic.install_folder`: a
    damaged entry is replaced, one that another process put there meanwhile is kept); it is removed in any
    case."""
    work = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
        try:
            install_folder(work, path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def read_json(file: Path) -> Any:
    """The JSON value in ``file`` (a file of a cache entry); ``ValueError`` naming it where it holds none."""
    try:
        return json.loads(file.read_bytes())
    except ValueError as error:
        raise ValueError(f"{file} is not JSON: {error}") from None
