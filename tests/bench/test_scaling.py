"""``comera bench scaling``: the report's arithmetic, argument checks, and one real shortened run."""

import json

import pytest

from comera.bench import BENCHMARKS
from comera.bench.scaling import format_report, main, run_case


def test_the_report_divides_each_throughput_by_the_one_process_one():
    cases = [
        {
            "workload": "nli",
            "processes": 1,
            "threads": "default",
            "batch": 32,
            "step_ms": 100.0,
            "samples_per_s": 320.0,
        },
        {
            "workload": "nli",
            "processes": 2,
            "threads": "1",
            "batch": 32,
            "step_ms": 80.0,
            "samples_per_s": 400.0,
        },
        {
            "workload": "dlrm",
            "processes": 2,
            "threads": "1",
            "batch": 64,
            "step_ms": 10.0,
            "samples_per_s": 6400.0,
        },
    ]
    rows = [line for line in format_report(cases, "cmd").splitlines() if line.startswith("| ")][1:]
    assert rows[0].endswith("| 1.00x |") and rows[1].endswith("| 1.25x |")
    assert rows[2].endswith("| - |"), "no one-process case: no ratio"
    assert "| nli | 2 | 1 | 32 | 80.0 | 400.0 |" in rows[1]


@pytest.mark.parametrize(
    ("argv", "message"), [(["--processes", "0"], "--processes"), (["--steps", "3"], "--steps")]
)
def test_bad_arguments_are_refused(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_one_process_case_reads_its_run(tmp_path):
    assert BENCHMARKS["scaling"] == "comera.bench.scaling"
    out = tmp_path / "run"
    case = run_case("nli", 1, preset="smoke", method="dense", steps=10, cache=tmp_path / "cache", out=out)
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == 10 and results["processes"] == 1
    assert case["step_ms"] == pytest.approx(results["step_time_s"] * 1000)
    assert case["samples_per_s"] == pytest.approx(case["batch"] / results["step_time_s"])
