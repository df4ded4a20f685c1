"""The rank ladder of ``comera bench paper``: the rungs, the cut through the library's pruning, the report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera import TTLinear, compression_report
from comera.bench.ladder import (
    compression_fields,
    default_ladder,
    format_ladder,
    ladder_targets,
    plot_ladder,
    preset_rank,
    truncate_ranks_,
)
from comera.rank import entry_scores
from comera.tensorize_config import TensorizeConfig


def test_default_ladder_is_the_papers_for_rank_30_and_scales_down():
    assert default_ladder(30) == [30, 24, 16, 12, 8, 4, 2]
    assert default_ladder(8) == [8, 6, 4, 3, 2, 1]
    assert default_ladder(1) == [1]
    with pytest.raises(ValueError, match="rank must be >= 1"):
        default_ladder(0)
    assert preset_rank(TensorizeConfig(rank=(4, 6))) == 6 and preset_rank(TensorizeConfig(rank=5)) == 5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        TTLinear(64, 64, in_shape=(4, 4, 4), out_shape=(4, 4, 4), rank=6), nn.GELU(), TTLinear(64, 8, rank=3)
    )


def test_truncation_keeps_the_strongest_entries_and_slices_the_cores():
    model = _model()
    first = model[0]
    scores = entry_scores(first)
    strongest = [set(score.topk(2).indices.tolist()) for score in scores]
    kept_cores = [core.detach().clone() for core in first.core_list()]
    before = compression_fields(model)
    result = truncate_ranks_(model, 2)
    for layer in (first, model[2]):
        assert layer.max_ranks == layer.ranks and set(layer.max_ranks) == {2}
    assert {layer.name for layer in result.layers} == {"0", "2"}
    # the middle core kept exactly the strongest entries of its two bonds (gates were 1: nothing folded in)
    left, right = sorted(strongest[0]), sorted(strongest[1])
    assert torch.equal(first.core_list()[1], kept_cores[1][left][..., right])
    after = compression_fields(model)
    assert after["max_rank"] == 2 and after["tensorized_ratio"] > before["tensorized_ratio"] > 1
    assert after["model_ratio"] == compression_report(model).model_ratio
    assert not truncate_ranks_(model, 5).changed, "a cap above every rank prunes nothing"
    with pytest.raises(ValueError, match="rank must be >= 1"):
        truncate_ranks_(model, 0)


def _rung(rank: int, ms: float, tensorized: float, whole: float) -> dict:
    return {
        "workload": "nli",
        "preset": "paper",
        "method": "comera",
        "batch": 32,
        "rank": rank,
        "pruned_layers": 0 if rank == 30 else 38,
        "ms": ms,
        "train_mib": 10.0,
        "peak_mib": 500.0,
        "tensorized_ratio": tensorized,
        "model_ratio": whole,
    }


def _results() -> list[dict]:
    dense = {**_rung(0, 800.0, 1.0, 1.0), "method": "dense"}
    del dense["rank"], dense["pruned_layers"], dense["tensorized_ratio"], dense["model_ratio"]
    rungs = [
        _rung(30, 400.0, 66.0, 45.0),
        _rung(16, 90.0, 183.0, 81.0),
        _rung(8, 100.0, 641.0, 119.0),
        {**_rung(4, 0.0, 0.0, 0.0), "error": ["MemoryError"]},
    ]
    return [rungs[2], dense, *rungs[:2], rungs[3]]


def test_targets_read_the_measurements():
    lines = ladder_targets(_results())
    assert lines[0] == "- time falls at every rung as compression rises: no (rank 16 -> 8: 90.0 -> 100.0 ms)"
    assert "layers: 8.9x at rank 16 (183.0x;" in lines[1]
    assert "whole model: 8.0x at rank 8 (119.0x;" in lines[2]
    no_dense = [r for r in _results() if r["method"] != "dense" and r["rank"] == 30]
    assert "no rung reaches it (largest 66.0x" in ladder_targets(no_dense)[1]


def test_report_lists_dense_then_rungs_largest_first(tmp_path):
    report = format_ladder(_results(), "comera bench paper --sections ladder")
    rows = [line for line in report.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| dense", "| 30", "| 16", "| 8", "| 4"]
    assert rows[0] == "| dense | 1.00x | 1.00x | 800.0 | 1.00x | 10.0 | 500.0 |  |"
    assert (
        rows[1]
        == "| 30 | 66.00x | 45.00x | 400.0 | 2.00x | 10.0 | 500.0 | the preset's ranks, nothing pruned |"
    )
    assert rows[4] == "| 4 | - | - | - | - | - | - | failed: MemoryError |"
    assert "Workload `nli`, preset `paper`, batch 32." in report
    pytest.importorskip("matplotlib")
    (path,) = plot_ladder(_results(), tmp_path)
    assert path.name == "ladder_time.png" and path.stat().st_size > 1000
