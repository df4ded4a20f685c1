"""compression_report: per-layer and total counts against counts made by hand."""

import math

import torch
from torch import nn

from comera import TTLinear, TTMEmbedding, TTMLinear, TTMTiedHead, compression_report, prune_


def _model():
    table = TTMEmbedding(40, 12, row_shape=(5, 8), col_shape=(3, 4), rank=4)
    model = nn.ModuleDict(
        {
            "table": table,
            "head": TTMTiedHead(table),
            "tt": TTLinear(12, 12, in_shape=(3, 4), out_shape=(4, 3), rank=3),
            "ttm": TTMLinear(12, 6, in_shape=(3, 4), out_shape=(2, 3), rank=2, bias=False),
            "dense": nn.Linear(12, 5),
        }
    )
    with torch.no_grad():
        model["tt"].gates[1][0] = 0.0
    return model


def test_counts_match_hand_computed_values():
    report = compression_report(_model())
    rows = {layer.name: layer for layer in report.layers}
    assert set(rows) == {"table", "tt", "ttm"}
    # table: ranks (4,): 5*3*4 + 4*8*4; tt: ranks (3, 2, 3) over modes 3,4,4,3; ttm: ranks (2,)
    assert rows["table"].params == 5 * 3 * 4 + 4 * 8 * 4 and rows["table"].dense_params == 40 * 12
    assert rows["tt"].ranks == (3, 2, 3) and rows["tt"].max_ranks == (3, 3, 3)
    assert rows["tt"].params == 3 * 3 + 3 * 4 * 2 + 2 * 4 * 3 + 3 * 3
    assert rows["ttm"].params == 3 * 2 * 2 + 2 * 4 * 3
    assert rows["ttm"].format == "ttm" and rows["tt"].format == "tt"
    assert rows["tt"].shapes == ((3, 4), (4, 3)) and rows["table"].shapes == ((5, 8), (3, 4))
    assert rows["tt"].ratio == 144 / rows["tt"].params
    tensorized = sum(rows[n].params for n in rows)
    other = 40 + 12 + 12 * 5 + 5  # head bias, tt bias, dense weight and bias
    assert report.tensorized_params == tensorized
    assert report.model_params == tensorized + other
    assert report.model_dense_params == 40 * 12 + 144 + 72 + other
    assert report.model_ratio == report.model_dense_params / report.model_params


def test_removed_layers_count_zero_and_the_table_prints():
    model = _model()
    with torch.no_grad():
        model["ttm"].gates[0].zero_()
    prune_(model)
    report = compression_report(model)
    row = next(layer for layer in report.layers if layer.name == "ttm")
    assert row.format == "removed" and row.params == 0 and row.dense_params == 72 and math.isinf(row.ratio)
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layer", "format", "shapes"]
    assert any(line.startswith("tt ") and "3,2,3" in line for line in lines)
    assert "removed" in text and "MiB" in text


def test_a_model_without_tensorized_layers_says_none_instead_of_a_ratio():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    report = compression_report(model)
    text = str(report)
    assert "tensorized layers: none" in text and "inf" not in text
    assert "whole model:       23 params" in text and text.rstrip().endswith("1.0x")
    assert math.isinf(report.tensorized_ratio)
