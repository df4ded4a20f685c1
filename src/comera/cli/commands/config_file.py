"""``--config`` given as a stream (bash's ``<(...)``, a named pipe): copied once into a private file (deleted
at exit) when the command line is parsed, so that every later reader (the run, its processes, ``comera
compare``'s fresh processes) reads the same settings. Details: docs/recipes.md, 'Settings'.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
from pathlib import Path

from comera.cli.commands.paths import path_argument

__all__ = ["MAX_STREAM_BYTES", "config_argument"]

MAX_STREAM_BYTES = 2**20
"""The most a ``--config`` stream may hold (a TOML file of settings is a few hundred bytes); reading stops
there, so an endless stream (``/dev/zero``) is refused instead of filling the memory."""


def config_argument(value: str) -> str:
    """``value`` itself for a regular file, a folder or a missing path (their readers say what is wrong);
    for anything else that can be read (a pipe, a character device), the path of a private copy of what it
    held, at most :data:`MAX_STREAM_BYTES`."""
    path = Path(path_argument(value))
    if not path.exists() or path.is_file() or path.is_dir():
        return value
    with path.open("rb") as stream:
        content = stream.read(MAX_STREAM_BYTES + 1)
    if len(content) > MAX_STREAM_BYTES:
        raise argparse.ArgumentTypeError(
            f"{value} streams more than {MAX_STREAM_BYTES // 2**20} MiB, so it is no settings file (a device "
            "like /dev/urandom?); give a TOML file"
        )
    folder = tempfile.mkdtemp(prefix="comera-config-")
    atexit.register(shutil.rmtree, folder, True)
    copy = Path(folder) / "config.toml"
    copy.write_bytes(content)
    os.chmod(copy, 0o600)
    return str(copy)
