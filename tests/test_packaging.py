"""The package metadata agrees with itself: one version (SemVer, read by pyproject.toml from
comera/version.py, heading the changelog), py.typed shipped, and every folder of modules a package that
setuptools installs.

tools/check_wheel.sh (make check-wheel) builds and installs the wheel; these checks are its fast part."""

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "comera"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# semver.org's pattern for MAJOR.MINOR.PATCH with optional pre-release and build parts
SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)


def _version() -> str:
    """``__version__`` as written in comera/version.py (read without importing comera)."""
    tree = ast.parse((PACKAGE / "version.py").read_text())
    values = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
    ]
    assert len(values) == 1, "version.py must assign __version__ once, to a string literal"
    return values[0]


def test_version_is_semantic_and_read_by_pyproject():
    assert SEMVER.fullmatch(_version()), _version()
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "comera.version.__version__"}


def test_changelog_heads_with_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", text, flags=re.M)
    assert headings[0] == ("Unreleased", ""), "the changelog starts with an [Unreleased] section"
    released = headings[1:]
    assert released, "no released version in the changelog"
    assert released[0][0] == _version(), "the latest version in CHANGELOG.md is not comera/version.py's"
    for version, rest in released:
        assert SEMVER.fullmatch(version), version
        assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), f"[{version}] needs ' - YYYY-MM-DD'"


def test_py_typed_is_package_data():
    assert (PACKAGE / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["comera"]


def test_every_folder_of_modules_is_a_package():
    # setuptools' package discovery installs only folders with an __init__.py: a folder without one would
    # work from the checkout (PYTHONPATH=src) and be missing from the wheel.
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(
        str(folder.relative_to(ROOT)) for folder in folders if not (folder / "__init__.py").exists()
    )
    assert not missing, missing


def test_dev_extra_builds_and_checks_distributions():
    names = {
        re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0]
        for spec in PYPROJECT["project"]["optional-dependencies"]["dev"]
    }
    assert {"build", "twine"} <= names


def test_every_extra_is_checked_by_check_wheel():
    """tools/check_wheel.sh --extras installs each optional extra into a fresh environment of its own: one
    added to pyproject.toml without a ``check_extra`` line there would never be installed from the wheel."""
    script = (ROOT / "tools" / "check_wheel.sh").read_text()
    checked = set(re.findall(r"^\s*check_extra (\S+) ", script, flags=re.M))
    assert checked == set(PYPROJECT["project"]["optional-dependencies"])


def test_make_install_dev_installs_the_extras_the_tests_need():
    """``make test`` (CI) runs the tests of the Hugging Face integration, the baselines and the examples
    (tests/integrations/test_hf_example.py runs examples/hf_llama_pretrain.py, which needs ``datasets``)."""
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', (ROOT / "Makefile").read_text()).group(1).split(",")
    assert {"dev", "hf", "bench", "baselines", "examples"} <= set(extras)
