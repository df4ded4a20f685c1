"""Ask Linux to stop this process when its parent dies: ``torchrun`` and its processes use it so that none
of them is left training (and writing a run folder) once the one that started it is gone."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["stop_with_parent"]

_PR_SET_PDEATHSIG = 1


def stop_with_parent(number: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process the signal ``number`` (default SIGTERM) when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``): ``torchrun`` starts its processes in sessions of their own, so a
    launcher killed with SIGKILL would otherwise leave them training, and writing the run folder, on their
    own. Nothing happens on other systems."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, number)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os.kill(os.getpid(), number)
