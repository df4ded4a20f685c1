"""Progress of the phases of a long data job (``comera prepare``): a ``tqdm`` bar with bytes/s and the time
left on a terminal, one line per phase otherwise (``encoding: 2.00 GB in 312.4 s (6.4 MB/s)``). Details:
docs/llm.md, 'Bringing a corpus' ('Progress').
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["Phase", "Progress", "format_bytes", "silent"]


def format_bytes(count: float) -> str:
    """``"2.00 GB"``, ``"512.0 MB"``, ``"3.4 kB"``, ``"12 B"`` (powers of 1000)."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if count >= size:
            return f"{count / size:.2f} {unit}" if unit == "GB" else f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


class Phase:
    """One phase of a :class:`Progress` (made by :meth:`Progress.phase`); a context manager whose end
    reports the phase."""

    def __init__(self, progress: Progress, name: str, total: int | None) -> None:
        self.name, self.total, self.position = name, total, 0
        self._progress = progress
        self._started = time.perf_counter()
        self._bar: Any = None
        if progress.bar:
            self._bar = tqdm(
                total=total,
                desc=name,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=progress.stream,
                dynamic_ncols=True,
                mininterval=0.5,
                leave=True,
            )

    def advance_to(self, position: int) -> None:
        """The phase got to ``position`` (bytes of its total)."""
        if position > self.position:
            if self._bar is not None:
                self._bar.update(position - self.position)
            self.position = position

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        seconds = time.perf_counter() - self._started
        if self._bar is not None:
            self._bar.close()
            self._progress.current = None
            return
        self._progress.current = None
        if exc_info[0] is not None:
            return
        rate = f" ({format_bytes(self.position / seconds)}/s)" if seconds > 0 and self.position else ""
        done = format_bytes(self.position) + " in " if self.position else ""
        self._progress.line(f"{self.name}: {done}{seconds:.1f} s{rate}")


class Progress:
    """Where a job's phases and lines go.

    Args:
        bar: show bars (a terminal); None decides by whether ``stream`` is a terminal.
        stream: where the bars go (standard error by default).
        write: how a line is printed when no bar is shown (default: ``print`` to standard output).
    """

    def __init__(
        self,
        bar: bool | None = None,
        stream: TextIO | None = None,
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if bar is None:
            bar = self.stream is not None and self.stream.isatty()
        self.bar = bool(bar)
        self._write = write or (lambda line: print(line, flush=True))
        self.current: Phase | None = None

    def phase(self, name: str, total: int | None = None) -> Phase:
        """Open the phase ``name`` of ``total`` bytes (None: unknown)."""
        self.current = Phase(self, name, total)
        return self.current

    def line(self, text: str) -> None:
        """Print ``text`` (above the bar, if one is shown)."""
        if self.bar and self.current is not None:
            tqdm.write(text, file=sys.stdout)
        else:
            self._write(text)


def silent() -> Progress:
    """A :class:`Progress` that shows and prints nothing."""
    return Progress(bar=False, write=lambda line: None)
