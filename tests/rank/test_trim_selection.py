"""The trim's building blocks against hand-counted sizes: the kept-entry bookkeeping (never emptying a bond,
the budget as an inclusive bound) and the exhaustive rank search (entries with a zero gate never kept, a
structure exactly SWAP_TOLERANCE below the best score still counting as near, ties in size and score)."""

import torch

from comera import TTLinear
from comera.rank.trim import SWAP_TOLERANCE, _search_ranks, _Selection, choose_entries

# a 3-core train with bond sizes (3, 4, 5): ranks (r1, r2) hold 3 r1 + 4 r1 r2 + 5 r2 entries
_SIZES = [(3, 4, 5)]


def _selection(bond0, bond1):
    return _Selection([[torch.tensor(bond0), torch.tensor(bond1)]], _SIZES)


def test_the_last_kept_entry_of_a_bond_is_never_dropped():
    selection = _selection([True, True], [True, False])
    assert selection.total == 3 * 2 + 4 * 2 * 1 + 5 * 1 == 19
    assert selection.drop((0, 1, 0)) is False
    assert selection.kept((0, 1, 0)) and selection.counts == [[2, 1]] and selection.total == 19


def test_dropping_one_of_two_kept_entries_shrinks_the_size():
    selection = _selection([True, True], [True, False])
    assert selection.drop((0, 0, 1)) is True
    assert selection.counts == [[1, 1]] and selection.total == 3 + 4 + 5


def test_dropping_an_entry_that_is_not_kept_changes_nothing():
    selection = _selection([True, True, False], [True, True])
    assert selection.drop((0, 0, 2)) is False
    assert selection.counts == [[2, 2]] and selection.total == 3 * 2 + 4 * 2 * 2 + 5 * 2


def test_adding_an_entry_that_lands_exactly_on_the_budget_is_accepted():
    selection = _selection([True, True], [True, False])
    assert selection.add_within((0, 1, 1), 32.0) is True  # ranks (2, 2): 6 + 16 + 10 = 32
    assert selection.kept((0, 1, 1)) and selection.total == 32


def test_adding_an_entry_over_the_budget_is_refused_and_undone():
    selection = _selection([True, True], [True, False])
    assert selection.add_within((0, 1, 1), 31.0) is False
    assert not selection.kept((0, 1, 1)) and selection.counts == [[2, 1]] and selection.total == 19
    assert selection.fill([(0, 1, 1)], 31.0) == []


def test_the_search_never_keeps_an_entry_whose_gate_is_zero():
    torch.manual_seed(0)
    layer = TTLinear(12, 5, in_shape=(3, 4), out_shape=(5,), rank=3, dtype=torch.float64)
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([1.0, 0.0, 0.8]))
        layer.gates[1].copy_(torch.tensor([0.9, 1.0, 0.0]))
    choice = choose_entries([layer], 1000.0)  # room for everything with a nonzero gate
    assert [mask.tolist() for mask in choice.keep[0]] == [[True, False, True], [True, True, False]]
    assert choice.size == 3 * 2 + 4 * 2 * 2 + 5 * 2 and choice.removed == 0 and choice.revived == 0


def _ranks(keep):
    return [int(mask.sum()) for mask in keep[0]]


def test_a_structure_exactly_swap_tolerance_below_the_best_score_is_near_and_the_larger_wins():
    # bond sizes (1, 1, 3): ranks (2, 1) hold 7 entries, (1, 2) hold 9, (2, 2) hold 12 (over the budget 10)
    pool = [[torch.tensor([True, True]), torch.tensor([True, True])]]
    second = 0.999499874937461  # its square is 0.999 in float64: (1, 2) scores 2.999 = 3 - SWAP_TOLERANCE
    scores = [
        [torch.tensor([1.0, 1.0], dtype=torch.float64), torch.tensor([1.0, second], dtype=torch.float64)]
    ]
    assert 1.0 + (1.0 + second**2) == 3.0 - SWAP_TOLERANCE
    keep = _search_ranks(pool, scores, [(1, 1, 3)], 10.0)
    assert _ranks(keep) == [1, 2]


def test_structures_tied_in_size_and_score_are_both_acceptable():
    # bond sizes (1, 1, 1): ranks (1, 2) and (2, 1) both hold 5 entries and score the same
    pool = [[torch.tensor([True, True]), torch.tensor([True, True])]]
    scores = [[torch.tensor([0.6, 0.4], dtype=torch.float64), torch.tensor([0.6, 0.4], dtype=torch.float64)]]
    keep = _search_ranks(pool, scores, [(1, 1, 1)], 5.0)
    assert sorted(_ranks(keep)) == [1, 2]
