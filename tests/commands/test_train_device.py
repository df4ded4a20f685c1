"""``comera train --device``: the same as ``--set train.device=...``, recorded in the run's settings, and a
device this machine lacks refused in one line before any data is read."""

import json

import pytest
import torch
import toy

from comera.cli.commands.train import main


@pytest.fixture
def no_data(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the data was built before the error")

    monkeypatch.setattr(toy.ToyRecipe, "build_data", refuse)


def _arguments(tmp_path, *extra: str) -> list[str]:
    out, cache = tmp_path / "run", tmp_path / "cache"
    return ["toy", "--preset", "smoke", "--out", str(out), "--cache", str(cache), "--no-progress", *extra]


def test_the_device_is_a_setting_of_the_run(tmp_path, capsys):
    assert main(_arguments(tmp_path, "--device", "cpu", "--set", "train.seed=3")) == 0
    settings = json.loads((tmp_path / "run" / "config.json").read_text())["settings"]["train"]
    assert (settings["device"], settings["seed"]) == ("cpu", 3)


def test_the_last_of_device_and_set_wins_as_for_two_sets(tmp_path, capsys, no_data):
    error_first = _arguments(tmp_path, "--set", "train.device=cpu", "--device", "gpu")
    assert main(error_first) == 2
    assert "device must be None, 'cpu', 'cuda' or 'cuda:N'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_on_a_machine_without_cuda_is_refused_before_the_data_is_read(tmp_path, capsys, no_data):
    assert main(_arguments(tmp_path, "--device", "cuda")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert "train.device='cuda': CUDA is not available" in error
    assert not (tmp_path / "run").exists()


def test_a_resume_on_another_device_is_refused_as_a_changed_setting(tmp_path, capsys):
    assert main(_arguments(tmp_path, "--device", "cpu")) == 0
    capsys.readouterr()
    assert main(_arguments(tmp_path, "--resume")) == 2
    error = capsys.readouterr().err.strip()
    assert "train.device" in error and len(error.splitlines()) == 1, error
