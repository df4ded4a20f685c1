"""``comera train --nproc N ...``: N processes of ``comera train ...`` on this machine under ``torchrun``
(``torchrun --standalone --nproc-per-node N -m comera train ...`` with this Python); each process records
its exit status for the launcher, and the launcher passes a Ctrl-C on to them (docs/architecture.md,
"Processes")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from comera.cli.child import (
    INTERRUPTED,
    INTERRUPTED_WHILE_STARTING,
    LAUNCH_INTERRUPTED,
    LAUNCH_STOPPING,
    STATUS_ENV,
    wait_regardless,
)
from comera.process import stop_with_parent

__all__ = [
    "STATUS_ENV",
    "INTERRUPTED",
    "split_nproc",
    "without_option",
    "torchrun_command",
    "launch",
    "register_worker",
    "worker_finished",
    "worker_status",
    "launch_interrupted",
]

PROCESSES_PER_CORE = 4
"""The most ``--nproc`` processes per usable CPU core: a few share a core well enough for trying out a
multi-process run on a laptop; thousands (a typo) would start a process each and stall the machine."""


def split_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """``(N, the other arguments)`` from arguments that may hold ``--nproc N`` or ``--nproc=N``.

    Raises:
        ValueError: ``--nproc`` without a value, or a value that is not an integer in ``[1,
            PROCESSES_PER_CORE * usable_cores()]``.
    """
    rest: list[str] = []
    nproc: str | None = None
    arguments = iter(argv)
    for argument in arguments:
        if argument == "--nproc":
            nproc = next(arguments, None)
            if nproc is None:
                raise ValueError("--nproc needs a value: the number of processes, an integer >= 1")
        elif argument.startswith("--nproc="):
            nproc = argument.split("=", 1)[1]
        else:
            rest.append(argument)
    if nproc is None:
        return None, rest
    cores = usable_cores()
    most = PROCESSES_PER_CORE * cores
    if not (nproc.isascii() and nproc.isdigit()) or not 1 <= int(nproc) <= most:
        raise ValueError(
            f"--nproc must be an integer in [1, {most}] (the number of processes; at most "
            f"{PROCESSES_PER_CORE} per core of the {cores} this machine gives the command), got {nproc!r}"
        )
    return int(nproc), rest


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option VALUE`` and ``option=VALUE`` (every occurrence)."""
    rest: list[str] = []
    arguments = iter(argv)
    for argument in arguments:
        if argument == option:
            next(arguments, None)
        elif not argument.startswith(f"{option}="):
            rest.append(argument)
    return rest


