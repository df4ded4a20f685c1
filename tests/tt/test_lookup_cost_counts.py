"""The split lookup's cost count, its best split and the deduplication threshold, against hand counts.

References: the MACs, elements and launches that :func:`lookup_split_cost` hands to the cost model, recorded
by a :class:`CostModel` subclass and compared with counts derived by hand below (merges walk from the outer
end of each half inward); thresholds computed by hand for a cost model with round
constants; dedup decisions of :func:`ttm_lookup_rows` seen through the ``position`` it returns.

Train ``_SHAPES`` (cores ``(r_{k-1}, m_k, n_k, r_k)``): F1 (1, 2, 3, 4), F2 (4, 3, 2, 5), F3 (5, 2, 3, 3),
F4 (3, 5, 2, 1); column modes n = (3, 2, 3, 2), 36 columns.

Merge work (MACs, elements written), left half from F1 inward, right half from F4 inward:
    left  [F1]          merged 2 * 3 = 6:      (0, 0)
    left  [F1, F2]      + 6 * 4*3*2*5 = 720,   merged 6 * 6 = 36,    + 36 * 5 = 180:   (720, 180)
    left  [F1, F2, F3]  + 36 * 5*2*3*3 = 3240, merged 36 * 6 = 216,  + 216 * 3 = 648:  (3960, 828)
    right [F4]          merged 5 * 2 = 10:     (0, 0)
    right [F3, F4]      + 10 * 3*2*3*5 = 900,  merged 10 * 6 = 60,   + 60 * 5 = 300:   (900, 300)
    right [F2, F3, F4]  + 60 * 5*3*2*4 = 7200, merged 60 * 6 = 360,  + 360 * 4 = 1440: (8100, 1740)
Rows (batch B), split s with bond rank r, N_L / N_R columns per half:
    MACs B N_L r N_R; elements B ((N_L + N_R) r + N_L N_R)
    s = 1: r 4, N_L 3,  N_R 12: 144 B, 96 B
    s = 2: r 5, N_L 6,  N_R 6:  180 B, 96 B
    s = 3: r 3, N_L 18, N_R 2:  108 B, 96 B
Launches: 4 cores + 3 = 7. With backward every count is tripled.
"""

from __future__ import annotations

import math

import pytest
import torch

from comera.tt.cores import ttm_core_shapes, ttm_full
from comera.tt.costs import CostModel
from comera.tt.lookup import best_lookup_split, dedup_threshold, lookup_split_cost, ttm_lookup_rows

_SHAPES = [(1, 2, 3, 4), (4, 3, 2, 5), (5, 2, 3, 3), (3, 5, 2, 1)]

# (MACs, elements) of the two merges and, per row, of the batched GEMM, from the table above
_MERGES = {1: (0 + 8100, 0 + 1740), 2: (720 + 900, 180 + 300), 3: (3960 + 0, 828 + 0)}
_PER_ROW = {1: (144, 96), 2: (180, 96), 3: (108, 96)}


def _recording_model(calls):
    class Recording(CostModel):
        def time(self, macs, elements, ops):
            calls.append((macs, elements, ops))
            return super().time(macs, elements, ops)

    return Recording()


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("backward", [True, False, None])
def test_split_cost_counts_merges_rows_and_launches(split, backward):
    """``backward=None`` means the argument left out: the default counts the backward."""
    calls = []
    model = _recording_model(calls)
    if backward is None:
        cost = lookup_split_cost(10, _SHAPES, split, model=model)
    else:
        cost = lookup_split_cost(10, _SHAPES, split, backward, model)
    factor = 1 if backward is False else 3
    merge_macs, merge_elements = _MERGES[split]
    row_macs, row_elements = _PER_ROW[split]
    expected = (
        factor * (merge_macs + 10 * row_macs),
        factor * (merge_elements + 10 * row_elements),
        factor * 7,
    )
    assert calls == [expected]
    assert cost == CostModel().time(*expected)


def test_best_split_uses_the_given_model():
    """At B = 1000 (totals from the module table): MACs 152100 / 181620 / 111960, elements 97740 / 96480 /
    96828. The default model (MACs and traffic) picks split 3; a traffic-only model picks split 2."""
    traffic_only = CostModel(macs_per_us=math.inf, elements_per_us=1.0, launch_us=0.0)
    assert best_lookup_split(1000, _SHAPES) == 3
    assert best_lookup_split(1000, _SHAPES, model=traffic_only) == 2


