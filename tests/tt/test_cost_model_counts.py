"""The cost model's kernel lists against the kernels the contraction paths really dispatch.

For every order the model lists the matrix products it runs (and, for the sequential orders, the copies its
einsum steps make); each estimate is a sum over that list. The reference is independent of the model: a
``TorchDispatchMode`` records every ``mm``/``bmm``/``addmm``/``baddbmm`` and ``clone`` that a forward, or a
forward and backward, of :func:`comera.tt.paths.tt_linear` / :func:`comera.tt.paths.ttm_linear` actually
runs. A product is compared by its multiply-accumulates (``numel(A) * cols(B)``) and its traffic (the
elements of both operands and of the result, as dispatched: a broadcast operand of a batched product counts
once per batch entry); a copy by the elements it writes. ``FlopCounterMode`` gives a second, separate count
of the MACs.
"""

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from comera.tt import costs
from comera.tt.costs import (
    Copy,
    CostModel,
    Gemm,
    auto_tt_order,
    auto_ttm_order,
    choose_order,
    tt_order_costs,
    tt_order_kernels,
    ttm_best_split,
    ttm_merge_split,
    ttm_order_costs,
    ttm_order_kernels,
)
from comera.tt.paths import tt_linear, ttm_linear

MACS_ONLY = CostModel(macs_per_us=1.0, elements_per_us=math.inf, launch_us=0.0)
TRAFFIC_ONLY = CostModel(macs_per_us=math.inf, elements_per_us=1.0, launch_us=0.0)
LAUNCHES_ONLY = CostModel(macs_per_us=math.inf, elements_per_us=math.inf, launch_us=1.0)

TT_CASES = [
    # batch, in modes, out modes, inner ranks
    (7, (2, 3), (4, 2), (3, 5, 2)),
    (5, (3, 2, 2), (2, 5), (2, 4, 3, 2)),
    (16, (4,), (6,), (3,)),
    (3, (2, 2, 2), (2, 2, 3), (2, 3, 4, 3, 2)),
    (4, (3, 5, 2, 2), (2, 3), (2, 3, 4, 5, 3)),
]
TTM_CASES = [
    # batch, row modes, column modes, inner ranks
    (6, (2, 3), (3, 2), (4,)),
    (4, (2, 3, 2), (3, 2, 2), (3, 5)),
    (7, (3, 2, 4), (2, 4, 3), (4, 2)),
    (3, (2, 3, 2, 2), (2, 2, 3, 2), (2, 3, 2)),
]

_PRODUCTS = {
    torch.ops.aten.mm: (0, 1),
    torch.ops.aten.bmm: (0, 1),
    torch.ops.aten.addmm: (1, 2),
    torch.ops.aten.baddbmm: (1, 2),
}


class _RecordKernels(TorchDispatchMode):
    """Each product as ``("gemm", macs, elements)`` and each ``clone`` as ``("copy", 0, 2 * numel)``."""

    def __init__(self):
        super().__init__()
        self.kernels = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in _PRODUCTS:
            first, second = (args[i] for i in _PRODUCTS[packet])
            macs = first.numel() * second.shape[-1]
            self.kernels["gemm", macs, first.numel() + second.numel() + out.numel()] += 1
        elif packet is torch.ops.aten.clone:
            self.kernels["copy", 0, 2 * out.numel()] += 1
        return out


def _listed(kernels, copies=True):
    kinds = {Gemm: "gemm", Copy: "copy"}
    return Counter((kinds[type(k)], k.macs, k.elements) for k in kernels if copies or isinstance(k, Gemm))


def _recorded(run, batch, cols, backward, copies=True):
    recorder = _RecordKernels()
    with recorder:
        out = run()
        if backward:
            out.backward(torch.randn(batch, cols, generator=torch.Generator().manual_seed(1)))
    if copies:
        return recorder.kernels
    return Counter({key: count for key, count in recorder.kernels.items() if key[0] == "gemm"})


def _cores(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).requires_grad_() for shape in shapes]


def _tt_cores(in_modes, out_modes, ranks):
    full, modes = (1, *ranks, 1), in_modes + out_modes
    return _cores([(full[k], size, full[k + 1]) for k, size in enumerate(modes)])


def _ttm_cores(row_modes, col_modes, ranks):
    full = (1, *ranks, 1)
    return _cores([(full[k], i, j, full[k + 1]) for k, (i, j) in enumerate(zip(row_modes, col_modes))])


def _tt_run(batch, in_modes, out_modes, ranks, order):
    cores = _tt_cores(in_modes, out_modes, ranks)
    x = torch.randn(batch, math.prod(in_modes), requires_grad=True)
    return lambda: tt_linear(x, cores, len(in_modes), math.prod(out_modes), None, order)


