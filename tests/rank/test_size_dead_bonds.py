"""Exact sizes of 3- and 4-core trains with a dead interior bond, against hand-computed counts.

A 2-core train cannot tell a correct dead-bond rule from a missing one (each of its two terms already holds
the dead rank), so these trains have at least three cores: with bond ``k`` dead, the terms of the cores that
do not touch bond ``k`` are non-zero, and only the dead-bond rule brings the count to 0.
"""

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear, TTMLinear
from comera.rank import live_ranks, total_size, train_size


def _kill(layer, bond, entries):
    with torch.no_grad():
        layer.gates[bond][list(entries)] = 0.0


def _tt3():
    # cores (1, 3, 2), (2, 4, 2), (2, 5, 1): bond sizes 3, 4, 5
    return TTLinear(12, 5, in_shape=(3, 4), out_shape=(5,), rank=2, dtype=torch.float64)


def _ttm4():
    # cores (1, 2, 3, 2), (2, 2, 3, 2), (2, 2, 3, 2), (2, 2, 3, 1): every bond size is 2 * 3 = 6
    return TTMLinear(16, 81, in_shape=(2, 2, 2, 2), out_shape=(3, 3, 3, 3), rank=2, dtype=torch.float64)


def test_hand_counts_of_live_trains():
    tt3, ttm4 = _tt3(), _ttm4()
    assert [tuple(core.shape) for core in tt3.cores] == [(1, 3, 2), (2, 4, 2), (2, 5, 1)]
    ttm4_shapes = [(1, 2, 3, 2), (2, 2, 3, 2), (2, 2, 3, 2), (2, 2, 3, 1)]
    assert [tuple(core.shape) for core in ttm4.cores] == ttm4_shapes
    assert int(train_size(tt3)) == 3 * 2 + 2 * 4 * 2 + 2 * 5 == 32
    assert int(train_size(ttm4)) == 6 * 2 + 6 * 2 * 2 + 6 * 2 * 2 + 6 * 2 == 72
    _kill(tt3, 1, [0])  # ranks (2, 1)
    assert int(train_size(tt3)) == 3 * 2 + 2 * 4 * 1 + 1 * 5 == 19
    _kill(ttm4, 0, [1])  # ranks (1, 2, 2)
    assert int(train_size(ttm4)) == 6 * 1 + 6 * 1 * 2 + 6 * 2 * 2 + 6 * 2 == 54


@pytest.mark.parametrize("bond", [0, 1])
def test_three_core_train_with_a_dead_bond_counts_zero(bond):
    layer = _tt3()
    _kill(layer, bond, range(2))
    # without the dead-bond rule the count would keep the far core: 2 * 5 = 10 (bond 0) or 3 * 2 = 6 (bond 1)
    assert [int(r) for r in live_ranks(layer)] == ([0, 2] if bond == 0 else [2, 0])
    assert int(train_size(layer)) == 0
    x = torch.randn(3, 12, dtype=torch.float64)
    assert torch.equal(layer(x), layer.bias.detach().expand(3, 5))  # the train represents exactly zero


def test_four_core_train_with_a_dead_middle_bond_counts_zero():
    layer = _ttm4()
    _kill(layer, 1, range(2))  # ranks (2, 0, 2): the outer terms 6 * 2 + 6 * 2 = 24 stay non-zero
    assert int(train_size(layer)) == 0
    assert torch.equal(layer.to_dense(), torch.zeros(81, 16, dtype=torch.float64))


def test_total_and_adaptation_size_skip_the_dead_train():
    model = nn.Sequential(_tt3(), nn.Tanh(), nn.Linear(5, 16), _ttm4())
    adaptation = RankAdaptation(model)
    assert adaptation.initial_size == 32 + 72
    _kill(model[3], 1, range(2))
    assert int(total_size(model)) == adaptation.size() == 32
    _kill(model[0], 0, [1])  # tt3 ranks (1, 2): 3 + 8 + 10
    assert adaptation.size() == 21
    assert adaptation.ratio() == pytest.approx(21 / 104)


def test_a_gate_exactly_at_tau_is_dead():
    layer = _tt3()
    layer.tau = 0.25  # a binary fraction: the gate value equals tau exactly
    with torch.no_grad():
        layer.gates[1][0] = 0.25
        layer.gates[0][1] = -0.25
    assert [int(r) for r in live_ranks(layer)] == [1, 1]
    assert int(train_size(layer)) == 3 * 1 + 1 * 4 * 1 + 1 * 5


def test_sizes_are_0_dim_int64_tensors_and_a_model_without_trains_has_size_0():
    layer = _tt3()
    for size in (train_size(layer), total_size(nn.Sequential(layer))):
        assert size.dtype == torch.int64 and size.dim() == 0
    empty = total_size(nn.Sequential(nn.Linear(3, 3)))
    assert empty.dtype == torch.int64 and empty.dim() == 0 and int(empty) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sizes_stay_on_the_device_of_the_gates_across_a_split_model():
    model = nn.ModuleList([_tt3().cuda(), _ttm4()])  # one train on the GPU, one on the CPU
    size = train_size(model[0])
    assert size.device.type == "cuda" and int(size) == 32
    total = total_size(model)
    assert total.device.type == "cuda" and int(total) == 32 + 72


def test_a_single_core_train_has_no_bond_and_counts_its_core():
    layer = TTMLinear(12, 5, in_shape=(12,), out_shape=(5,), rank=2, dtype=torch.float64)
    assert [tuple(core.shape) for core in layer.cores] == [(1, 12, 5, 1)] and len(layer.gates) == 0
    size = train_size(layer)
    assert int(size) == 12 * 5 and size.dtype == torch.int64
