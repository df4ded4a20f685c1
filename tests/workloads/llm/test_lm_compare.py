"""``comera compare llm`` at smoke size: the table's perplexity, tokens/s and memory columns against each
run's results, and the two plots the workload asks for (perplexity against tokens and against time)."""

import json

import pytest

from comera.cli.commands.compare import compare


def _rows(markdown: str) -> dict[str, dict[str, str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return {
        cells[0]: dict(zip(header, cells))
        for cells in ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:])
    }


def test_the_comparison_reports_perplexity_throughput_both_memories_and_two_plots(tmp_path):
    out = tmp_path / "cmp"
    runs = compare(
        "llm",
        ["dense", "comera"],
        preset="smoke",
        out=out,
        cache_dir=tmp_path / "cache",
        assignments=["train.plot=false"],
        fresh_process=False,
        log=lambda line: None,
    )
    assert [item.status for item in runs] == ["trained", "trained"]
    rows = _rows((out / "comparison.md").read_text())
    results = {item.method: item.results for item in runs}
    for method, result in results.items():
        row = rows[method]
        assert float(row["perplexity"]) == pytest.approx(result["perplexity"], rel=1e-3)
        assert float(row["tokens/s"].replace(",", "")) == pytest.approx(result["tokens_per_s"], rel=1e-3)
        assert float(row["weights+optimizer MiB"]) == pytest.approx(result["weights_optimizer_mib"], rel=1e-3)
        assert float(row["peak MiB"]) == pytest.approx(result["peak_memory_mib"], rel=1e-3)
    change = 100 * (results["comera"]["perplexity"] / results["dense"]["perplexity"] - 1)
    assert float(rows["comera"]["perplexity vs dense"].rstrip("%")) == pytest.approx(change, abs=0.006)
    assert json.loads((out / "comparison.json").read_text())["primary_metric"] == "perplexity"
    for axis in ("tokens", "time"):
        assert (out / f"compare-perplexity-by-{axis}.png").stat().st_size > 1000
    assert not (out / "compare-perplexity.png").exists()
