"""Argument checks and edge cases of :mod:`comera.tt.shapes`: exact error texts naming the argument, the
boundary cases of padding and of rank clipping.

References: error types and messages written out from the arguments; padded sizes, factorisations and
clipped ranks derived by hand in the comments.
"""

from __future__ import annotations

import re

import pytest

from comera.tt.shapes import auto_modes, auto_num_modes, check_modes, resolve_ranks, suggest_padding


def _exactly(message):
    return f"^{re.escape(message)}$"


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: auto_num_modes(0), ValueError, "n must be an int >= 1, got 0"),
        (lambda: auto_modes(10, num_modes=0), ValueError, "num_modes must be an int >= 1, got 0"),
        (lambda: auto_modes(10, num_modes=2.0), TypeError, "num_modes must be an int >= 1, got 2.0"),
        (lambda: suggest_padding(0, 2), ValueError, "n must be an int >= 1, got 0"),
        (lambda: suggest_padding(10, 0), ValueError, "num_modes must be an int >= 1, got 0"),
        (lambda: suggest_padding(10, 2, max_factor=0), ValueError, "max_factor must be an int >= 1, got 0"),
    ],
)
def test_positive_int_arguments_are_refused_by_name(call, error, message):
    with pytest.raises(error, match=_exactly(message)):
        call()


def test_padding_boundaries():
    # 3 into 4 modes: the default limit is max(2, ceil(1.5 * 3 ** 0.25)) = max(2, ceil(1.97)) = 2, and
    # 3 = 1 * 1 * 1 * 3 has a factor 3 > 2, so pad to 4 = 1 * 1 * 2 * 2
    assert suggest_padding(3, 4) == 4
    # max_factor ** num_modes == n is enough: 9 = 3 * 3
    assert suggest_padding(9, 2, max_factor=3) == 9
    with pytest.raises(
        ValueError, match=_exactly("max_factor must satisfy max_factor ** num_modes >= n (10), got 3")
    ):
        suggest_padding(10, 2, max_factor=3)


@pytest.mark.parametrize("modes", [[], {8, 96}, (8, True, 96), (8.0, 96.0)])
def test_check_modes_refuses_what_is_not_a_sequence_of_positive_ints(modes):
    """An empty list, a set (not a sequence, though its product would fit), a bool or a float entry."""
    if isinstance(modes, (list, set)):
        message = f"in_shape must be a non-empty sequence of positive ints, got {modes!r}"
    else:
        message = f"in_shape must contain positive ints, got {tuple(modes)!r}"
    with pytest.raises(ValueError, match=_exactly(message)):
        check_modes(modes, 768, "in_shape")


@pytest.mark.parametrize(
    "rank, message",
    [
        (True, "rank must be a positive int or a sequence of positive ints, got True"),
        (2.5, "rank must be a positive int or a sequence of positive ints, got 2.5"),
        ((2, True), "rank entries must be ints >= 1, got (2, True)"),
        ((2, 2, 2), "rank must have 2 entries (one per bond) or 4 with boundary 1s, got 3: (2, 2, 2)"),
    ],
)
def test_resolve_ranks_refuses_bad_ranks_with_exact_messages(rank, message):
    with pytest.raises(ValueError, match=_exactly(message)):
        resolve_ranks(rank, (4, 5, 6))


def test_resolve_ranks_boundary_form_with_one_and_zero_bonds():
    assert resolve_ranks((1, 3, 1), (4, 5)) == (3,)
    assert resolve_ranks((1, 1), (7,)) == ()  # a single core has no inner bond


def test_resolve_ranks_clips_against_the_right_neighbour():
    """Sizes (2, 2, 2, 2), requested (2, 4, 1): bounds (2, 4, 2) leave (2, 4, 1); left to right nothing
    changes (r_1 <= 2, r_2 <= 2 r_1 = 4, r_3 <= 2 r_2); right to left r_3 <= 2, r_2 <= c_3 r_3 = 2 * 1 = 2,
    r_1 <= c_2 r_2 = 4: (2, 2, 1)."""
    assert resolve_ranks((2, 4, 1), (2, 2, 2, 2)) == (2, 2, 1)
