"""The exact trim: entry scores against a dense float64 reference, budgets, bonds never emptied, holding."""

import itertools

import pytest
import torch

from comera import TTLinear, TTMLinear
from comera.rank.trim import choose_entries, entry_scores, hold_entries
from comera.tt.cores import num_train_parameters


def _layer(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "tt":
        layer = TTLinear(24, 20, in_shape=(2, 3, 4), out_shape=(4, 5), rank=4, dtype=torch.float64)
    else:
        layer = TTMLinear(20, 12, in_shape=(4, 5), out_shape=(3, 4), rank=5, dtype=torch.float64)
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(-1.5, 1.5)
            gate[0] = 0.005  # dead (|g| <= tau) but nonzero: a revival candidate
    return layer


@pytest.mark.parametrize("kind", ["tt", "ttm"])
def test_entry_scores_are_norms_of_the_single_entry_terms(kind):
    layer = _layer(kind)
    whole = layer.to_dense().detach().norm()
    scores = entry_scores(layer)
    for bond, gate in enumerate(layer.gates):
        original = gate.detach().clone()
        for entry in range(len(gate)):
            with torch.no_grad():
                gate.zero_()
                gate[entry] = abs(float(original[entry])) + 1.0  # live, so the mask keeps it
            term = (
                layer.to_dense().detach().norm()
                * abs(float(original[entry]))
                / (abs(float(original[entry])) + 1.0)
            )
            assert float(scores[bond][entry]) == pytest.approx(float(term / whole), rel=1e-9, abs=1e-12)
        with torch.no_grad():
            gate.copy_(original)


def _size(layers, keep):
    return sum(
        num_train_parameters(layer.bond_sizes, [int(mask.sum()) for mask in masks])
        for layer, masks in zip(layers, keep)
    )


@pytest.mark.parametrize("fraction", [0.3, 0.45, 0.7, 1.0])
def test_choice_stays_within_the_budget_and_keeps_every_bond(fraction):
    layers = [_layer("tt", 1), _layer("ttm", 2)]
    live = sum(layer.num_parameters() for layer in layers)
    floor = sum(num_train_parameters(layer.bond_sizes, [1] * len(layer.gates)) for layer in layers)
    budget = fraction * live
    assert budget >= floor
    choice = choose_entries(layers, budget)
    assert choice.size == _size(layers, choice.keep) <= budget
    assert all(bool(mask.any()) for masks in choice.keep for mask in masks)
    hold_entries(layers, choice.keep, floor=0.02)
    assert sum(layer.num_parameters() for layer in layers) == choice.size


def test_weakest_entries_go_first():
    layer = _layer("tt", 3)
    scores = entry_scores(layer)
    choice = choose_entries([layer], 0.5 * layer.num_parameters(), swaps=0)
    for bond, mask in enumerate(choice.keep[0]):
        live = layer.gates[bond].detach().abs() > layer.tau
        if mask.all() or not (live & ~mask).any():
            continue
        # within a bond, every dropped live entry scores below every kept one
        assert scores[bond][live & ~mask].max() <= scores[bond][mask].min()


def test_small_budget_lands_closer_than_the_greedy_cut():
    layer = TTLinear(64, 64, in_shape=(4, 4, 4), out_shape=(4, 4, 4), rank=8, dtype=torch.float64)
    full = layer.num_parameters()
    best = {}
    for swaps in (0, 32):
        best[swaps] = choose_entries([layer], 0.3 * full, swaps=swaps).size
    assert best[0] <= best[32] <= 0.3 * full
    # every size reachable with these modes is a multiple of 4: the swaps find the budget exactly
    assert best[32] == 4 * int(0.3 * full / 4)


def test_fill_revives_dead_entries_when_the_budget_allows():
    layer = _layer("tt", 4)
    dead = [int((gate.detach().abs() <= layer.tau).sum()) for gate in layer.gates]
    assert sum(dead) > 0
    choice = choose_entries([layer], 10.0 * layer.dense_num_parameters())
    assert choice.removed == 0 and choice.revived == sum(dead)
    assert all(mask.all() for mask in choice.keep[0])


def test_floor_is_the_smallest_structure():
    layer = _layer("ttm", 5)
    choice = choose_entries([layer], 1.0)
    assert [int(mask.sum()) for mask in choice.keep[0]] == [1] * len(layer.gates)
    assert choice.size == num_train_parameters(layer.bond_sizes, [1] * len(layer.gates)) > 1


def test_hold_zeroes_dropped_and_lifts_kept_entries():
    layer = _layer("tt", 6)
    keep = [torch.tensor([j % 2 == 1 for j in range(len(gate))]) for gate in layer.gates]
    with torch.no_grad():
        layer.gates[1][1] = -0.001  # kept but below the floor, negative: lifted to -floor
    hold_entries([layer], [keep], floor=0.05)
    for gate, mask in zip(layer.gates, keep):
        assert torch.all(gate[~mask] == 0)
        assert torch.all(gate[mask].abs() >= 0.05)
    assert float(layer.gates[1].detach()[1]) == -0.05


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda layer: choose_entries([layer], 0.0), "budget"),
        (lambda layer: choose_entries([layer], 10.0, swaps=-1), "swaps"),
        (lambda layer: hold_entries([layer], [[torch.ones(4, dtype=torch.bool)] * 4], floor=0.001), "floor"),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(TTLinear(24, 20, in_shape=(2, 3, 4), out_shape=(4, 5), rank=4))


def test_dead_bond_is_refused():
    layer = _layer("tt", 7)
    with torch.no_grad():
        layer.gates[2].zero_()
    with pytest.raises(ValueError, match="dead bond"):
        choose_entries([layer], 100.0)


def test_every_reachable_size_is_met_exactly():
    # all rank pairs of a three-core TTM (sizes listed by brute force): a budget equal to one is met exactly
    layer = TTMLinear(24, 24, in_shape=(2, 3, 4), out_shape=(4, 3, 2), rank=4, dtype=torch.float64)
    ranks = [range(1, r + 1) for r in layer.max_ranks]
    reachable = {num_train_parameters(layer.bond_sizes, pair) for pair in itertools.product(*ranks)}
    for budget in sorted(reachable):
        assert choose_entries([layer], budget).size == budget
