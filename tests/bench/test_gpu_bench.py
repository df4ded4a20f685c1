"""``comera bench gpu``: refuses without CUDA, checks its arguments, and its tables state the measured ratios.

The timed run itself needs CUDA and is skipped elsewhere.
"""

import json

import pytest
import torch

from comera.bench.gpu import layer_table, main, step_table

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert main(["--steps", "2"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--repeats", "--calls", "--steps", "--batch"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit):
        main([flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_layer_table_gives_dense_over_tt_eager_and_replayed_and_marks_missing_fp8():
    timed = {"in": 8, "out": 4, "tokens": 16, "dense_graph_ms": 0.8, "tt_graph_ms": 0.2}
    rows = [
        {**timed, "precision": "fp32", "dense_ms": 3.0, "tt_ms": 1.5, "dense_mib": 10.0, "tt_mib": 2.0},
        {**timed, "precision": "bf16", "dense_ms": 1.0, "tt_ms": 4.0, "dense_mib": 5.0, "tt_mib": 1.0,
         "tt_fp8_ms": 0.5},
    ]  # fmt: skip
    lines = layer_table(rows).splitlines()
    assert lines[0].endswith("TT fp8 ms |") and len(lines) == 4
    assert lines[2] == "| 8 x 4 | 16 | fp32 | 3.000 | 1.500 | 2.00x | 0.800 | 0.200 | 4.00x | 10 | 2 | - |"
    assert "| 0.25x |" in lines[3] and lines[3].endswith("| 0.500 |")


def test_step_table_gives_eager_over_graph():
    table = step_table({"step_ms": 6.0, "peak_mib": 100.0}, {"step_ms": 2.0, "peak_mib": 120.0})
    assert "Eager / graph step time: 3.00x." in table and "| eager | 6.00 | 100 |" in table


@needs_cuda
def test_a_short_run_on_cuda_writes_positive_times(tmp_path):
    out = tmp_path / "gpu.json"
    assert main(["--repeats", "1", "--calls", "1", "--steps", "3", "--json", str(out)]) == 0
    measured = json.loads(out.read_text())
    assert all(row["dense_ms"] > 0 and row["tt_ms"] > 0 for row in measured["layers"])
    assert all(row["dense_graph_ms"] > 0 and row["tt_graph_ms"] > 0 for row in measured["layers"])
    assert measured["eager"]["step_ms"] > 0 and measured["graph"]["step_ms"] > 0
