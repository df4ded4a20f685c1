"""The command layer's number formats: one behaviour for the train summary and the comparison table."""

import json
import math

import pytest

from comera.cli.commands.numbers import milliseconds, number, times


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (math.nan, "nan"),
        (0.123456, "0.1235"),
        (12345.6, "12,346"),
        (9999.4, "9999"),
        (-2.5e6, "-2,500,000"),
        (math.inf, "inf"),
        (7, "7"),
        ("ok", "ok"),
    ],
)
def test_number_keeps_missing_and_not_a_number_apart(value, text):
    assert number(value) == text


def test_milliseconds():
    assert milliseconds(None) == "-"
    assert milliseconds(0.0123456) == "12.35"
    assert milliseconds(math.nan) == "nan"


@pytest.mark.parametrize(
    ("value", "digits", "text"),
    [
        (None, 2, "-"),
        (math.nan, 2, "nan"),
        (math.nan, None, "nan"),
        (21.1875, 1, "21.2x"),
        (1.005, 2, "1.00x"),  # 1.005 is stored as 1.00499999...
        (21.1875, None, "21.19x"),
        (3, 2, "3.00x"),
    ],
)
def test_times_writes_a_ratio_or_says_why_there_is_none(value, digits, text):
    assert times(value, digits) == text


def test_the_summary_and_the_table_write_a_nan_metric_alike(tmp_path):
    from comera.cli.commands.compare import MethodRun, format_markdown
    from comera.cli.commands.train import summary

    results = {
        "recipe": "toy",
        "method": "comera",
        "preset": "smoke",
        "evaluation": {"validation": {"accuracy": math.nan}},
        "compression": {"tensorized": None, "whole": 1.0},
        "step_time_s": 0.01,
        "peak_memory_mib": None,
        "steps": 3,
        "wall_time_s": 1.0,
        "params": 10,
        "dense_params": 40,
    }
    assert "accuracy nan" in summary(results)
    run = MethodRun("comera", tmp_path, "trained", results, None)
    table = format_markdown([run], "accuracy")
    assert "| comera | nan |" in table


def _results(data):
    return {
        "recipe": "llm",
        "method": "dense",
        "preset": "smoke",
        "evaluation": {"validation": {"loss": 1.0}},
        "compression": {"tensorized": None, "whole": 1.0},
        "step_time_s": 0.01,
        "peak_memory_mib": 1.0,
        "steps": 3,
        "wall_time_s": 1.0,
        "params": 10,
        "dense_params": 10,
        "data": data,
    }


def test_the_summary_says_what_the_data_reader_skipped_and_nothing_when_it_skipped_nothing():
    from comera.cli.commands.train import summary

    splits = {
        "train": {"read": 19, "skipped": 0, "skipped_not_utf8": 0, "skipped_empty": 0},
        "validation": {"read": 3, "skipped": 3, "skipped_not_utf8": 1, "skipped_empty": 2},
    }
    shown = summary(_results({"splits": splits, "source": "corpus"}))
    assert "data skipped: validation: 1 not utf8, 2 empty (counts under data in results.json)" in shown
    criteo = summary(_results({"source": {"source": "day_0", "lines_read": 9, "lines_skipped": 4}}))
    assert "data skipped: source: 4 malformed lines" in criteo
    splits["validation"].update(skipped=0, skipped_not_utf8=0, skipped_empty=0)
    assert "skipped" not in summary(_results({"splits": splits}))


@pytest.mark.parametrize(
    ("steps", "note"),
    [((2, 4, 6), "too short to judge a plateau"), ((100, 200, 300, 400, 500), "plateau")],
    ids=["six-steps", "five-hundred-steps"],
)
def test_the_comparison_note_judges_a_plateau_only_on_a_long_enough_run(tmp_path, steps, note):
    """A flat validation loss over a 6-step smoke run is "too short to judge a plateau", not "plateau"; the
    same flat loss over five evaluations to step 500 is a plateau."""
    from comera.cli.commands.compare import MethodRun, format_markdown

    lines = [
        {"kind": "eval", "step": step, "split": "validation", "metrics": {"loss": 2.0}} for step in steps
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = {
        "evaluation": {"validation": {"loss": 2.0}},
        "compression": {"tensorized": None, "whole": 1.0},
        "step_time_s": 0.01,
        "peak_memory_mib": None,
        "wall_time_s": 1.0,
        "params": 10,
    }
    table = format_markdown([MethodRun("dense", tmp_path, "trained", results, None)], "loss")
    header, _, line = table.splitlines()
    row = dict(zip(header.strip("| ").split(" | "), line.strip("| ").split(" | ")))
    assert row["note"] == note and row["last fifth"] == "+0.00%"
