"""The documentation site is configured to cover the public API (`make docs` builds it; not run here).

Every name that ``import comera`` exports has a ``::: comera.NAME`` block in docs/reference/, every page of
docs/ is in mkdocs.yml's nav, and every public name's docstring carries an example that runs (its doctest).
"""

import doctest
import inspect
import re
from pathlib import Path

import pytest

import comera

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
IDENTIFIER = re.compile(r"^:::\s+(\S+)\s*$", flags=re.M)


def _reference_identifiers() -> set[str]:
    pages = (DOCS / "reference").glob("*.md")
    return {name for page in pages for name in IDENTIFIER.findall(page.read_text())}


def test_every_public_name_has_a_reference_block():
    documented = _reference_identifiers()
    missing = [name for name in comera.__all__ if f"comera.{name}" not in documented]
    assert not missing, f"no `::: comera.NAME` block in docs/reference/*.md for {missing}"


def test_every_docs_page_is_in_the_nav():
    nav = MKDOCS.read_text().split("\nnav:\n", 1)[1]
    pages = sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md"))
    missing = [page for page in pages if not re.search(rf"(^|\s){re.escape(page)}\s*$", nav, flags=re.M)]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


def test_mkdocs_reads_the_google_docstrings_strictly():
    text = MKDOCS.read_text()
    assert re.search(r"^strict: true$", text, flags=re.M)
    assert "docstring_style: google" in text
    assert "mkdocs build --strict" in (ROOT / "Makefile").read_text()


def _public(name: str):
    return getattr(comera, name) if name != "__version__" else comera.version


def _examples(name: str) -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(recurse=False)
    obj = _public(name)
    if name == "__version__":  # a string's docstring is str's: read the one written under the assignment
        source = inspect.getsource(obj)
        text = source.split('"""', 2)[1]
        return [doctest.DocTestParser().get_doctest(text, {}, name, inspect.getsourcefile(obj), 0)]
    return finder.find(obj, f"comera.{name}", globs={})


@pytest.mark.parametrize("name", comera.__all__)
def test_public_name_has_an_example_that_runs(name):
    tests = [test for test in _examples(name) if test.examples]
    assert tests, f"comera.{name}'s docstring has no `>>>` example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"comera.{name}'s example failed (see the output above)"


def test_benchmark_headings_are_unique():
    """Each heading of docs/benchmarks.md is its own anchor (a repeated one would get a numbered suffix)."""
    text = re.sub(r"^```.*?^```", "", (DOCS / "benchmarks.md").read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#{1,6} .*$", text, flags=re.M)
    repeated = sorted({heading for heading in headings if headings.count(heading) > 1})
    assert not repeated, f"repeated headings in docs/benchmarks.md: {repeated}"
