"""``comera bench paper``: one case in process (LTE's heads at batch 1, timings and counts), the report's
ratios and plots, and the whole command with its cases in fresh processes on the toy recipe."""

import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from comera.bench import paper

RECIPES = Path(__file__).parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))
import toy  # noqa: E402, F401  (registers the toy recipe)

import comera.baselines.cola  # noqa: E402, F401
import comera.baselines.lte  # noqa: E402, F401


def test_lte_heads_divide_the_batch():
    assert [paper.lte_heads(batch, 4) for batch in (1, 2, 6, 8, 9, 32)] == [1, 2, 3, 4, 3, 4]


def test_a_case_times_every_step_and_counts_parameters(tmp_path):
    result = paper.run_case("toy", "smoke", "lte", 1, repeats=5, warmup=1, cache_dir=tmp_path)
    assert result["settings"] == ["method.heads=1"] and result["batch"] == 1
    assert len(result["times_ms"]) == 5 and result["ms"] == statistics.median(result["times_ms"])
    # one head of rank 16 on 16 -> 32 and of rank 32 on 32 -> 32, next to the dense model
    assert (
        result["dense_params"] == 1699 and result["stored_params"] == 1699 + (16 * 16 + 32 * 16) + 2 * 32 * 32
    )
    assert result["params"] == result["stored_params"] - (16 * 32 + 32 * 32), "main weights are frozen"


def _row(method, batch, ms, mib, settings=()):
    return {
        "method": method,
        "batch": batch,
        "ms": ms,
        "train_mib": mib,
        "settings": list(settings),
        "params": 10,
        "stored_params": 20,
        "dense_params": 50,
    }


def test_report_gives_ratios_to_comera_and_marks_failures(tmp_path):
    results = [
        _row("comera", 8, 2.0, 4.0),
        _row("dense", 8, 10.0, 36.0),
        _row("lte", 1, 3.0, 1.0, ["method.heads=1"]),
        {"method": "galore", "batch": 8, "error": ["ImportError: pip install 'comera[baselines]'"]},
    ]
    report = paper.format_report(results, "comera bench paper")
    assert "| 8 | dense | 10.0 | 5.00x | 36.0 | 9.00x | 10 | 2.50x |  |" in report
    assert "| 8 | comera | 2.0 | 1.00x | 4.0 | 1.00x | 10 | 2.50x |  |" in report
    assert "| 1 | lte | 3.0 | - | 1.0 | - | 10 | 2.50x | method.heads=1 |" in report
    assert "| 8 | galore | - | - | - | - | - | - | failed: ImportError" in report
    pytest.importorskip("matplotlib")
    written = paper.plot_report(results, tmp_path)
    assert [path.name for path in written] == ["paper_time.png", "paper_memory.png"]
    assert all(path.stat().st_size > 1000 for path in written)


def test_the_command_runs_each_case_in_a_fresh_process(tmp_path, monkeypatch):
    source = Path(paper.__file__).parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(source), str(RECIPES)]))
    out = tmp_path / "bench"
    argv = ["--workload", "toy", "--import", "toy", "--preset", "smoke", "--methods", "cola"]
    argv += ["--batches", "4", "--warmup", "1", "--threads", "1", "--out", str(out)]
    assert paper.main(argv) == 0
    (result,) = json.loads((out / "paper.json").read_text())
    assert result["method"] == "cola" and result["batch"] == 4 and result["params"] == 867
    assert result["peak_mib"] >= result["model_mib"] > 0
    assert "| 4 | cola |" in (out / "paper.md").read_text()
    assert paper.main(["--workload", "nope", "--out", str(out)]) == 2
