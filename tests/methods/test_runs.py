"""Every baseline end to end through the recipe run on the toy recipe: the run folder's results, a falling
loss, parameter counts, and every built-in method registered by importing the package."""

import json
import statistics
import subprocess
import sys

import pytest
import toy  # noqa: F401  (registers the toy recipe)

from comera.methods import method_names
from comera.recipes.run import run
from comera.train import read_metrics

RESULT_KEYS = {
    "recipe",
    "method",
    "preset",
    "library_version",
    "evaluation",
    "data",
    "params",
    "dense_params",
    "compression",
    "step_time_s",
    "peak_memory_mib",
    "wall_time_s",
    "steps",
    "stage",
    "size_ratio",
    "nonfinite_steps",
    "processes",
}
DENSE_PARAMS = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 3 + 3
# trained entries: CoLA ranks 4 and 8; LTE adds 4 heads of rank 16 and 32 on the frozen weights
PARAMS = {
    "galore": DENSE_PARAMS,
    "apollo": DENSE_PARAMS,
    "cola": (4 * 16 + 32 * 4 + 32) + (8 * 32 + 32 * 8 + 32) + 32 * 3 + 3,
    "lte": DENSE_PARAMS + 4 * (16 * 16 + 32 * 16) + 4 * (32 * 32 + 32 * 32),
}
SETTINGS = {"lte": ["method.lr=1e-3", "method.scale=8.0", "method.merge_every=4"]}


@pytest.mark.parametrize("method", ["galore", "apollo", "lte", "cola"])
def test_a_baseline_run_trains_and_reports(tmp_path, method):
    if method in ("galore", "apollo"):
        pytest.importorskip(f"{method}_torch")
    out = tmp_path / method
    results = run(
        "toy",
        method=method,
        preset="smoke",
        out=out,
        cache_dir=tmp_path,
        assignments=SETTINGS.get(method, []),
    )
    assert set(results) == RESULT_KEYS and json.loads((out / "results.json").read_text()) == results
    assert results["method"] == method and results["stage"] == "train" and results["steps"] == 18
    assert results["params"] == PARAMS[method] and results["dense_params"] == DENSE_PARAMS
    assert set(results["evaluation"]["test"]) == {"accuracy", "loss"}
    losses = [record["loss"] for record in read_metrics(out) if record["kind"] == "train"]
    assert len(losses) == 18
    assert statistics.mean(losses[-4:]) < statistics.mean(losses[:4]) - 0.05, losses


def test_lte_refuses_a_batch_its_heads_do_not_divide(tmp_path):
    with pytest.raises(ValueError, match=r"train.batch_size=16 must be a multiple of method.heads=3"):
        run("toy", method="lte", preset="smoke", out=tmp_path / "run", assignments=["method.heads=3"])


def test_the_command_line_knows_every_method():
    assert {"dense", "comera", "galore", "apollo", "lte", "cola"} <= set(method_names())


@pytest.mark.parametrize("entry", ["comera", "comera.methods", "comera.train"])
def test_importing_any_entry_point_registers_every_method_without_the_optional_packages(entry):
    code = (
        f"import sys, {entry}\n"
        "from comera.methods import get_method, method_names\n"
        "print(sorted(method_names()), type(get_method('galore')).__name__,\n"
        "      [name for name in ('galore_torch', 'apollo_torch') if name in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[0] == (
        "['apollo', 'cola', 'comera', 'dense', 'galore', 'lte'] GaLoreMethod []"
    )
