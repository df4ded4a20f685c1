"""A ``comera`` command whose output cannot be delivered (stdout a pipe nobody reads: ``comera train ... |
head -1``; stdout a full device: ``> /dev/full``) finishes its work, prints no traceback and exits with its
own status; with ``--nproc 2`` too."""

import json
import os
import subprocess
import sys

import pytest

from comera.cli.output import UnreadStream

TIMEOUT = 180


def _unread(arguments, tmp_path):
    """Run ``python -m comera ARGUMENTS`` with stdout a pipe whose reading end is already closed; its exit
    status and stderr."""
    reading, writing = os.pipe()
    os.close(reading)
    errors = tmp_path / "stderr.txt"
    try:
        with errors.open("w") as stderr:
            finished = subprocess.run(
                [sys.executable, "-m", "comera", *arguments],
                stdout=writing,
                stderr=stderr,
                timeout=TIMEOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
    finally:
        os.close(writing)
    return finished.returncode, errors.read_text()


def test_help_to_a_reader_that_left_exits_0_without_a_message(tmp_path):
    assert _unread(["--help"], tmp_path) == (0, "")


@pytest.mark.parametrize("nproc", [None, "2"])
def test_a_run_whose_reader_left_finishes_and_exits_0(tmp_path, nproc):
    """The summary printed after training cannot be delivered: the run is complete all the same (results,
    model), the status is 0 and stderr holds no traceback; ``comera report`` of it behaves the same."""
    out = tmp_path / "run"
    arguments = ["train", "nli", "--preset", "smoke", "--out", str(out), "--cache", str(tmp_path / "cache")]
    arguments += ["--no-progress"] + ([] if nproc is None else ["--nproc", nproc])
    code, errors = _unread(arguments, tmp_path)
    assert code == 0 and "Traceback" not in errors and "Error" not in errors, errors
    assert json.loads((out / "results.json").read_text())["steps"] > 0
    assert _unread(["report", str(out)], tmp_path) == (0, "")


def _to_full_device(arguments, tmp_path):
    """Run ``python -m comera ARGUMENTS`` with stdout ``/dev/full`` (every write: No space left on device);
    its exit status and stderr."""
    with open("/dev/full", "w") as full:
        finished = subprocess.run(
            [sys.executable, "-m", "comera", *arguments],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=tmp_path,
        )
    return finished.returncode, finished.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_output_to_a_full_device_is_said_once_and_the_work_is_done(tmp_path):
    """``comera compare`` logs before its first run: that failed write must not stop the comparison. The
    failure is said in one line on stderr; the runs, the table and the report are all there."""
    cache = str(tmp_path / "cache")
    arguments = ["compare", "nli", "--preset", "smoke", "--methods", "dense", "--out", "cmp"]
    arguments += ["--cache", cache]
    code, errors = _to_full_device(arguments, tmp_path)
    assert code == 0 and "Traceback" not in errors, errors
    assert errors.count("comera: stdout cannot be written (No space left on device)") == 1, errors
    assert (tmp_path / "cmp" / "comparison.md").is_file()
    assert json.loads((tmp_path / "cmp" / "dense" / "results.json").read_text())["steps"] > 0
    code, errors = _to_full_device(["report", str(tmp_path / "cmp" / "dense")], tmp_path)
    assert code == 0 and errors.startswith("comera: stdout cannot be written") and "Traceback" not in errors


def test_a_run_with_stdout_and_stderr_closed_trains_to_the_end(tmp_path):
    """``>&- 2>&-``: Python then has no ``sys.stdout`` / ``sys.stderr`` (None); the run decides on its
    progress bar without them and finishes."""
    out = tmp_path / "run"
    command = f"exec {sys.executable} -m comera train nli --preset smoke --out {out} --cache {tmp_path / 'c'}"
    finished = subprocess.run(
        ["bash", "-c", command + " >&- 2>&-"], timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert finished.returncode == 0
    assert json.loads((out / "results.json").read_text())["steps"] > 0


def test_an_unread_stream_forwards_until_the_reader_leaves(tmp_path):
    reading, writing = os.pipe()
    stream = UnreadStream(os.fdopen(writing, "w", buffering=1))
    assert stream.write("first\n") == 6
    assert os.read(reading, 100) == b"first\n"
    assert stream.fileno() == writing  # other attributes are the stream's
    os.close(reading)
    assert stream.write("second\n") == 7  # dropped, not raised
    stream.writelines(["third\n"])
    stream.flush()
    stream.close()


class FullDevice:
    """A stream on ``os.devnull`` whose writes fail as on a full disk until the descriptor is replaced."""

    def __init__(self):
        self.file = open(os.devnull, "w")  # noqa: SIM115  (closed by the test)
        self.failing = True

    def write(self, text):
        if self.failing:
            self.failing = False
            raise OSError(28, "No space left on device")
        return self.file.write(text)

    def fileno(self):
        return self.file.fileno()


def test_a_failure_other_than_a_reader_that_left_is_said_once_on_the_other_stream(tmp_path):
    said = tmp_path / "said.txt"
    target = FullDevice()
    with said.open("w") as other:
        stream = UnreadStream(target, "stdout", lambda: other)
        assert stream.write("lost\n") == 5
        stream.write("written to os.devnull\n")
    target.file.close()
    expected = "comera: stdout cannot be written (No space left on device); what is left of it is dropped\n"
    assert said.read_text() == expected