def test_best_split_takes_the_first_of_tied_cheapest_bonds():
    """A mirror-symmetric train (F1 (1,2,2,2), F2 (2,2,2,8), F3 (8,2,2,2), F4 (2,2,2,1)) costs exactly the
    same at splits 1 and 3 (each half of one is the mirror of the other's), less than at split 2 (rank 8):
    per row 2 * 2 * 8 = 32 MACs at splits 1 and 3 against 4 * 8 * 4 = 128 at split 2."""
    shapes = [(1, 2, 2, 2), (2, 2, 2, 8), (8, 2, 2, 2), (2, 2, 2, 1)]
    costs = [lookup_split_cost(1000, shapes, split) for split in (1, 2, 3)]
    assert costs[0] == costs[2] < costs[1]
    assert best_lookup_split(1000, shapes) == 1


def test_dedup_threshold_against_hand_counts():
    """Model: 2 MACs, 4 elements per microsecond, 8 per launch.

    Several cores, split 2: one more row costs 3 * (180 / 2 + 96 / 4) = 342 (launches cancel); the
    overhead of one index is 3 * 36 / 4 = 27 elements' time: threshold 27 / 342. Split 1: 3 * (144 / 2 +
    96 / 4) = 288, 27 / 288. One core of 6 columns: a row costs 3 * (2 * 6 / 4) = 9, overhead 3 * 6 / 4 =
    4.5: threshold 0.5.
    """
    model = CostModel(macs_per_us=2.0, elements_per_us=4.0, launch_us=8.0)
    assert dedup_threshold(_SHAPES, 2, model) == pytest.approx(27 / 342, rel=1e-12)
    assert dedup_threshold(_SHAPES, 1, model) == pytest.approx(27 / 288, rel=1e-12)
    assert dedup_threshold([(1, 7, 6, 1)], 1, model) == pytest.approx(0.5, rel=1e-12)


def _cores(shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in shapes]


# Row modes 8^4, column modes 4^4, bond ranks (16, 2, 16): a row costs far less at the rank-2 bond (split 2)
# than at split 1, so repeats pay off there only at a much larger share (default model: split 1 about 0.17,
# split 2 about 0.75, both below 1).
_SKEWED = ttm_core_shapes((8, 8, 8, 8), (4, 4, 4, 4), (16, 2, 16))
_HALF_REPEATED = torch.arange(0, 4096, 410).repeat(2)  # 20 indices, 10 distinct: 50 % repeats


def test_auto_dedup_judges_repeats_at_the_split_that_will_run():
    assert dedup_threshold(_SKEWED, 1) < 0.5 < dedup_threshold(_SKEWED, 2)
    assert best_lookup_split(10, _SKEWED) == 2
    cores = _cores(_SKEWED)
    with torch.no_grad():
        # default split (2, the cheapest for the 10 distinct rows): 50 % repeats are below its threshold
        assert ttm_lookup_rows(cores, _HALF_REPEATED)[1] is None
        # requested split 1: its threshold is below 50 %, so the 10 distinct rows are computed once
        rows, position = ttm_lookup_rows(cores, _HALF_REPEATED, split=1)
    assert rows.shape == (10, 256) and position is not None
    torch.testing.assert_close(rows[position], ttm_full(cores)[_HALF_REPEATED], rtol=1e-4, atol=1e-4)


def test_auto_dedup_of_two_equal_indices():
    """Two equal indices are 50 % repeats, above split 1's threshold: computed once."""
    with torch.no_grad():
        rows, position = ttm_lookup_rows(_cores(_SKEWED), torch.tensor([7, 7]), split=1)
    assert rows.shape == (1, 256) and position.tolist() == [0, 0]


def test_auto_dedup_at_exactly_the_threshold_deduplicates():
    """One core of c columns: threshold = time(3c) / (3 time(2c)) = 0.5 exactly (default model, c = 6); four
    indices with two distinct are exactly 50 % repeats: ``>=`` deduplicates."""
    assert dedup_threshold([(1, 7, 6, 1)], 1) == 0.5
    with torch.no_grad():
        rows, position = ttm_lookup_rows(_cores([(1, 7, 6, 1)]), torch.tensor([3, 5, 3, 5]))
    assert rows.shape == (2, 6) and position.tolist() == [0, 1, 0, 1]
