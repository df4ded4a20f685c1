"""``load_run_model``: the model of any run folder ``comera train`` wrote, in a fresh process that imported
only ``comera`` (the run's tensorization preset, named in its ``config.json``, resolves on its own)."""

import subprocess
import sys

import pytest

from comera.cli import main

_LOAD = (
    "import sys, comera\n"
    "from comera.recipes.saved import load_run_model\n"
    "model = load_run_model(sys.argv[1])\n"
    "print(type(model).__name__, model.training)\n"
)

_MODELS = {"nli": "TransformerClassifier", "dlrm": "DLRM", "mlm": "CodeMaskedLM", "llm": "LlamaLM"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenizer cache for the runs of this module."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(
    ("workload", "method"),
    [
        *((workload, method) for workload in _MODELS for method in ("lte", "cola")),
        *(("nli", method) for method in ("dense", "comera", "galore", "apollo")),
    ],
)
def test_a_run_folder_loads_in_a_process_that_imported_only_comera(tmp_path, cache, workload, method):
    out = tmp_path / "run"
    command = ["train", workload, "--preset", "smoke", "--method", method, "--out", str(out), "--no-progress"]
    assert main([*command, "--cache", str(cache), "--set", "train.plot=false"]) == 0
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [_MODELS[workload], "False"]


@pytest.mark.parametrize("method", ["lte", "cola"])
def test_load_pretrained_on_a_run_with_layers_of_its_own_points_to_load_run_model(tmp_path, cache, method):
    """``load_pretrained`` rebuilds comera's layers only; for a CoLA or LTE run its key error says which
    method trained the model and what loads it."""
    import comera

    out = tmp_path / "run"
    command = ["train", "nli", "--preset", "smoke", "--method", method, "--out", str(out), "--no-progress"]
    assert main([*command, "--cache", str(cache), "--set", "train.plot=false"]) == 0
    with pytest.raises(ValueError, match=rf"method '{method}'.*load_run_model\('{out}'\)"):
        comera.load_pretrained(out / "model")


def test_a_run_folder_of_an_earlier_comera_is_not_loaded(tmp_path, cache):
    """A run's ``config.json`` holding a setting the current code no longer writes (``method.tau``) is
    refused, naming it, rather than rebuilt with settings this version does not read."""
    import json

    from comera.recipes.saved import load_run_model

    out = tmp_path / "run"
    command = ["train", "nli", "--preset", "smoke", "--method", "cola", "--out", str(out), "--no-progress"]
    assert main([*command, "--cache", str(cache), "--set", "train.plot=false"]) == 0
    header = json.loads((out / "config.json").read_text())
    header["settings"]["method"]["tau"] = 0.01
    (out / "config.json").write_text(json.dumps(header))
    with pytest.raises(
        ValueError,
        match=r"settings written by an earlier comera \(unknown method.tau\); this version of comera cannot "
        r"load the run's model$",
    ):
        load_run_model(out)
