import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from comera import factorize, suggest_padding
from comera.tt.shapes import auto_modes, auto_num_modes, check_modes, max_ranks, resolve_ranks


def _brute_force_best_max(n, order):
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    best = None
    for combo in itertools.combinations_with_replacement(divisors, order):
        if math.prod(combo) == n:
            best = max(combo) if best is None else min(best, max(combo))
    return best


@given(st.integers(1, 600), st.integers(1, 4))
def test_factorize_is_balanced_sorted_and_exact(n, order):
    modes = factorize(n, order)
    assert len(modes) == order
    assert math.prod(modes) == n
    assert list(modes) == sorted(modes)
    assert max(modes) == _brute_force_best_max(n, order)


def test_factorize_known_values():
    assert factorize(768, 3) == (8, 8, 12)
    assert factorize(3072, 3) == (12, 16, 16)
    assert factorize(7, 3) == (1, 1, 7)
    assert factorize(10_000_000, 6) == (10, 10, 10, 20, 20, 25)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_factorize_rejects_bad_arguments(bad):
    with pytest.raises((ValueError, TypeError), match="n must be"):
        factorize(bad, 2)
    with pytest.raises((ValueError, TypeError), match="num_modes must be"):
        factorize(12, bad)


@given(st.integers(2, 5000), st.integers(1, 4))
def test_suggest_padding_is_minimal_and_balanced(n, order):
    padded = suggest_padding(n, order)
    limit = math.ceil(1.5 * n ** (1 / order))
    assert padded >= n
    assert max(factorize(padded, order)) <= max(limit, 2)
    for smaller in range(n, padded):
        assert max(factorize(smaller, order)) > max(limit, 2)


def test_padding_for_primes_and_well_folding_sizes():
    assert suggest_padding(97, 2) == 98
    assert suggest_padding(768, 3) == 768
    assert suggest_padding(30522, 4) > 30522
    with pytest.raises(ValueError, match="max_factor"):
        suggest_padding(1000, 2, max_factor=3)


def test_auto_modes_orders_and_direction():
    assert auto_num_modes(768) == 3
    assert auto_num_modes(16) == 1
    assert auto_modes(768) == (8, 8, 12)
    assert auto_modes(768, descending=True) == (12, 8, 8)
    assert math.prod(auto_modes(97)) == 98


def test_check_modes_messages():
    assert check_modes([8, 8, 12], 768, "in_shape") == (8, 8, 12)
    with pytest.raises(ValueError, match=r"prod\(in_shape\) = 512 must equal 768"):
        check_modes((8, 8, 8), 768, "in_shape")
    with pytest.raises(ValueError, match="positive ints"):
        check_modes((8, 0, 12), 768, "in_shape")
    with pytest.raises(ValueError, match="must be >= 100"):
        check_modes((9, 9), 100, "row_shape", allow_padding=True)


def test_rank_bounds_and_clipping():
    assert max_ranks((4, 5, 6)) == (4, 6)
    assert resolve_ranks(100, (4, 5, 6)) == (4, 6)
    assert resolve_ranks((1, 3, 2, 1), (4, 5, 6)) == (3, 2)
    # the neighbour rule: r_2 <= r_1 * c_2
    assert resolve_ranks((1, 50, 50), (2, 10, 10, 2)) == (1, 10, 2)
    with pytest.raises(ValueError, match="rank must be >= 1"):
        resolve_ranks(0, (4, 5))
    with pytest.raises(ValueError, match="one per bond"):
        resolve_ranks((2, 2, 2), (4, 5))
    with pytest.raises(ValueError, match="rank entries must be ints >= 1"):
        resolve_ranks((2, -1), (4, 5, 6))
