"""``comera.measure.interleaved_medians_ms``: rounds added until the minimum time, capped, and bad arguments
refused by name."""

import pytest

import comera.measure as measure
from comera.measure import interleaved_medians_ms


class _Clock:
    """A fake ``time.perf_counter``: every call to a timed function advances it by that function's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _timed(clock, calls, name, cost):
    def run():
        calls.append(name)
        clock.now += cost

    return run


def _run(monkeypatch, costs, **kwargs):
    clock, calls = _Clock(), []
    monkeypatch.setattr(measure.time, "perf_counter", clock)
    fns = {name: _timed(clock, calls, name, cost) for name, cost in costs.items()}
    return interleaved_medians_ms(fns, **kwargs), calls


def test_without_a_minimum_time_exactly_the_repeats_run_after_the_warmup(monkeypatch):
    medians, calls = _run(monkeypatch, {"a": 0.001, "b": 0.002}, repeats=5, warmup=2)
    assert calls.count("a") == calls.count("b") == 2 + 5
    assert medians == pytest.approx({"a": 1.0, "b": 2.0})


def test_rounds_are_added_until_the_timed_runs_took_the_minimum_time(monkeypatch):
    """Rounds of 3 ms: 0.1 s is reached after 34 rounds (33 give 99 ms), warm-up runs not counted."""
    _, calls = _run(monkeypatch, {"a": 0.001, "b": 0.002}, repeats=3, warmup=1, min_seconds=0.1)
    assert calls.count("a") == calls.count("b") == 1 + 34


def test_long_functions_run_only_the_repeats_and_short_ones_stop_at_the_cap(monkeypatch):
    _, long_calls = _run(monkeypatch, {"a": 1.0}, repeats=4, warmup=0, min_seconds=2.0)
    assert len(long_calls) == 4
    _, short_calls = _run(monkeypatch, {"a": 1e-6}, repeats=4, warmup=0, min_seconds=10.0, max_repeats=50)
    assert len(short_calls) == 50


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repeats": 0}, "repeats must be in \\[1, max_repeats=1000\\], got 0"),
        ({"repeats": 20, "max_repeats": 10}, "repeats must be in \\[1, max_repeats=10\\], got 20"),
        ({"min_seconds": -1.0}, "min_seconds must be >= 0, got -1.0"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        interleaved_medians_ms({"a": lambda: None}, **kwargs)
