"""Ctrl-C on ``comera compare`` and ``comera demo``: the run being trained stops with its own line, the
command adds one line saying how to continue and exits 130; no Python traceback. SIGINT is sent to the
command's process group, as a terminal sends it."""

import os
import signal
import subprocess
import sys
import time

import pytest

TIMEOUT = 240


def _interrupted(started, *args):
    """Run ``comera ARGS`` in a process group of its own, SIGINT the group once ``started`` exists and a
    moment passed; (exit status, output)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "comera", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: (os.setpgrp(), signal.signal(signal.SIGINT, signal.SIG_DFL)),
    )
    begun = time.monotonic()
    while not started.is_file() and time.monotonic() - begun < TIMEOUT:
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(process.pid, signal.SIGINT)
    return process.wait(timeout=TIMEOUT), process.stdout.read()


@pytest.mark.parametrize("command", ["compare", "demo"])
def test_a_ctrl_c_stops_the_command_with_its_line_and_status_130(tmp_path, command):
    out = tmp_path / "out"
    common = ["--preset", "smoke", "--out", str(out), "--set", "train.early=100000"]
    if command == "compare":
        args = ["compare", "nli", "--methods", "dense", "comera", *common, "--cache", str(tmp_path)]
        said = "comera compare: interrupted; run the same command again to continue"
    else:
        args = ["demo", "--no-speed", *common]
        said = "comera demo: interrupted; run it again"
    code, output = _interrupted(out / "dense" / "metrics.jsonl", *args)
    assert code == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert output.count("comera train: interrupted; continue the run with --resume") == 1, output
    assert output.count(said) == 1, output
    assert not (out / "comera").exists()  # the comparison stopped: the next method did not start