def torchrun_command(nproc: int, command: list[str]) -> list[str]:
    """The ``torchrun`` command line that runs ``python -m comera COMMAND...`` in ``nproc`` processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "comera",
        *command,
    ]


def launch(nproc: int, command: list[str]) -> int:
    """Run :func:`torchrun_command` and return its exit status (non-zero when any process failed), or, when
    every process exited 0, the highest status they recorded (:func:`worker_status`); :data:`INTERRUPTED`
    after a Ctrl-C."""
    with tempfile.TemporaryDirectory(prefix="comera-status-") as folder:
        try:
            process = subprocess.Popen(
                torchrun_command(nproc, command),
                env={**os.environ, STATUS_ENV: folder},
                start_new_session=True,
                preexec_fn=_torchrun_stops_with_the_launcher,
            )
        except KeyboardInterrupt:  # a torchrun that started dies with this process (its parent-death signal)
            print(INTERRUPTED_WHILE_STARTING, file=sys.stderr)
            return INTERRUPTED
        code, interrupted = _wait_for(process, Path(folder))
        recorded = [int(path.read_text()) for path in Path(folder).glob("rank-*")]
    if interrupted:
        return INTERRUPTED
    return code if code != 0 or not recorded else max(recorded)


def _torchrun_stops_with_the_launcher() -> None:
    """``torchrun`` gets SIGKILL when the launcher dies (killed itself): on SIGTERM it would print a
    traceback of its own; its processes stop with it (:func:`comera.cli.startup.join_launch`)."""
    stop_with_parent(signal.SIGKILL)


def _worker_pids(folder: Path) -> list[int]:
    pids = []
    for path in folder.glob("pid-*"):
        try:
            pids.append(int(path.read_text()))
        except (OSError, ValueError):  # being written
            continue
    return pids


def _wait_for(process: subprocess.Popen, folder: Path) -> tuple[int, bool]:
    """``process``'s exit status, and whether a Ctrl-C came meanwhile. The first Ctrl-C goes to the processes
    registered in ``folder`` (each stops as a single process does), a later one to ``torchrun``; either way
    the launch is waited out, instead of leaving processes behind. A first Ctrl-C before any process
    registered ends the launch at once (:func:`_stop_while_starting`). A Ctrl-C after every process
    finished its run (:func:`worker_finished`; the teardown of the process group is left) is not passed on:
    the run is complete and the launch ends by itself."""
    interrupted = False
    while True:
        try:
            return process.wait(), interrupted
        except KeyboardInterrupt:
            if interrupted:
                process.send_signal(signal.SIGINT)
                continue
            if _run_is_over(folder):
                continue
            pids = _worker_pids(folder)
            if not pids:
                _stop_while_starting(process, folder)
                return INTERRUPTED, True
            interrupted = True
            (folder / LAUNCH_INTERRUPTED).write_text("")
            _signal_all(pids, signal.SIGINT)
            try:
                return process.wait(timeout=STOP_GRACE_S), interrupted
            except subprocess.TimeoutExpired:  # one waits on the other in a collective it will not join
                _signal_all(pids, signal.SIGTERM)


def _stop_while_starting(process: subprocess.Popen, folder: Path) -> None:
    """End a launch none of whose processes has registered: mark it as stopping (a process that starts from
    now on ends at once, :func:`comera.cli.startup.join_launch`), kill ``torchrun`` (the processes it started
    get SIGTERM with its death) and say so in one line."""
    (folder / LAUNCH_STOPPING).write_text("")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    wait_regardless(process)
    print(INTERRUPTED_WHILE_STARTING, file=sys.stderr)


STOP_GRACE_S = 20.0
"""Seconds the processes of a ``--nproc`` launch have to stop on a Ctrl-C; then those still running (one
left waiting in a collective or in the rendezvous for a process that has stopped) get SIGTERM."""


def _signal_all(pids: list[int], number: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            continue


def register_worker() -> None:
    """Under a ``--nproc`` launch, record this process's pid for the launcher, which passes a Ctrl-C on to
    it; nothing otherwise."""
    folder = os.environ.get(STATUS_ENV)
    if folder:
        rank = os.environ.get("RANK", "0")
        (Path(folder) / f"pid-{rank}").write_text(str(os.getpid()))


def worker_finished() -> None:
    """Under a ``--nproc`` launch, tell the launcher that this process's run is over (only the teardown of
    the process group is left, a few seconds), so that a Ctrl-C then stops nothing; nothing otherwise."""
    folder = os.environ.get(STATUS_ENV)
    if folder:
        rank = os.environ.get("RANK", "0")
        (Path(folder) / f"finished-{rank}").write_text("")


def _run_is_over(folder: Path) -> bool:
    """Whether every registered process of the launch has finished its run (:func:`worker_finished`)."""
    registered = {path.name.removeprefix("pid-") for path in folder.glob("pid-*")}
    finished = {path.name.removeprefix("finished-") for path in folder.glob("finished-*")}
    return bool(registered) and registered <= finished


def launch_interrupted() -> bool:
    """Whether this process belongs to a ``--nproc`` launch that a Ctrl-C is stopping (the launcher marks it
    before it passes the Ctrl-C on): the processes do not get it at the same instant, so one may see a
    collective call fail because another stopped first."""
    folder = os.environ.get(STATUS_ENV)
    return bool(folder) and (Path(folder) / LAUNCH_INTERRUPTED).exists()


def worker_status(code: int) -> int:
    """The exit status for a process that ends with ``code`` after reporting why: under a ``--nproc`` launch
    a non-zero ``code`` is recorded for the launcher and 0 returned (so that ``torchrun`` adds no report of
    its own); otherwise ``code``."""
    folder = os.environ.get(STATUS_ENV)
    if code == 0 or not folder:
        return code
    rank = os.environ.get("RANK", "0")
    (Path(folder) / f"rank-{rank}").write_text(str(code))
    return 0
