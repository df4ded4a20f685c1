"""``comera.workloads``: the built-in names, and a recipe loaded by name imports only its own workload."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from comera.recipes.base import Recipe
from comera.workloads import WORKLOADS, load_recipe, workload_names

SOURCE = Path(__file__).resolve().parents[2] / "src"


def test_the_built_in_workloads_are_named_without_importing_them():
    assert {"nli", "dlrm", "mlm", "llm"} <= set(workload_names())
    assert set(WORKLOADS) == {"nli", "dlrm", "mlm", "llm"}


def test_an_unknown_workload_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown workload 'nope'; choose one of \[.*'dlrm'.*'mlm'.*'nli'"):
        load_recipe("nope")


@pytest.mark.parametrize("name", ["nli", "dlrm", "llm"])
def test_loading_one_workload_imports_no_other_and_not_transformers(name):
    code = (
        "import sys\n"
        "from comera.workloads import load_recipe\n"
        f"recipe = load_recipe({name!r})\n"
        "assert recipe.name == " + repr(name) + ", recipe\n"
        "loaded = sorted({m.split('.')[2] for m in sys.modules if m.startswith('comera.workloads.')})\n"
        "print(loaded, 'transformers' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(SOURCE)},
    )
    assert result.stdout.split() == [f"['{name}']", "False"]


def test_a_recipe_comes_with_its_presets_and_their_tensorization_presets():
    from comera.tensorize_config import preset_names

    recipe = load_recipe("dlrm")
    assert isinstance(recipe, Recipe) and set(recipe.presets) == {"paper", "small", "smoke"}
    assert {recipe.presets[preset]["tensorize"]["preset"] for preset in recipe.presets} <= set(preset_names())
