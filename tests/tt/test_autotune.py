"""Autotuning (comera.tt.autotune): measured choices, their cache, the switches that keep the estimates, and
the layers and blocked GEMMs that use it. Timings are replaced by a fake clock wherever the choice itself is
checked, so no assertion depends on the machine's speed."""

import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera import TTLinear, TTMLinear
from comera.tt import autotune as autotune_module
from comera.tt import blocked
from comera.tt.autotune import (
    autotune,
    autotune_cache,
    autotune_enabled,
    clear_autotune_cache,
    set_autotune,
    size_bucket,
    tuned,
)
from comera.tt.costs import CONTESTED_MARGIN, ORDERS, contested_orders


class FakeClock:
    """``perf_counter`` that advances only by what a fake run costs."""

    def __init__(self, costs):
        self.now = 0.0
        self.costs = costs
        self.runs = []

    def perf_counter(self):
        return self.now

    def run(self, candidate):
        self.runs.append(candidate)
        self.now += self.costs[candidate]


@pytest.fixture
def fake_clock(monkeypatch):
    def install(costs):
        clock = FakeClock(costs)
        monkeypatch.setattr(autotune_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
        return clock

    return install


@pytest.fixture
def tuning():
    with autotune(True):
        yield


def test_the_fastest_candidate_is_measured_once_and_cached(tuning, fake_clock):
    clock = fake_clock({"a": 3.0, "b": 1.0, "c": 2.0})
    cpu = torch.device("cpu")
    assert tuned("shape", lambda: ("a", "b", "c"), "a", clock.run, cpu) == "b"
    # one warm-up and REPEATS timed rounds, round-robin
    assert clock.runs == ["a", "b", "c"] * (1 + autotune_module.REPEATS)
    clock.runs.clear()
    assert tuned("shape", lambda: ("a", "b", "c"), "a", clock.run, cpu) == "b"
    assert clock.runs == []
    assert autotune_cache() == {"shape": "b"}
    clear_autotune_cache()
    assert autotune_cache() == {}


def test_median_not_mean_decides(tuning, monkeypatch):
    """One slow outlier round (a preempted run) does not decide: ``a`` costs 5 (warm-up), 0, 0, 5, ``b``
    always 1; the medians are 0 and 1, the means 1.7 and 1."""
    now = [0.0]
    monkeypatch.setattr(autotune_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    costs_of_a = iter([5.0, 0.0, 0.0, 5.0])

    def run(candidate):
        now[0] += next(costs_of_a) if candidate == "a" else 1.0

    assert tuned("outlier", lambda: ("a", "b"), "estimate", run, torch.device("cpu")) == "a"


def test_a_lucky_round_does_not_overturn_the_estimate(tuning, monkeypatch):
    """``b`` has the smaller median, but one of its runs is slower than the estimate's median: the
    estimate ``a`` stays; when every run of ``b`` beats it, ``b`` is chosen."""
    now = [0.0]
    monkeypatch.setattr(autotune_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    for costs_of_b, expected in (([0.0, 1.0, 1.0, 9.0], "a"), ([0.0, 1.0, 1.0, 1.5], "b")):
        costs = {"a": iter([0.0, 2.0, 2.0, 2.0]), "b": iter(costs_of_b)}

        def run(candidate, costs=costs):
            now[0] += next(costs[candidate])

        assert tuned(("lucky", expected), lambda: ("a", "b"), "a", run, torch.device("cpu")) == expected


@pytest.mark.parametrize(
    ("seconds_per_run", "rounds"),
    [(1.0, 3), (0.02, 3), (0.008, 5), (0.0001, 15)],
)
def test_short_candidates_get_more_rounds(tuning, fake_clock, seconds_per_run, rounds):
    """Rounds are added while the timed rounds took less than MEASURE_SECONDS (0.05 s), from REPEATS (3) up
    to MAX_REPEATS (15): candidates of 8 and 4 ms a run take 12 ms a round: the fifth passes 50 ms."""
    assert (autotune_module.REPEATS, autotune_module.MAX_REPEATS) == (3, 15)
    assert autotune_module.MEASURE_SECONDS == 0.05
    clock = fake_clock({"a": seconds_per_run, "b": seconds_per_run * 0.5})
    assert tuned(("rounds", rounds), lambda: ("a", "b"), "a", clock.run, torch.device("cpu")) == "b"
    assert clock.runs == ["a", "b"] * (1 + rounds)


@pytest.mark.parametrize(("slow_rounds", "expected"), [(3, "b"), (4, "a")])
def test_a_quarter_of_slow_rounds_does_not_keep_the_estimate(tuning, monkeypatch, slow_rounds, expected):
    """15 rounds: ``b`` (median 1) beats the estimate ``a`` (2 every round) unless more than a quarter of
    its rounds (15 // 4 = 3) are slower than ``a``'s median."""
    now = [0.0]
    monkeypatch.setattr(autotune_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(autotune_module, "MEASURE_SECONDS", 1e9)
    costs = {"a": iter([2.0] * 16), "b": iter([1.0] + [9.0] * slow_rounds + [1.0] * (15 - slow_rounds))}

    def run(candidate):
        now[0] += next(costs[candidate])

    assert tuned(("quarter", slow_rounds), lambda: ("a", "b"), "a", run, torch.device("cpu")) == expected


def test_single_candidate_is_not_measured(tuning, fake_clock):
    clock = fake_clock({"a": 1.0})
    assert tuned("one", lambda: ("a",), "a", clock.run, torch.device("cpu")) == "a"
    assert clock.runs == []


def test_switches_keep_the_estimate(fake_clock):
    clock = fake_clock({"a": 3.0, "b": 1.0})
    cpu = torch.device("cpu")
    with autotune(False):
        assert not autotune_enabled()
        assert tuned("off", lambda: ("a", "b"), "a", clock.run, cpu) == "a"
    with autotune(True):
        assert autotune_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            assert not autotune_enabled()
            assert tuned("deterministic", lambda: ("a", "b"), "a", clock.run, cpu) == "a"
        finally:
            torch.use_deterministic_algorithms(False)
        # a cached choice is not used while autotuning is off either: the estimate decides there
        assert tuned("cached", lambda: ("a", "b"), "a", clock.run, cpu) == "b"
    assert tuned("cached", lambda: ("a", "b"), "a", clock.run, cpu) == "a"
    assert clock.runs.count("a") == 1 + autotune_module.REPEATS


def test_set_autotune_checks_its_argument():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        set_autotune(1)


def test_environment_variable_turns_it_off():
    code = "from comera.tt.autotune import autotune_enabled; print(autotune_enabled())"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {"COMERA_AUTOTUNE": value, "PATH": ""}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


@given(st.integers(0, 2**40))
def test_size_bucket_is_the_power_of_two_range(size):
    bucket = size_bucket(size)
    if size == 0:
        assert bucket == 0
    else:
        assert 2 ** (bucket - 1) <= size < 2**bucket


@given(st.dictionaries(st.sampled_from(ORDERS), st.floats(0.001, 1e6), min_size=1))
def test_contested_orders_are_those_within_the_margin(costs):
    contested = contested_orders(costs)
    cheapest = min(costs.values())
    assert set(contested) == {name for name, cost in costs.items() if cost <= CONTESTED_MARGIN * cheapest}
    assert list(contested) == [name for name in ORDERS if name in contested]
    assert min(costs, key=costs.get) in contested


def test_contested_orders_needs_costs():
    with pytest.raises(ValueError, match="costs must name"):
        contested_orders({})


def _slow_except(fast: str):
    """Fake timings: ``fast`` is the fastest order in every run, every other candidate slower."""

    def timed(candidates, run, device):
        for candidate in candidates:
            run(candidate)
        return {candidate: [0.001 if candidate == fast else 1.0] * 3 for candidate in candidates}

    return timed


@pytest.mark.parametrize("layer_type", [TTLinear, TTMLinear])
def test_layer_runs_the_measured_order_and_stays_exact(tuning, monkeypatch, layer_type):
    """The cost model picks one order, the (faked) measurement another: the layer runs the measured one (its
    output is bit for bit that of the layer fixed to that order, not that of the estimate), gives the float64
    dense result with it, leaves no gradient on the parameters and draws no random number while measuring."""
    layer = layer_type(24, 20, rank=3).double()
    x = torch.randn(6, 24, dtype=torch.float64, requires_grad=True)
    with autotune(False):
        estimate = layer.chosen_order(x)
    contested = contested_orders(layer.order_costs(6, True), margin=float("inf"))
    other = next(order for order in contested if order != estimate)
    monkeypatch.setattr(
        "comera.nn.linear.contested_orders", lambda costs: contested_orders(costs, float("inf"))
    )
    monkeypatch.setattr(autotune_module, "_timed_seconds", _slow_except(other))
    rng = torch.get_rng_state()
    out = layer(x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in layer.parameters())
    fixed = {}
    for order in (other, estimate):
        layer.order = order
        fixed[order] = layer(x.detach())
    layer.order = "auto"
    assert torch.equal(out, fixed[other]) and not torch.equal(out, fixed[estimate])
    dense = layer.to_dense()
    torch.testing.assert_close(out, x @ dense.T + layer.bias, rtol=1e-10, atol=1e-10)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(6, 20, dtype=torch.float64) @ dense)
    assert layer.chosen_order(x) == other


def test_real_measurement_gives_correct_results(tuning):
    """No fakes: the first call measures (the cache gains the call shape), results match float64."""
    layer = TTLinear(64, 48, rank=4)
    x = torch.randn(33, 64, requires_grad=True)
    out = layer(x)
    keys = [key for key in autotune_cache() if key[0] == "TTLinear"]
    contested = layer.candidate_orders(33, True)
    if len(contested) > 1:
        assert len(keys) == 1 and autotune_cache()[keys[0]] in contested
    reference = x.double() @ layer.double().to_dense().T + layer.bias.double()
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=1e-4)
    out.square().sum().backward()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


def test_compiled_layer_never_measures(tuning, monkeypatch):
    def refuse(*args):
        raise AssertionError("measured inside a trace")

    layer = TTLinear(24, 20, rank=3)
    x = torch.randn(7, 24)
    with torch.no_grad():
        want = layer(x)  # eager: may measure (the cache is then filled for eager calls only)
        clear_autotune_cache()
        monkeypatch.setattr(autotune_module, "_timed_seconds", refuse)
        got = torch.compile(layer, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocked_gemm_split_is_measured(tuning, monkeypatch, threads):
    threads(2)
    monkeypatch.setattr(blocked, "MIN_ROWS_PER_BLOCK", 4)
    first, second = torch.randn(40, 3), torch.randn(3, 2000)  # wider than MAX_WIDTH: the rule says 1 block
    assert blocked.rule_blocks(40, 2000, first.device) == 1
    monkeypatch.setattr(autotune_module, "_timed_seconds", _slow_except(2))
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real_bmm(*a, **k))
    out = blocked.blocked_mm_into(first, second, torch.empty(40, 2000))
    torch.testing.assert_close(out, first @ second)
    assert calls  # the measured split ran
    calls.clear()
    summed = blocked.blocked_batch_sum_mm(torch.randn(3, 40), torch.randn(40, 2000))
    assert summed.shape == (3, 2000)
    assert calls
    with autotune(False):
        calls.clear()
        blocked.blocked_mm_into(first, second, torch.empty(40, 2000))
        assert not calls  # the rule again


@pytest.mark.parametrize("with_bias", [True, False])
def test_factors_order_gradcheck_against_merge(with_bias):
    """The plain-autograd run of the merge order: gradcheck, and equal to the merge-first function."""
    from comera.tt.paths import FACTORS, tt_linear

    cores = [
        torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True),
        torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 5, 1, dtype=torch.float64, requires_grad=True),
    ]
    gates = [torch.rand(3, dtype=torch.float64, requires_grad=True) + 0.5]
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)  # 5 of the 6 padded input entries
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_bias else None

    def factors(x, bias, *tensors):
        return tt_linear(x, tensors[:3], 2, 4, bias, order=FACTORS, gates=tensors[3:])

    assert torch.autograd.gradcheck(factors, (x, bias, *cores, *gates))
    merged = tt_linear(x, cores, 2, 4, bias, order="merge", gates=gates)
    torch.testing.assert_close(factors(x, bias, *cores, *gates), merged, rtol=1e-12, atol=1e-12)


def test_tt_candidates_add_factors_beside_merge():
    layer = TTLinear(768, 768, rank=30)
    candidates = layer.candidate_orders(4096, True)
    assert "merge" in candidates and candidates[-1] == "factors"
    assert "factors" not in TTMLinear(768, 768, rank=30).candidate_orders(4096, True)


def test_a_measurement_inside_a_checkpointed_region_leaves_its_recomputation_matching(tuning, fake_clock):
    """The timed runs save tensors for a backward of their own; under ``torch.utils.checkpoint`` (what Hugging
    Face's ``gradient_checkpointing`` runs) they must not reach the checkpoint's hooks, or the recomputation,
    which finds the choice cached and measures nothing, saves fewer tensors than the forward did."""
    clock = fake_clock({"a": 2.0, "b": 1.0})
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)

    def timed(candidate):
        clock.run(candidate)
        copy = x.detach().requires_grad_(True)
        torch.autograd.grad((copy * 3).exp().sum(), copy)

    def region(inputs):
        chosen = tuned("checkpointed", lambda: ("a", "b"), "a", timed, torch.device("cpu"))
        return inputs.sin() * (2.0 if chosen == "b" else 1.0)

    torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * x.detach().cos())
    assert autotune_cache()["checkpointed"] == "b"
