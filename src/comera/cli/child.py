"""Run a command in a child process so that a Ctrl-C stops both as cleanly as one process stops: the child
stops in its own way (one line, status :data:`INTERRUPTED`) and :func:`run_child` waits for it before the
caller reports the interruption (docs/architecture.md, "Processes")."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence

__all__ = [
    "INTERRUPTED",
    "INTERRUPTED_WHILE_STARTING",
    "LAUNCH_INTERRUPTED",
    "LAUNCH_STOPPING",
    "STATUS_ENV",
    "GRACE_S",
    "QUIET_START",
    "module_command",
    "run_child",
    "interrupt_handled",
    "wait_regardless",
]

INTERRUPTED = 130
"""The exit status of a run stopped by Ctrl-C (SIGINT), as a shell reports one."""

STATUS_ENV = "COMERA_STATUS_DIR"
"""The environment variable naming the folder where the processes of a ``--nproc`` launch record their
exit statuses."""
LAUNCH_STOPPING = "stopping"
"""The file the launcher of a ``--nproc`` launch writes in the :data:`STATUS_ENV` folder when a Ctrl-C came
before any of its processes registered: a process that starts from then on ends at once."""

LAUNCH_INTERRUPTED = "interrupted"
"""The file the launcher of a ``--nproc`` launch writes in the :data:`STATUS_ENV` folder before it passes a
Ctrl-C on to its processes: a process whose collective call fails because another one stopped first then
knows that the run was interrupted, and stops as an interrupted process does."""

INTERRUPTED_WHILE_STARTING = "comera: interrupted while starting; nothing was written"
"""The line a command stopped by a Ctrl-C before it did anything prints (:mod:`comera.cli.startup`, and the
launcher of a ``--nproc`` run whose processes had not started their run yet)."""

GRACE_S = 5.0
"""Seconds a child is given to stop on the SIGINT it got from the terminal before it is sent one (a SIGINT
sent to the parent alone, with ``kill``)."""


QUIET_START = (
    "import runpy, sys\n"
    "module = sys.argv.pop(1)\n"
    "try:\n"
    "    from comera.cli.startup import quiet_start\n"
    "    quiet_start()\n"
    "    runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
    "except KeyboardInterrupt:\n"
    f"    sys.exit({INTERRUPTED})\n"
)
"""Runs a module as ``python -m`` does, but a Ctrl-C that comes before the module's own handling of it (while
it imports torch, say) ends the process with :data:`INTERRUPTED` instead of a traceback."""


def module_command(module: str, arguments: Sequence[str]) -> list[str]:
    """The command that runs ``python -m module ARGUMENTS`` in this Python, quiet on an early Ctrl-C
    (:data:`QUIET_START`)."""
    return [sys.executable, "-c", QUIET_START, module, *arguments]


def run_child(command: Sequence[str]) -> int:
    """Run ``command`` and return its exit status.

    Raises:
        KeyboardInterrupt: a Ctrl-C came while it ran, and the child has stopped since.
    """
    process = subprocess.Popen(list(command))
    try:
        return process.wait()
    except KeyboardInterrupt:
        _wait_out(process)
        raise


def _wait_out(process: subprocess.Popen) -> None:
    """Wait for an interrupted child to stop; send it SIGINT if it has not after :data:`GRACE_S`."""
    try:
        process.wait(timeout=GRACE_S)
        return
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
    except KeyboardInterrupt:  # a second Ctrl-C, which the child got too
        pass
    wait_regardless(process)


def wait_regardless(process: subprocess.Popen) -> int:
    """Wait for ``process`` to end, through any Ctrl-C meanwhile; its exit status."""
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def interrupt_handled() -> None:
    """Call where a ``KeyboardInterrupt`` has been handled: CPython 3.11 remembers one raised in ``exec``'d
    code (a dataclass built during an import) as unhandled and kills the process with SIGINT at exit (status
    -2, a failed ``torchrun`` process); running ``exec`` once more on code that finishes clears that."""
    exec("pass")