def _ttm_run(batch, row_modes, col_modes, ranks, order, split=None):
    cores = _ttm_cores(row_modes, col_modes, ranks)
    x = torch.randn(batch, math.prod(row_modes), requires_grad=True)
    return lambda: ttm_linear(x, cores, math.prod(col_modes), None, order, split)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, in_modes, out_modes, ranks", TT_CASES)
def test_tt_kernel_lists_are_the_kernels_run(batch, in_modes, out_modes, ranks, backward):
    listed = tt_order_kernels(batch, in_modes, out_modes, ranks, backward)
    assert set(listed) == {"merge", "sequential", "dense"}
    cols = math.prod(out_modes)
    for order, kernels in listed.items():
        # only the sequential order's copies are modelled; the merges' layout copies are batch-independent
        copies = order == "sequential"
        run = _tt_run(batch, in_modes, out_modes, ranks, order)
        assert _listed(kernels, copies) == _recorded(run, batch, cols, backward, copies), order


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, row_modes, col_modes, ranks", TTM_CASES)
def test_ttm_kernel_lists_are_the_kernels_run(batch, row_modes, col_modes, ranks, backward):
    cols = math.prod(col_modes)
    for split in range(1, len(row_modes)):
        listed = ttm_order_kernels(batch, row_modes, col_modes, ranks, backward, split)
        assert set(listed) == {"merge", "sequential", "dense"}
        for order, kernels in listed.items():
            # from four TTM cores on, einsum's layout choices make copies the model's rule does not list
            copies = order == "sequential" and len(row_modes) <= 3
            run = _ttm_run(batch, row_modes, col_modes, ranks, order, split)
            assert _listed(kernels, copies) == _recorded(run, batch, cols, backward, copies), (order, split)


def test_a_single_ttm_core_has_no_merge_order_and_a_bad_split_is_refused():
    assert set(ttm_order_kernels(4, (6,), (5,), (), True)) == {"sequential", "dense"}
    assert set(ttm_order_costs(4, (6,), (5,), (), True)) == {"sequential", "dense"}
    with pytest.raises(ValueError, match=r"split must be in \[1, 2\], got 3"):
        ttm_order_kernels(4, (2, 3, 2), (3, 2, 2), (3, 5), True, split=3)
    with pytest.raises(ValueError, match="a TTM split needs at least 2 cores, got 1"):
        ttm_best_split(4, (6,), (5,), (), True)


def _flop_counted_macs(run, backward):
    with FlopCounterMode(display=False) as counter:
        out = run()
        if backward:
            out.sum().backward()
    return counter.get_total_flops() / 2


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, in_modes, out_modes, ranks", TT_CASES[:3])
def test_tt_estimates_are_the_sums_over_the_kernels_run(batch, in_modes, out_modes, ranks, backward):
    """Each term of the estimate, on its own, is the MACs, traffic or kernel count of what runs."""
    macs = tt_order_costs(batch, in_modes, out_modes, ranks, backward, model=MACS_ONLY)
    traffic = tt_order_costs(batch, in_modes, out_modes, ranks, backward, model=TRAFFIC_ONLY)
    launches = tt_order_costs(batch, in_modes, out_modes, ranks, backward, model=LAUNCHES_ONLY)
    for order in ("sequential", "dense", "merge"):
        run = _tt_run(batch, in_modes, out_modes, ranks, order)
        assert macs[order] == pytest.approx(_flop_counted_macs(run, backward)), order
        run = _tt_run(batch, in_modes, out_modes, ranks, order)
        copies = order == "sequential"
        recorded = _recorded(run, batch, math.prod(out_modes), backward, copies)
        assert traffic[order] == pytest.approx(sum(key[2] * n for key, n in recorded.items())), order
        assert launches[order] == pytest.approx(sum(recorded.values())), order


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, row_modes, col_modes, ranks", TTM_CASES)
def test_ttm_merge_estimate_is_its_cheapest_split(batch, row_modes, col_modes, ranks, backward):
    cols = math.prod(col_modes)
    model = CostModel(macs_per_us=50.0, elements_per_us=3.0, launch_us=7.0)
    by_split = {}
    for split in range(1, len(row_modes)):
        recorded = _recorded(
            _ttm_run(batch, row_modes, col_modes, ranks, "merge", split), batch, cols, backward
        )
        gemms = {key: n for key, n in recorded.items() if key[0] == "gemm"}
        by_split[split] = model.time(
            sum(key[1] * n for key, n in gemms.items()),
            sum(key[2] * n for key, n in gemms.items()),
            sum(gemms.values()),
        )
    split, cost = ttm_best_split(batch, row_modes, col_modes, ranks, backward, model=model)
    assert cost == pytest.approx(min(by_split.values()))
    assert by_split[split] == pytest.approx(cost)
    costs = ttm_order_costs(batch, row_modes, col_modes, ranks, backward, model=model)
    assert costs["merge"] == pytest.approx(cost)


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


