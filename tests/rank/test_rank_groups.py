"""param_groups: the three AdamW groups of the paper."""

import pytest
import torch
from torch import nn

from comera import TTLinear, TTMEmbedding, TTMTiedHead, param_groups


def test_groups_split_cores_gates_and_the_rest():
    table = TTMEmbedding(30, 8, row_shape=(5, 6), col_shape=(2, 4), rank=3)
    model = nn.ModuleDict(
        {"table": table, "head": TTMTiedHead(table), "tt": TTLinear(8, 8, rank=2), "norm": nn.LayerNorm(8)}
    )
    model["frozen"] = nn.Linear(2, 2)
    model["frozen"].requires_grad_(False)
    groups = param_groups(model, lr_cores=1e-4, lr_gates=1e-3, lr_other=5e-5, weight_decay=0.1)
    by_name = {group["name"]: group for group in groups}
    ids = {name: [id(p) for p in group["params"]] for name, group in by_name.items()}
    assert ids["cores"] == [id(p) for p in (*table.cores, *model["tt"].cores)]
    assert ids["gates"] == [id(p) for p in (*table.gates, *model["tt"].gates)]
    expected_other = [model["head"].bias, model["tt"].bias, model["norm"].weight, model["norm"].bias]
    assert sorted(ids["other"]) == sorted(id(p) for p in expected_other)
    assert [by_name[n]["lr"] for n in ("cores", "gates", "other")] == [1e-4, 1e-3, 5e-5]
    assert [by_name[n]["weight_decay"] for n in ("cores", "gates", "other")] == [0.1, 0.0, 0.1]
    torch.optim.AdamW(groups)  # every parameter exactly once, or AdamW raises


def test_empty_groups_are_left_out():
    groups = param_groups(nn.Linear(3, 3), lr_cores=1.0, lr_gates=1.0, lr_other=1.0)
    assert [group["name"] for group in groups] == ["other"]


@pytest.mark.parametrize("name", ["lr_cores", "lr_gates", "lr_other", "weight_decay"])
@pytest.mark.parametrize("value", [-1e-3, float("inf"), "0.1"])
def test_bad_rates_raise(name, value):
    rates = {"lr_cores": 1e-4, "lr_gates": 1e-3, "lr_other": 5e-5, name: value}
    with pytest.raises(ValueError, match=name):
        param_groups(TTLinear(8, 8, rank=2), **rates)


def test_weight_decay_defaults_to_zero_for_every_group():
    groups = param_groups(
        nn.Sequential(TTLinear(8, 8, rank=2), nn.LayerNorm(8)), lr_cores=1e-4, lr_gates=1e-3, lr_other=5e-5
    )
    assert [(group["name"], group["weight_decay"]) for group in groups] == [
        ("cores", 0.0),
        ("gates", 0.0),
        ("other", 0.0),
    ]


@pytest.mark.parametrize("name", ["lr_cores", "lr_gates", "lr_other", "weight_decay"])
def test_a_bad_rate_message_starts_with_the_argument_name(name):
    rates = {"lr_cores": 1e-4, "lr_gates": 1e-3, "lr_other": 5e-5, name: -1.0}
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number in \[0\.0, inf\), got -1\.0$"):
        param_groups(TTLinear(8, 8, rank=2), **rates)
