"""The plateau test of a run: the relative change of an evaluation metric over its last fifth, against
hand computations, and the cases where it cannot be measured."""

import math

import pytest

from comera.train.plateau import (
    MIN_EVALUATIONS,
    MIN_STEPS,
    PLATEAU_TOLERANCE,
    TOO_SHORT,
    at_plateau,
    last_fifth_change,
    plateau_note,
)


def _evals(points, metric="loss"):
    return [{"kind": "eval", "step": step, "metrics": {metric: value}} for step, value in points]


def test_the_change_is_from_the_last_evaluation_at_or_before_four_fifths_to_the_last():
    records = _evals([(100, 6.0), (400, 5.0), (800, 4.0), (900, 3.96), (1000, 3.95)])
    records.insert(2, {"kind": "train", "step": 500, "loss": 1.0})
    assert last_fifth_change(records, "loss") == pytest.approx((3.95 - 4.0) / 4.0, rel=1e-12)
    assert at_plateau(last_fifth_change(records, "loss")) is False  # -1.25 %


def test_a_change_just_below_the_tolerance_is_a_plateau_and_one_at_it_is_not():
    below = _evals([(80, 2.0), (100, 2.0 * (1 - 0.999 * PLATEAU_TOLERANCE))])
    at = _evals([(80, 2.0), (100, 2.0 * (1 + PLATEAU_TOLERANCE))])
    assert at_plateau(last_fifth_change(below, "loss")) is True
    assert at_plateau(last_fifth_change(at, "loss")) is False


@pytest.mark.parametrize(
    "points",
    [
        [],
        [(100, 1.0)],
        [(90, 1.0), (100, 1.1)],  # no evaluation at or before step 80
        [(80, 0.0), (100, 1.0)],  # a change relative to 0
        [(80, math.nan), (100, 1.0)],  # the only earlier value is not finite
    ],
)
def test_without_two_usable_evaluations_the_change_is_not_measured(points):
    assert last_fifth_change(_evals(points), "loss") is None
    assert at_plateau(None) is None


def test_other_metrics_and_missing_values_are_ignored():
    records = _evals([(80, 10.0), (100, 11.0)], "perplexity") + _evals([(60, 4.0), (100, 5.0)])
    assert last_fifth_change(records, "perplexity") == pytest.approx(0.1)
    assert last_fifth_change(records, "loss") == pytest.approx(0.25)
    assert last_fifth_change(records, "accuracy") is None


def test_a_change_of_exactly_the_tolerance_is_not_a_plateau():
    """Boundary: ``|change| == PLATEAU_TOLERANCE`` exactly (1 / 100 is the double nearest 0.01, as is the
    constant) is not a plateau, either sign; the next double below is."""
    up = last_fifth_change(_evals([(80, 100.0), (100, 101.0)]), "loss")
    down = last_fifth_change(_evals([(80, 100.0), (100, 99.0)]), "loss")
    assert up == PLATEAU_TOLERANCE and down == -PLATEAU_TOLERANCE
    assert at_plateau(up) is False and at_plateau(down) is False
    assert at_plateau(math.nextafter(PLATEAU_TOLERANCE, 0.0)) is True


def test_a_short_run_is_too_short_to_judge_whatever_its_change():
    """A 6-step run evaluated twice with a flat loss is no plateau: fewer than five evaluations, or a last
    evaluation before step 100, is too short; five from step 100 on are judged by the change."""
    smoke = _evals([(3, 5.0), (6, 5.0)])
    assert at_plateau(last_fifth_change(smoke, "loss")) is True  # the bare change would call it one
    assert plateau_note(smoke, "loss") == TOO_SHORT == "too short to judge a plateau"
    four = _evals([(100, 5.0), (200, 4.0), (400, 3.0), (500, 3.0)])
    assert plateau_note(four, "loss") == TOO_SHORT
    early = _evals([(10, 5.0), (20, 4.0), (40, 3.0), (80, 3.0), (99, 3.0)])
    assert plateau_note(early, "loss") == TOO_SHORT
    flat = _evals([(20, 5.0), (40, 4.0), (60, 3.0), (80, 3.0), (100, 3.0 * (1 - 0.5 * PLATEAU_TOLERANCE))])
    assert (MIN_EVALUATIONS, MIN_STEPS) == (5, 100)
    assert plateau_note(flat, "loss") == "plateau"
    falling = _evals([(200, 5.0), (400, 4.0), (600, 3.0), (800, 3.0), (1000, 2.9)])
    assert plateau_note(falling, "loss") == "not at a plateau"
    assert plateau_note(_evals([(20, 5.0), (40, 4.0), (60, 3.0), (80, 0.0), (100, 1.0)]), "loss") is None
    assert plateau_note([], "loss") is None
