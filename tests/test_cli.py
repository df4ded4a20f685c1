"""The ``comera`` command: benchmark dispatch and the docs section it writes."""

import subprocess
import sys

import pytest

from comera.bench.report import update_section
from comera.cli import main


def test_update_section_replaces_only_its_own_block(tmp_path):
    path = tmp_path / "bench.md"
    update_section(path, "layers", "first")
    update_section(path, "embedding", "other")
    update_section(path, "layers", "second")
    text = path.read_text()
    assert "second" in text and "first" not in text and "other" in text
    assert text.count("<!-- bench:layers:start -->") == 1


def test_bench_layers_quick_writes_a_table(tmp_path):
    target = tmp_path / "benchmarks.md"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "comera.cli",
            "bench",
            "layers",
            "--quick",
            "--repeats",
            "1",
            "--write",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 768->768 | 128 | 16 |")]
    assert rows, result.stdout
    cells = [cell.strip() for cell in rows[-1].strip("|").split("|")]
    assert cells[10] in {"merge", "sequential", "dense"}
    assert float(cells[3]) > 0 and float(cells[4]) > 0
    assert "| 768->768 | 128 | 16 |" in target.read_text()


def test_unknown_benchmark_is_rejected():
    with pytest.raises(SystemExit):
        main(["bench", "nonexistent"])