def test_the_default_constants_combine_the_three_terms():
    """``time`` = MACs / rate + traffic / bandwidth + kernels x launch, checked on the default model."""
    model = CostModel()
    assert model.time(80_000.0, 3_000.0, 2) == pytest.approx(80_000 / 40_000 + 3_000 / 1_500 + 2 * 8.0)
    kernels = [Gemm(2, 3, 4, count=5), Copy(7)]
    assert kernels[0].macs == 5 * 2 * 3 * 4 and kernels[0].elements == 5 * (6 + 12 + 8)
    assert kernels[1].macs == 0 and kernels[1].elements == 14
    assert model.kernels_time(kernels) == pytest.approx(model.time(120, 144, 2))
    # dA = dC B^T is (2 x 4) @ (4 x 3), dB = A^T dC is (3 x 2) @ (2 x 4), each for all 5 batch entries
    assert kernels[0].backward() == (Gemm(2, 4, 3, count=5), Gemm(3, 2, 4, count=5))


def test_choose_order_takes_the_smallest_and_breaks_ties_by_listing_order():
    assert choose_order({"merge": 3.0, "sequential": 2.0, "dense": 5.0}) == "sequential"
    assert choose_order({"dense": 1.0, "merge": 1.0}) == "merge"
    assert choose_order({"dense": 1.0, "sequential": 1.0}) == "sequential"
    with pytest.raises(ValueError, match="costs must name at least one of"):
        choose_order({"fastest": 1.0})


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("batch, row_modes, col_modes, ranks", TTM_CASES)
def test_ttm_estimates_are_the_model_times_of_their_kernel_lists(
    batch, row_modes, col_modes, ranks, backward
):
    model = CostModel(macs_per_us=50.0, elements_per_us=3.0, launch_us=7.0)
    estimated = ttm_order_costs(batch, row_modes, col_modes, ranks, backward, model=model)
    listed = ttm_order_kernels(batch, row_modes, col_modes, ranks, backward)
    for order in ("sequential", "dense"):
        assert estimated[order] == pytest.approx(model.kernels_time(listed[order])), order


# batch, in (row) modes, out (column) modes, inner ranks; at these shapes the choice with gradients on differs
# from the choice without (found by scanning batches; asserted below, so a change of the model shows up here)
_TT_FLIPS = (2, (4, 4, 8), (8, 4, 4), (6, 12, 24, 12, 6))
_TTM_FLIPS = (2, (4, 8), (8, 4), (30,))
_TTM_SPLIT_FLIPS = (8, (8, 8, 12), (8, 8, 12), (30, 30))


def test_the_memoised_choices_are_the_cost_model_choices():
    """The cached entry points answer what the cost model answers, with and without gradients."""
    for function in costs._MEMOISED.values():
        function.cache_clear()
    cases = (
        (auto_tt_order, lambda *shape: choose_order(tt_order_costs(*shape)), _TT_FLIPS),
        (auto_ttm_order, lambda *shape: choose_order(ttm_order_costs(*shape)), _TTM_FLIPS),
        (ttm_merge_split, lambda *shape: ttm_best_split(*shape)[0], _TTM_SPLIT_FLIPS),
    )
    for entry, reference, shape in cases:
        picks = [entry(*shape, backward) for backward in (False, True)]
        assert picks == [reference(*shape, backward) for backward in (False, True)]
        assert picks[0] != picks[1]
    assert ttm_merge_split(4, (6,), (5,), (), True) is None
    assert ttm_merge_split(4, (2, 3), (3, 2), (4,), True) == 1


def test_a_repeated_call_shape_is_answered_from_the_cache(monkeypatch):
    """Eager calls go through the caches: three calls with one call shape (a batch no other test uses) run the
    cost model's estimate once, and every call gives the estimate's answer."""
    estimates: Counter[str] = Counter()

    def counted(name):
        real = getattr(costs, name)

        def estimate(*shape):
            estimates[name] += 1
            return real(*shape)

        monkeypatch.setattr(costs, name, estimate)

    for name in ("tt_order_costs", "ttm_order_costs", "ttm_best_split"):
        counted(name)
    unused_batch = 7919
    calls = (
        (auto_tt_order, "tt_order_costs", _TT_FLIPS[1:]),
        (auto_ttm_order, "ttm_order_costs", _TTM_FLIPS[1:]),
        (ttm_merge_split, "ttm_best_split", _TTM_SPLIT_FLIPS[1:]),
    )
    for entry, name, shape in calls:
        estimates.clear()
        answers = {entry(unused_batch, *shape, True) for _ in range(3)}
        assert estimates[name] == 1
        assert len(answers) == 1
