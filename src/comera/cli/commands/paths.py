"""Path arguments of the ``comera`` commands, checked as argparse reads them: an empty value and a name the
file system cannot hold are refused in one line, before any command touches the path."""

from __future__ import annotations

import argparse
import os

__all__ = ["path_argument", "path_problem", "run_folder_argument", "RUN_FOLDER_HEADROOM"]

_NAME_MAX = 255
"""The longest name of one path component, in bytes, that Linux, macOS and Windows file systems take."""
_PATH_MAX = 4096
"""The longest path, in bytes, that Linux system calls take."""


RUN_FOLDER_HEADROOM = 128
"""Bytes a run folder's path must leave for what comera writes inside it (the longest:
``checkpoints/.step-NNNNNNNN.pt.<32 hex>.tmp`` and the plots' names)."""


def path_problem(value: str, headroom: int = 0) -> str | None:
    """What makes ``value`` unusable as a path before any file is looked at (empty, a component longer than
    255 bytes, the whole, made absolute, longer than 4095 bytes less ``headroom``), or None."""
    if not value.strip():
        return "an empty path; name a file or folder"
    encoded = os.fsencode(os.path.abspath(value)) if headroom else os.fsencode(value)
    if len(encoded) + headroom >= _PATH_MAX:
        room = "" if not headroom else f", less {headroom} for the files a run folder holds"
        return f"a path of {len(encoded):,} bytes; the system takes paths of at most {_PATH_MAX - 1:,}{room}"
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > _NAME_MAX:
        shown = os.fsdecode(longest[:24])
        return (
            f"a name of {len(longest):,} bytes ({shown}...) in the path; a file or folder name holds at most "
            f"{_NAME_MAX} bytes"
        )
    return None


def _checked(value: str, headroom: int) -> str:
    problem = path_problem(value, headroom)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def path_argument(value: str) -> str:
    """A path option's value as given, refused (argparse's one-line error) when :func:`path_problem` finds
    something: an empty one (``--out ''``, an unset shell variable) is not read as the current folder or the
    default, and an over-long name does not become a traceback of the first system call."""
    return _checked(value, 0)


def run_folder_argument(value: str) -> str:
    """:func:`path_argument` for a run folder: its absolute path must also leave
    :data:`RUN_FOLDER_HEADROOM` bytes for the files comera writes in it, or the run would end, after
    training, in ``File name too long``; nor can it be the file system's root (a run's files would be
    written there, and ``--restart`` could not name the folder it moves them to)."""
    absolute = os.path.abspath(value) if value.strip() else ""
    if absolute and os.path.dirname(absolute) == absolute:
        raise argparse.ArgumentTypeError(f"{value!r} is the file system's root; name a folder for the run")
    return _checked(value, RUN_FOLDER_HEADROOM)
