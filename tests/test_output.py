"""A ``comera`` command whose reader leaves (stdout a pipe nobody reads: ``comera train ... | head -1``)
finishes its work, prints no traceback and exits with its own status; with ``--nproc 2`` too."""

import json
import os
import subprocess
import sys

import pytest

from comera.output import UnreadStream

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
