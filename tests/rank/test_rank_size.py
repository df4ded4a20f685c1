"""Exact size accounting and size surrogates against brute-force counts from the gates."""

import math

import pytest
import torch
from torch import nn

from comera import TTLinear, TTMLinear
from comera.rank import live_ranks, mean_gate_surrogate, mib, size_surrogate, total_size, train_size


def _kill(layer, bond, entries):
    with torch.no_grad():
        layer.gates[bond][list(entries)] = 0.0


def _brute_size(layer) -> int:
    """Independent count: rebuild the active-rank core shapes and sum their sizes."""
    ranks = [1] + [int((g.abs() > layer.tau).sum()) for g in layer.gates] + [1]
    if 0 in ranks:
        return 0
    total = 0
    for k, core in enumerate(layer.cores):
        middle = math.prod(core.shape[1:-1])
        total += ranks[k] * middle * ranks[k + 1]
    return total


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_train_size_matches_brute_force_count(cls):
    layer = cls(48, 30, in_shape=(4, 12), out_shape=(5, 6), rank=5)
    _kill(layer, 0, [0, 2])
    _kill(layer, len(layer.gates) - 1, [1])
    assert int(train_size(layer)) == _brute_size(layer) == layer.num_parameters()
    assert [int(r) for r in live_ranks(layer)] == list(layer.ranks)


def test_ttm_counts_both_modes_per_core():
    layer = TTMLinear(12, 20, in_shape=(3, 4), out_shape=(4, 5), rank=2)
    assert int(train_size(layer)) == 3 * 4 * 2 + 2 * 4 * 5


def test_dead_bond_counts_zero_and_total_sums_layers():
    model = nn.Sequential(
        TTLinear(16, 16, rank=4), nn.ReLU(), TTMLinear(16, 8, in_shape=(4, 4), out_shape=(2, 4), rank=3)
    )
    first = _brute_size(model[0])
    _kill(model[2], 0, range(model[2].max_ranks[0]))
    assert int(train_size(model[2])) == 0
    assert int(total_size(model)) == first


def test_mib_is_fp32_mebibytes():
    assert mib(2**18) == pytest.approx(1.0)


def test_size_surrogate_equals_normalised_size_for_binary_gates():
    model = nn.Sequential(
        TTLinear(32, 24, rank=6, dtype=torch.float64), TTMLinear(24, 16, rank=4, dtype=torch.float64)
    )
    _kill(model[0], 1, [0, 3, 5])
    _kill(model[1], 0, [1])
    reference = 1000.0
    expected = (_brute_size(model[0]) + _brute_size(model[1])) / reference
    assert float(size_surrogate([model[0], model[1]], reference).detach()) == pytest.approx(
        expected, rel=1e-12
    )


def test_size_surrogate_gradient_is_the_weighted_l1_derivative():
    layer = TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=3, dtype=torch.float64)
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
        layer.gates[0][0] = -0.8
    size_surrogate([layer], 2.0).backward()
    norms = [g.detach().abs().sum() for g in layer.gates]
    c = layer.bond_sizes
    # d/dg_0 of (c0*|g0| + c1*|g0||g1| + ...) / 2 = sign(g0) * (c0 + c1*|g1|) / 2
    expected = torch.sign(layer.gates[0].detach()) * (c[0] + c[1] * norms[1]) / 2.0
    torch.testing.assert_close(layer.gates[0].grad, expected)


def test_mean_gate_surrogate_averages_live_entries():
    layer = TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=3)
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([0.5, 0.005, 2.0]))
        layer.gates[1].copy_(torch.tensor([1.0, 1.0, -1.0]))
        layer.gates[2].copy_(torch.tensor([0.0, 0.0, 3.0]))
    live = [0.5, 2.0, 1.0, 1.0, 1.0, 3.0]
    assert float(mean_gate_surrogate([layer]).detach()) == pytest.approx(sum(live) / len(live))


def test_surrogates_reject_bad_input():
    layer = TTLinear(16, 16, rank=2)
    with pytest.raises(ValueError, match="reference_size"):
        size_surrogate([layer], 0.0)
    with pytest.raises(ValueError, match="at least one"):
        size_surrogate([], 1.0)
