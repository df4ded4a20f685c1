"""The output of a ``comera`` command whose reader leaves (``comera train ... | head -3``): what is left to
print is dropped, and the command finishes its work and exits with its own status.

Python raises ``BrokenPipeError`` at the first write to a pipe whose reader has gone, wherever the write
happens (a run's summary, after training; a log line of ``comera compare``, between two runs): a traceback,
status 1, and the work after that line undone. :func:`drop_output_once_unread` wraps ``sys.stdout`` and
``sys.stderr`` so that such a write instead points the stream's file descriptor at ``os.devnull`` (so that
the flush at exit does not fail again) and is dropped.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

__all__ = ["UnreadStream", "drop_output_once_unread"]


class UnreadStream:
    """A text stream that forwards to ``stream`` until a write or flush finds its reader gone, then drops
    everything (its descriptor then leads to ``os.devnull``). Every other attribute is ``stream``'s."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()

    def _silence(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def drop_output_once_unread() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` in :class:`UnreadStream` (once; a stream without a file
    descriptor, such as a test's capture, is left as it is)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, UnreadStream):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        setattr(sys, name, UnreadStream(stream))
