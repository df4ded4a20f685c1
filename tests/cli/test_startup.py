"""A Ctrl-C while the comera command starts (importing torch) ends it in one line with status 130; a
program that imports comera as a library keeps Python's handler."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comera.cli.startup import interrupts_ignored, interrupts_passed_on

SRC = str(Path(__file__).parents[2] / "src")


def _as_from_a_terminal() -> None:
    """Its own process group, with SIGINT's default action: a test run in the background of a shell
    (``make test &``) hands its children SIGINT ignored, and Python then installs no handler at all."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted_at(delay: float, command: list[str]) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": SRC, "COMERA_AUTOTUNE": "0"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    process = subprocess.Popen(command, env=environment, preexec_fn=_as_from_a_terminal, **pipes)
    time.sleep(delay)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.parametrize("delay", [0.1, 0.3])
def test_a_ctrl_c_while_the_command_imports_torch_ends_it_in_one_line(tmp_path, delay):
    """Importing torch takes over a second here; a Ctrl-C then used to be ignored, to leave numpy
    half-imported or to abort in C++ code, depending on where it landed."""
    command = [sys.executable, "-m", "comera", "report", str(tmp_path)]
    done = _interrupted_at(delay, command)
    assert done.returncode == 130, done
    line = "comera: interrupted while starting; nothing was written"
    assert done.stderr.strip().splitlines() == [line], done
    assert done.stdout == ""


def test_importing_comera_installs_no_handler_and_imports_neither_the_command_nor_torch():
    """``import comera`` is a library import: Python's Ctrl-C handler, stdout and the unraisable hook stay
    as they were, and neither the command's process handling nor torch is loaded until a name is used."""
    code = (
        "import signal, sys\n"
        "hook, stdout = sys.unraisablehook, sys.stdout\n"
        "import comera\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('comera.cli', 'torch')))\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, loaded,"
        " sys.unraisablehook is hook and sys.stdout is stdout)\n"
        "comera.Trainer, comera.methods.method_names\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,"
        " 'torch' in sys.modules, 'comera.cli' in sys.modules)\n"
    )
    environment = {**os.environ, "PYTHONPATH": SRC}
    command = [sys.executable, "-c", code]
    terminal = {"env": environment, "preexec_fn": _as_from_a_terminal}
    done = subprocess.run(command, capture_output=True, text=True, **terminal)
    assert done.stdout.splitlines() == ["True [] True", "True True False"], done.stderr


def test_every_public_name_of_comera_is_reachable():
    import comera

    missing = [name for name in comera.__all__ if getattr(comera, name, None) is None]
    assert missing == []
    assert set(comera.__all__) <= set(dir(comera))
    with pytest.raises(AttributeError, match="no attribute 'Trainerr'"):
        comera.Trainerr  # noqa: B018


def test_a_ctrl_c_inside_interrupts_ignored_is_dropped_and_the_handler_restored():
    """The lines that report an interruption cannot be cut by a Ctrl-C that arrives meanwhile (or that came
    just before and was not raised yet); the handler of before is back after them."""
    before = signal.getsignal(signal.SIGINT)
    with interrupts_ignored():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        delivered = True
    assert delivered
    assert signal.getsignal(signal.SIGINT) is before


class _RaisesOnCollection:
    def __init__(self, error):
        self.error = error

    def __del__(self):
        raise self.error


def test_a_ctrl_c_inside_a_collection_callback_is_delivered_again_not_printed(monkeypatch):
    """A KeyboardInterrupt raised where Python cannot raise it (here a ``__del__``; in a --nproc run it
    landed in a WeakValueDictionary callback and printed "Exception ignored ... Traceback") reaches the
    main thread as a Ctrl-C; any other unraisable exception goes to the hook that was there before."""
    seen = []
    monkeypatch.setattr(
        sys, "unraisablehook", interrupts_passed_on(lambda unraisable: seen.append(unraisable))
    )
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _RaisesOnCollection(KeyboardInterrupt())
            for _ in range(1000):
                time.sleep(0.001)
        assert seen == []
        _RaisesOnCollection(ValueError("not an interrupt"))
        assert [type(unraisable.exc_value) for unraisable in seen] == [ValueError]
    finally:
        signal.signal(signal.SIGINT, previous)
