import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from comera.checks import check_bool, check_choice, check_int, check_number, check_optional_int


@given(st.integers(-50, 50), st.integers(-50, 50), st.integers(-50, 50))
def test_check_int_accepts_exactly_the_closed_range(value, low, high):
    if low <= value <= high:
        assert check_int(value, "n", low, high) == value
    else:
        with pytest.raises(ValueError, match=rf"n must be an int in \[{low}, {high}\], got {value}"):
            check_int(value, "n", low, high)


def test_check_int_refuses_bools_floats_and_strings():
    for bad in (True, 2.0, "2", None):
        with pytest.raises(ValueError, match="n must be an int >= 0"):
            check_int(bad, "n", 0)
    assert check_optional_int(None, "n", 1) is None
    with pytest.raises(ValueError, match="n must be an int <= 3"):
        check_int(4, "n", high=3)


@given(st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_check_number_half_open_interval(value):
    inside = math.isfinite(value) and 0.0 < value <= 1.0
    if inside:
        assert check_number(value, "x", 0.0, 1.0, open_low=True) == value
    else:
        with pytest.raises(ValueError, match=r"x must be a finite number in \(0.0, 1.0\]"):
            check_number(value, "x", 0.0, 1.0, open_low=True)


def test_an_infinite_end_of_the_interval_is_written_open_as_no_finite_value_reaches_it():
    """A finite number is required, so ``inf`` itself is refused: the message says ``(0.0, inf)``, not
    ``(0.0, inf]``, which would claim that ``inf`` is accepted."""
    for value in (math.inf, -1.0):
        with pytest.raises(ValueError, match=r"x must be a finite number in \(0.0, inf\), got"):
            check_number(value, "x", 0.0, open_low=True)
    with pytest.raises(ValueError, match=r"x must be a finite number in \(-inf, 1.0\], got inf"):
        check_number(math.inf, "x", high=1.0)


def test_check_number_open_high_and_bools():
    with pytest.raises(ValueError, match=r"in \[0.0, 1.0\)"):
        check_number(1.0, "x", 0.0, 1.0, open_high=True)
    with pytest.raises(ValueError):
        check_number(True, "x")
    assert check_number(3, "x") == 3.0 and isinstance(check_number(3, "x"), float)


def test_check_choice_and_bool():
    assert check_choice("step", "unit", ("epoch", "step")) == "step"
    with pytest.raises(ValueError, match=r"unit must be one of \('epoch', 'step'\), got 'steps'"):
        check_choice("steps", "unit", ("epoch", "step"))
    with pytest.raises(ValueError, match="one of"):
        check_choice(True, "k", (1, 2))
    assert check_bool(False, "b") is False
    with pytest.raises(ValueError, match="b must be True or False, got 0"):
        check_bool(0, "b")
