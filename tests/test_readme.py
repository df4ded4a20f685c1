"""The README is a front page: its code runs, it is short, and every number in its tables is in the docs.

The longer tour, docs/guide.md, is executed the same way, so neither can drift from the code.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
MEASURED = [ROOT / "docs" / "results.md", ROOT / "docs" / "benchmarks.md"]


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a markdown file."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("path", [README, GUIDE], ids=["README", "guide"])
def test_python_blocks_run(path):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python code block"
    for block in blocks:
        exec(compile(block, str(path), "exec"), {})


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside code blocks and tables."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return [line for line in text.splitlines() if not line.startswith("|")]


def test_readme_is_a_front_page_of_at_most_200_lines_with_the_results_table_on_the_first_screen():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200
    long = [line for line in prose_lines(text) if len(line) > 120]
    assert not long, f"prose lines over 120 characters: {long}"
    first_table = next(number for number, line in enumerate(lines) if line.startswith("| workload"))
    assert first_table < 50, f"the results table starts at line {first_table + 1}"


def test_every_number_in_the_readme_tables_is_in_the_measured_docs():
    measured = "\n".join(path.read_text() for path in MEASURED)
    rows = [line for line in README.read_text().splitlines() if line.startswith("|") and "---" not in line]
    missing = [
        (number, row[:60])
        for row in rows[1:]
        for number in re.findall(r"\d[\d,]*(?:\.\d+)?", row)
        if number not in measured
    ]
    assert not missing, f"README numbers found in neither docs/results.md nor docs/benchmarks.md: {missing}"


def test_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
    assert links
    broken = [link for link in links if not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
