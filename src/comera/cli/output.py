"""The output of a ``comera`` command that cannot be delivered (its reader left, ``| head -3``; a full disk)
is dropped, and the command finishes its work with its own status: :func:`drop_output_once_unread` wraps
``sys.stdout`` and ``sys.stderr`` (docs/architecture.md, "Processes")."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["UnreadStream", "drop_output_once_unread"]


class UnreadStream:
    """A text stream that forwards to ``stream`` until a write or flush fails (its reader gone, its disk
    full), then drops everything (its descriptor then leads to ``os.devnull``). ``name`` names the stream
    in the one line said about a failure other than a reader that left, on ``other`` (a callable that
    gives the other stream, or None). Every other attribute is ``stream``'s."""

    def __init__(self, stream: TextIO, name: str = "output", other: Callable[[], Any] | None = None) -> None:
        self._stream = stream
        self._name = name
        self._other = other

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            self._drop(error)
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            self._drop(error)

    def _drop(self, error: OSError) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        other = None if self._other is None else self._other()
        if other is not None and not isinstance(error, BrokenPipeError):
            reason = error.strerror or str(error)
            other.write(f"comera: {self._name} cannot be written ({reason}); what is left of it is dropped\n")
            other.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def drop_output_once_unread() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`UnreadStream` (once; a stream without a file
    descriptor, such as a test's capture, is left as it is); a failure of stdout is said on stderr (one of
    stderr goes unsaid: stdout may be data a program reads)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, UnreadStream):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        said_on = (lambda: sys.stderr) if name == "stdout" else None
        setattr(sys, name, UnreadStream(stream, name, said_on))
