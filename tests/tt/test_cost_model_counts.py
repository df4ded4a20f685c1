"""The cost model's multiply-accumulate counts against the MACs the contraction paths really run.

With a :class:`CostModel` that charges one microsecond per MAC and nothing for traffic or kernel launches,
each estimate is the model's MAC count. ``torch.utils.flop_counter.FlopCounterMode`` counts the FLOPs
(2 per MAC) of every GEMM, batched GEMM and einsum that a forward, or a forward and backward, of that order
actually dispatches: an independent count of the same quantity.
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from comera.tt.costs import CostModel, choose_order, tt_order_costs, ttm_best_split, ttm_order_costs
from comera.tt.paths import tt_linear, ttm_linear

MACS_ONLY = CostModel(macs_per_us=1.0, elements_per_us=math.inf, launch_us=0.0)

TT_CASES = [
    # batch, in modes, out modes, inner ranks
    (7, (2, 3), (4, 2), (3, 5, 2)),
    (5, (3, 2, 2), (2, 5), (2, 4, 3, 2)),
    (16, (4,), (6,), (3,)),
    (3, (2, 2, 2), (2, 2, 3), (2, 3, 4, 3, 2)),
]
TTM_CASES = [
    # batch, row modes, column modes, inner ranks
    (6, (2, 3), (3, 2), (4,)),
    (4, (2, 3, 2), (3, 2, 2), (3, 5)),
    (9, (4, 2, 3, 2), (2, 2, 3, 3), (2, 3, 4)),
]


def _cores(shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).requires_grad_() for shape in shapes]


def _tt_cores(in_modes, out_modes, ranks, seed=0):
    full = (1, *ranks, 1)
    modes = in_modes + out_modes
    return _cores([(full[k], size, full[k + 1]) for k, size in enumerate(modes)], seed)


def _ttm_cores(row_modes, col_modes, ranks, seed=0):
    full = (1, *ranks, 1)
    shapes = [(full[k], i, j, full[k + 1]) for k, (i, j) in enumerate(zip(row_modes, col_modes))]
    return _cores(shapes, seed)


def _counted_macs(run, backward):
    """MACs of the GEMMs ``run()`` (and, with ``backward``, the backward of its summed output) dispatches."""
    with FlopCounterMode(display=False) as counter:
        out = run()
        if backward:
            out.sum().backward()
    return counter.get_total_flops() / 2


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, in_modes, out_modes, ranks", TT_CASES)
def test_tt_order_macs_match_the_contractions_run(batch, in_modes, out_modes, ranks, backward):
    costs = tt_order_costs(batch, in_modes, out_modes, ranks, backward, model=MACS_ONLY)
    assert set(costs) == {"merge", "sequential", "dense"}
    for order in costs:
        cores = _tt_cores(in_modes, out_modes, ranks)
        x = torch.randn(batch, math.prod(in_modes), requires_grad=True)

        def run(cores=cores, x=x, order=order):
            return tt_linear(x, cores, len(in_modes), math.prod(out_modes), None, order)

        assert costs[order] == pytest.approx(_counted_macs(run, backward)), order


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, row_modes, col_modes, ranks", TTM_CASES)
def test_ttm_order_macs_match_the_contractions_run(batch, row_modes, col_modes, ranks, backward):
    costs = ttm_order_costs(batch, row_modes, col_modes, ranks, backward, model=MACS_ONLY)
    assert set(costs) == {"merge", "sequential", "dense"}
    rows, cols = math.prod(row_modes), math.prod(col_modes)
    measured = {}
    for order, split in [("sequential", None), ("dense", None)] + [
        ("merge", split) for split in range(1, len(row_modes))
    ]:
        cores = _ttm_cores(row_modes, col_modes, ranks)
        x = torch.randn(batch, rows, requires_grad=True)

        def run(cores=cores, x=x, order=order, split=split):
            return ttm_linear(x, cores, cols, None, order, split)

        measured[(order, split)] = _counted_macs(run, backward)
    assert costs["sequential"] == pytest.approx(measured[("sequential", None)])
    assert costs["dense"] == pytest.approx(measured[("dense", None)])
    by_split = {split: macs for (order, split), macs in measured.items() if order == "merge"}
    cheapest = min(by_split, key=by_split.get)
    split, cost = ttm_best_split(batch, row_modes, col_modes, ranks, backward, model=MACS_ONLY)
    assert cost == pytest.approx(by_split[cheapest])
    assert by_split[split] == pytest.approx(by_split[cheapest])
    assert costs["merge"] == pytest.approx(by_split[cheapest])


def test_traffic_and_launches_only_add_to_the_mac_estimate():
    """Each term of the model is non-negative and counted: turning one on never lowers an estimate."""
    batch, in_modes, out_modes, ranks = 64, (4, 4), (4, 4), (6, 8, 6)
    macs = tt_order_costs(batch, in_modes, out_modes, ranks, True, model=MACS_ONLY)
    with_traffic = tt_order_costs(batch, in_modes, out_modes, ranks, True, model=CostModel(1.0, 1.0, 0.0))
    with_launches = tt_order_costs(
        batch, in_modes, out_modes, ranks, True, model=CostModel(1.0, math.inf, 5.0)
    )
    for order in macs:
        assert with_traffic[order] > macs[order]
        assert with_launches[order] > macs[order]


@pytest.mark.parametrize("backward", [False, True])
def test_every_estimate_grows_with_the_batch(backward):
    previous = None
    for batch in (1, 2, 8, 64, 512):
        tt = tt_order_costs(batch, (4, 8), (8, 4), (4, 16, 4), backward)
        ttm = ttm_order_costs(batch, (4, 8), (8, 4), (16,), backward)
        current = {**{f"tt {k}": v for k, v in tt.items()}, **{f"ttm {k}": v for k, v in ttm.items()}}
        if previous is not None:
            assert all(current[key] > previous[key] for key in current), (batch, current, previous)
        previous = current


def test_choose_order_takes_the_smallest_and_breaks_ties_by_listing_order():
    assert choose_order({"merge": 3.0, "sequential": 2.0, "dense": 5.0}) == "sequential"
    assert choose_order({"dense": 1.0, "merge": 1.0}) == "merge"
    assert choose_order({"dense": 1.0, "sequential": 1.0}) == "sequential"
    with pytest.raises(ValueError, match="costs must name at least one of"):
        choose_order({"fastest": 1.0})
