"""How a ``comera`` command process starts and stops: :func:`quiet_start`, which only the entry points
call (the console script, ``python -m comera``, a child of :func:`comera.cli.child.module_command`), makes
a Ctrl-C while torch imports end the command in one line with status 130, joins a ``--nproc`` launch and
lets the output's reader leave; ``import comera`` runs none of it (docs/architecture.md, "Processes")."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from comera.cli.child import (
    INTERRUPTED,
    INTERRUPTED_WHILE_STARTING,
    LAUNCH_STOPPING,
    STATUS_ENV,
)
from comera.cli.output import drop_output_once_unread
from comera.process import stop_with_parent

__all__ = [
    "quiet_start",
    "interrupts_raise",
    "interrupts_ignored",
    "join_launch",
    "interrupts_passed_on",
]

_LINE = f"{INTERRUPTED_WHILE_STARTING}\n".encode()
_REDELIVERY_DELAY_S = 0.01


def _stop_at_once(signum: int, frame: object) -> None:
    os.write(2, _LINE)
    os._exit(INTERRUPTED)


def quiet_start() -> None:
    """Make a Ctrl-C end the command at once while it starts, join a ``--nproc`` launch, and let the
    output's reader leave; nothing outside the main thread, and no Ctrl-C handler where one other than
    Python's is installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    join_launch()
    drop_output_once_unread()
    sys.unraisablehook = interrupts_passed_on(sys.unraisablehook)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop_at_once)


def interrupts_passed_on(previous: Callable[[Any], object]) -> Callable[[Any], None]:
    """A ``sys.unraisablehook`` that delivers a ``KeyboardInterrupt`` raised where Python cannot raise it (a
    weak reference's callback, a ``__del__``) again to the main thread a moment later, instead of printing
    and losing it; every other unraisable exception goes to ``previous``."""

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
            return
        redelivery = threading.Timer(_REDELIVERY_DELAY_S, _thread.interrupt_main)
        redelivery.daemon = True
        with contextlib.suppress(RuntimeError):  # no new thread while the interpreter shuts down
            redelivery.start()

    return hook


def join_launch() -> None:
    """In a process of a ``--nproc`` launch (:data:`STATUS_ENV` and ``RANK`` set): stop when ``torchrun``
    dies, and end at once, quietly, when the launch is already stopping; nothing otherwise."""
    folder = os.environ.get(STATUS_ENV)
    if not folder or "RANK" not in os.environ:
        return
    stop_with_parent()
    if (Path(folder) / LAUNCH_STOPPING).exists() or not Path(folder).is_dir():
        os._exit(0)


def interrupts_raise() -> None:
    """From here on a Ctrl-C raises ``KeyboardInterrupt`` again (Python's handler), for a command that
    handles it; nothing where :func:`quiet_start` did not install its handler."""
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) is _stop_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Ignore a Ctrl-C inside the block (also one that came just before it), for the lines that report an
    interruption; the handler of before is restored after it; nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
