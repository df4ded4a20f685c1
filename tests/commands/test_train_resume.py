"""``comera train`` through the command line: a run killed mid-way and resumed with ``--resume`` ends
exactly where an uninterrupted run ends; bad commands fail before training with one line."""

import json
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from comera.cli.commands.train import main

SETTINGS = [
    "train.early=60",
    "train.late=20",
    "train.eval_every=40",
    "train.checkpoint_every=10",
    "train.keep_checkpoints=3",
]


def _command(out, cache, *extra):
    command = [
        sys.executable,
        "-m",
        "comera.cli.commands.train",
        "nli",
        "--preset",
        "smoke",
        "--out",
        str(out),
    ]
    command += ["--cache", str(cache), "--no-progress"]
    for assignment in SETTINGS:
        command += ["--set", assignment]
    return command + list(extra)


def _weights(out):
    return load_file(str(out / "model" / "model.safetensors"))


def test_a_killed_run_resumes_to_the_same_model(tmp_path):
    cache = tmp_path / "cache"
    full = tmp_path / "full"
    subprocess.run(_command(full, cache), check=True, capture_output=True)
    killed = tmp_path / "killed"
    process = subprocess.Popen(_command(killed, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list((killed / "checkpoints").glob("step-*.pt")):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "results.json").exists(), "the run finished before it could be killed"
    assert list((killed / "checkpoints").glob("step-*.pt"))
    resumed = subprocess.run(_command(killed, cache, "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    events = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" for e in events)
    steps = [e["step"] for e in events if e["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 80, "every step logged once"
    got, want = _weights(killed), _weights(full)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] == want[name]).all(), name
    full_results = json.loads((full / "results.json").read_text())
    resumed_results = json.loads((killed / "results.json").read_text())
    assert resumed_results["evaluation"] == full_results["evaluation"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--set", "train.batchsize=3"], "unknown key train.batchsize"),
        (["--data", "/nonexistent/mnli"], "no such file or folder"),
        (["--preset", "huge"], "unknown --preset 'huge'"),
    ],
)
def test_bad_commands_fail_in_one_line_before_training(tmp_path, capsys, extra, message):
    arguments = _command(tmp_path / "run", tmp_path / "cache", *extra)[3:]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "config.json").exists()
