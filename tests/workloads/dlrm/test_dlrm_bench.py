"""The DLRM benchmark at a tiny size: models built as tensorize_ would, a case run, the report's ratios."""

from __future__ import annotations

import pytest

from comera import TTMEmbeddingBag, compression_report, tensorize_
from comera.workloads.dlrm.bench import build_model, format_report, main
from comera.workloads.dlrm.model import DLRM
from comera.workloads.dlrm.presets import TENSORIZE_PRESETS


def test_comera_model_has_the_tables_tensorize_builds():
    direct = build_model("smoke", "comera-naive")
    converted = tensorize_(DLRM.from_preset("smoke"), TENSORIZE_PRESETS["dlrm-smoke"])
    for ours, theirs in zip(direct.tables, converted.tables):
        assert type(ours) is type(theirs)
        if isinstance(ours, TTMEmbeddingBag):
            assert (ours.row_shape, ours.col_shape, ours.max_ranks) == (
                theirs.row_shape,
                theirs.col_shape,
                theirs.max_ranks,
            )
            assert ours.lookup == "naive" and ours.mode == "sum"
    assert compression_report(direct).model_params == compression_report(converted).model_params
    with pytest.raises(ValueError, match="method must be one of"):
        build_model("smoke", "sparse")


def _entry(method, ms, peak, parameters, batch=10_000):
    return {
        "size": "paper",
        "method": method,
        "batch": batch,
        "ms": ms,
        "peak_mb": peak,
        "parameters": parameters,
    }


def test_report_ratios_come_from_the_measurements():
    results = [
        _entry("dense", 300.0, 9000.0, 540_000_000),
        _entry("comera", 150.0, 1000.0, 4_000_000),
        {"size": "paper", "method": "dense", "batch": 40_000, "error": ["MemoryError"]},
        _entry("comera", 500.0, 2000.0, 4_000_000, batch=40_000),
    ]
    report = format_report(results, "comera bench dlrm")
    assert "| paper | 10000 | 300.0 | 9000.0 | 150.0 | 1000.0 | 2.0x | 9.0x |" in report
    assert "| paper | 40000 | n/a | n/a | 500.0 | 2000.0 | n/a | n/a |" in report
    assert "- paper dense 40000: MemoryError" in report
    assert "| paper | 540000000 | 4000000 | 135.0x |" in report


def test_main_runs_each_case_in_a_fresh_process(tmp_path, capsys):
    target = tmp_path / "benchmarks.md"
    assert (
        main(
            [
                "--size",
                "smoke",
                "--batches",
                "64",
                "--methods",
                "comera",
                "--repeats",
                "1",
                "--write",
                str(target),
            ]
        )
        == 0
    )
    text = target.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| smoke | 64 |"))
    ms, peak = (float(cell) for cell in row.split("|")[3:5])  # a failed case would read n/a
    assert ms > 0 and peak >= 0
    parameters = sum(p.numel() for p in build_model("smoke", "comera").parameters())
    assert f"| smoke | n/a | {parameters} | n/a |" in text
