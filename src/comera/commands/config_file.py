"""``--config`` given as a stream (bash's ``<(...)``, a named pipe): read once, kept as a file.

A run reads its TOML settings more than once (the parent process to pick the device, the run itself, the
processes of ``--nproc`` or the fresh processes of ``comera compare``), and a stream can be read only once:
the second reader would find it empty and train silently without the settings. :func:`config_argument`, the
``type`` of the ``--config`` option, copies a stream into a private file when the command line is parsed and
gives that file's path to every later reader; the file is deleted when the process exits.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["config_argument"]


def config_argument(value: str) -> str:
    """``value`` itself for a regular file, a folder or a missing path (their readers say what is wrong);
    for anything else that can be read (a pipe, a character device), the path of a private copy of what it
    held."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path; name a TOML file")
    path = Path(value)
    if not path.exists() or path.is_file() or path.is_dir():
        return value
    content = path.read_bytes()
    folder = tempfile.mkdtemp(prefix="comera-config-")
    atexit.register(shutil.rmtree, folder, True)
    copy = Path(folder) / "config.toml"
    copy.write_bytes(content)
    os.chmod(copy, 0o600)
    return str(copy)
