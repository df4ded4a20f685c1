"""The layer check of ``tools/import_graph.py``: the package passes it; a package that breaks it fails."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_the_package_has_no_upward_arrow_no_crossing_arrow_and_no_cycle():
    result = subprocess.run(
        [sys.executable, str(TOOL), str(ROOT / "src" / "comera")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "upward arrows: 0" in result.stdout
    assert "crossing arrows: 0" in result.stdout
    assert "cycles: 0" in result.stdout


def test_a_clean_package_passes(tmp_path, capsys):
    package = _package(
        tmp_path,
        {"tt/__init__.py": "", "tt/a.py": "", "nn/__init__.py": "", "nn/b.py": "from pkg.tt import a\n"},
    )
    assert _tool().main([str(package)]) == 0
    out = capsys.readouterr().out
    assert "files: 5" in out and "arrows: 1" in out and "floors: 2" in out


def test_a_planted_upward_arrow_fails_and_is_named(tmp_path, capsys):
    package = _package(
        tmp_path,
        {
            "tt/__init__.py": "",
            "tt/a.py": "def f():\n    from pkg.workloads import b  # inside a function still counts\n",
            "workloads/__init__.py": "",
            "workloads/b.py": "",
        },
    )
    assert _tool().main([str(package)]) == 1
    out = capsys.readouterr().out
    assert "upward arrows: 1" in out
    assert "tt -> workloads: 1" in out and "tt/a.py -> workloads/b.py" in out


def test_an_arrow_between_two_workloads_fails(tmp_path, capsys):
    package = _package(
        tmp_path,
        {
            "workloads/__init__.py": "",
            "workloads/one/__init__.py": "",
            "workloads/one/model.py": "",
            "workloads/two/__init__.py": "",
            "workloads/two/recipe.py": "from pkg.workloads.one.model import Model\n",
        },
    )
    assert _tool().main([str(package)]) == 1
    out = capsys.readouterr().out
    assert "upward arrows: 0" in out
    assert "crossing arrows: 1" in out and "workloads/two/recipe.py -> workloads/one/model.py" in out


def test_a_cycle_fails_and_is_named(tmp_path, capsys):
    package = _package(
        tmp_path, {"tt/__init__.py": "", "tt/a.py": "from . import b\n", "tt/b.py": "from . import a\n"}
    )
    assert _tool().main([str(package)]) == 1
    assert "cycles: found: tt/" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("file", "layer"),
    [
        ("tt/lookup.py", "tt"),
        ("workloads/nli/model.py", "workloads"),
        ("cli/commands/train.py", "cli"),
        ("measure.py", "measure"),
        ("version.py", "base"),
        ("__init__.py", "facade"),
    ],
)
def test_layer_of(file, layer):
    assert _tool().layer_of(file) == layer


def test_the_layers_rank_the_workloads_between_the_recipe_engine_and_the_benchmarks():
    rank = _tool().layer_rank
    assert rank("methods") < rank("recipes") < rank("workloads") < rank("bench") < rank("cli")
    assert rank("cli") < rank("__main__"), "the command line sits under the entry point only"
    assert rank("train") < rank("cli"), "nothing of the training layer may import the command line"


def test_every_package_folder_has_an_init_file():
    """setuptools' ``packages.find`` installs only folders holding ``__init__.py``."""
    package = ROOT / "src" / "comera"
    folders = {path.parent for path in package.rglob("*.py") if "__pycache__" not in path.parts}
    assert sorted(str(f.relative_to(package)) for f in folders if not (f / "__init__.py").is_file()) == []
