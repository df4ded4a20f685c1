"""The merge order's TTM split: costs counted by hand and from the products that run; the cheapest is picked.

Merge-first at bond ``p`` for ``y = x W`` (``x`` is ``B x prod m``) costs, in multiply-accumulates:

- merging the left cores ``F_1..F_p`` into ``A (M_L, N_L, r_p)``, the right ones into ``C (r_p, M_R, N_R)``;
  merging two cores ``(r0, m, n, r1)`` and ``(r1, m', n', r2)`` takes ``r0 m n r1 m' n' r2`` MACs;
- contracting ``x`` (``B, M_L, M_R``) with ``C`` over ``M_R``: ``B M_L M_R r_p N_R``;
- then with ``A`` over ``M_L`` and ``r_p``: ``B M_L r_p N_L N_R``.

With a cost model that charges only MACs (no traffic, no launch cost) and no backward, the estimate must be
exactly this count.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera.tt.costs import CostModel, ttm_best_split, ttm_merge_split, ttm_order_costs
from comera.tt.paths import ttm_linear


class _CountMacs(TorchDispatchMode):
    """Multiply-accumulates of the matrix products that actually run (``mm``, ``addmm``, ``bmm``)."""

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (torch.ops.aten.mm, torch.ops.aten.bmm):
            first, second = args[0], args[1]
        elif packet in (torch.ops.aten.addmm, torch.ops.aten.baddbmm):
            first, second = args[1], args[2]
        else:
            return func(*args, **(kwargs or {}))
        self.macs += math.prod(first.shape) * second.shape[-1]
        return func(*args, **(kwargs or {}))


_MACS_ONLY = CostModel(macs_per_us=1.0, elements_per_us=math.inf, launch_us=0.0)
_BATCH = 64
_ROWS, _COLS = (4, 8, 8), (8, 8, 4)


def _hand_macs(split: int, ranks: tuple[int, int]) -> int:
    (m1, m2, m3), (n1, n2, n3), (r1, r2) = _ROWS, _COLS, ranks
    if split == 1:  # A = F_1 as is; C = F_2 F_3 merged
        merges = r1 * m2 * n2 * r2 * m3 * n3
        rows_left, rows_right, cols_left, cols_right, rank = m1, m2 * m3, n1, n2 * n3, r1
    else:  # A = F_1 F_2 merged; C = F_3 as is
        merges = m1 * n1 * r1 * m2 * n2 * r2
        rows_left, rows_right, cols_left, cols_right, rank = m1 * m2, m3, n1 * n2, n3, r2
    with_right = _BATCH * rows_left * rows_right * rank * cols_right
    with_left = _BATCH * rows_left * rank * cols_left * cols_right
    return merges + with_right + with_left


@pytest.mark.parametrize("ranks, cheapest", [((2, 16), 1), ((16, 2), 2)])
def test_split_with_fewer_hand_counted_macs_is_picked(ranks, cheapest):
    costs = {split: _hand_macs(split, ranks) for split in (1, 2)}
    assert costs == ({1: 1_245_184, 2: 9_502_720} if cheapest == 1 else {1: 9_502_720, 2: 1_245_184})
    split, cost = ttm_best_split(_BATCH, _ROWS, _COLS, ranks, backward=False, model=_MACS_ONLY)
    assert split == cheapest
    assert cost == costs[cheapest]
    merge = ttm_order_costs(_BATCH, _ROWS, _COLS, ranks, backward=False, model=_MACS_ONLY)["merge"]
    assert merge == min(costs.values())


@pytest.mark.parametrize("ranks, cheapest", [((2, 16), 1), ((16, 2), 2)])
def test_default_model_picks_the_split_with_fewer_measured_macs(ranks, cheapest):
    cores = [
        torch.randn(left, m, n, right) for m, n, left, right in zip(_ROWS, _COLS, (1, *ranks), (*ranks, 1))
    ]
    x = torch.randn(_BATCH, math.prod(_ROWS))
    measured = {}
    for split in (1, 2):
        with _CountMacs() as counter:
            ttm_linear(x, cores, math.prod(_COLS), None, order="merge", split=split)
        measured[split] = counter.macs
        assert measured[split] == _hand_macs(split, ranks)
    assert min(measured, key=measured.get) == cheapest
    for backward in (False, True):
        assert ttm_best_split(_BATCH, _ROWS, _COLS, ranks, backward=backward)[0] == cheapest
        assert ttm_merge_split(_BATCH, _ROWS, _COLS, ranks, backward) == cheapest


def test_four_core_train_picks_the_middle_split_when_outer_bonds_are_wide():
    # every core has 4 x 4 modes (16 entries per rank pair); ranks 16, 2, 16
    rows, cols, ranks = (4, 4, 4, 4), (4, 4, 4, 4), (16, 2, 16)
    # p = 1: C = F_2 F_3 F_4 merged from the right: F_3 onto F_4 (2*16 * 16 * 16), F_2 onto that
    # (16*16 * 2 * 256); then rank 16 between M_L = 4 and M_R = 64 rows, N_L = 4 and N_R = 64 columns
    one = 2 * 16 * 16 * 16 + 16 * 16 * 2 * 256 + _BATCH * 4 * 16 * 64 * (64 + 4)
    # p = 2: A = F_1 F_2 (16 * 16 * 16 * 2), C = F_3 F_4 (2 * 16 * 16 * 16); rank 2, 16 x 16 on either side
    two = 16 * 16 * 16 * 2 + 2 * 16 * 16 * 16 + _BATCH * 16 * 2 * 16 * (16 + 16)
    # p = 3: the mirror image of p = 1
    three = one
    assert (one, two, three) == (17_965_056, 1_064_960, 17_965_056)
    split, cost = ttm_best_split(_BATCH, rows, cols, ranks, backward=False, model=_MACS_ONLY)
    assert (split, cost) == (2, two)
