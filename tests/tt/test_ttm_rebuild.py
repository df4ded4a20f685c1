"""Rebuilding a TTM matrix split at a bond, and the ``"dense"`` TTM order that uses it.

The reference is independent of the merge code: every entry of the matrix is the product of the cores'
``(r_{k-1}, r_k)`` slices at that entry's row and column digits, in float64.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera.tt.costs import DEFAULT_COST_MODEL, _full_ranks, _ttm_rebuild_merges, ttm_rebuild_split
from comera.tt.merge import merge_ttm_matrix
from comera.tt.paths import ttm_linear


def _cores(row_modes, col_modes, ranks, seed=0):
    generator = torch.Generator().manual_seed(seed)
    full = (1, *ranks, 1)
    return [
        torch.randn(full[k], i, j, full[k + 1], generator=generator, dtype=torch.float64)
        for k, (i, j) in enumerate(zip(row_modes, col_modes))
    ]


def _entrywise_matrix(cores):
    """``W[row, col]`` = product over k of ``core_k[:, row digit k, col digit k, :]`` (row-major digits)."""
    row_modes = [core.shape[1] for core in cores]
    col_modes = [core.shape[2] for core in cores]
    matrix = torch.empty(math.prod(row_modes), math.prod(col_modes), dtype=torch.float64)
    for row, row_digits in enumerate(itertools.product(*map(range, row_modes))):
        for col, col_digits in enumerate(itertools.product(*map(range, col_modes))):
            product = torch.ones(1, 1, dtype=torch.float64)
            for core, i, j in zip(cores, row_digits, col_digits):
                product = product @ core[:, i, j, :]
            matrix[row, col] = product[0, 0]
    return matrix


_SHAPES = st.integers(1, 4).flatmap(
    lambda d: st.tuples(
        st.lists(st.integers(1, 4), min_size=d, max_size=d),
        st.lists(st.integers(1, 4), min_size=d, max_size=d),
        st.lists(st.integers(1, 4), min_size=d - 1, max_size=d - 1),
    )
)


@settings(max_examples=40, deadline=None)
@given(shapes=_SHAPES, seed=st.integers(0, 2**16))
def test_every_split_rebuilds_the_entrywise_matrix(shapes, seed):
    row_modes, col_modes, ranks = shapes
    cores = _cores(row_modes, col_modes, ranks, seed)
    reference = _entrywise_matrix(cores)
    for split in range(1, len(cores) + 1):
        torch.testing.assert_close(merge_ttm_matrix(cores, split), reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merge_ttm_matrix(cores), reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("split", [0, 4, -1])
def test_a_split_outside_the_train_names_the_range(split):
    cores = _cores((2, 2, 2), (2, 2, 2), (2, 2))
    with pytest.raises(ValueError, match=r"split must be in \[1, 3\], got " + str(split)):
        merge_ttm_matrix(cores, split)


def test_the_rebuild_split_is_the_cheapest_listed_and_avoids_a_matrix_sized_chain():
    """The paper's word-embedding table (rows (9, 14, 19, 21), columns (8, 6, 4, 4), ranks (72, 128, 84)):
    a left-to-right chain ends in a (459648, 84) @ (84, 84) product; the chosen split joins two small
    halves with one product over the middle bond instead."""
    rows, cols, ranks = (9, 14, 19, 21), (8, 6, 4, 4), (72, 128, 84)
    full = _full_ranks(ranks)
    costs = {
        split: DEFAULT_COST_MODEL.kernels_time(_ttm_rebuild_merges(rows, cols, full, split))
        for split in range(1, 5)
    }
    chosen = ttm_rebuild_split(rows, cols, ranks)
    assert costs[chosen] == min(costs.values())
    assert chosen == 2
    macs = {split: sum(g.macs for g in _ttm_rebuild_merges(rows, cols, full, split)) for split in (2, 4)}
    assert macs[2] < 0.7 * macs[4]


@pytest.mark.parametrize("batch", [2, 40])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_order_with_padded_rows_and_columns_matches_the_reference(batch, with_bias):
    """``in_features`` and ``out_features`` below the modes' products, batches below and above the
    weight's row count (the two ways of dropping padded columns); values and gradients in float64."""
    row_modes, col_modes, ranks = (3, 4, 2), (2, 5, 3), (3, 4)
    cores = [core.requires_grad_() for core in _cores(row_modes, col_modes, ranks, seed=3)]
    in_features, out_features = 22, 26
    x = torch.randn(batch, in_features, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(out_features, dtype=torch.float64, requires_grad=True) if with_bias else None
    y = ttm_linear(x, cores, out_features, bias, "dense")
    weight = _entrywise_matrix([core.detach() for core in cores])[:in_features, :out_features]
    expected = x.detach() @ weight + (bias.detach() if with_bias else 0)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    inputs = [x, *cores] + ([bias] if with_bias else [])

    def run(*flat):
        return ttm_linear(flat[0], list(flat[1:4]), out_features, flat[4] if with_bias else None, "dense")

    assert torch.autograd.gradcheck(run, inputs)


@pytest.mark.parametrize("order", ["merge", "sequential", "dense"])
def test_every_order_pins_the_zero_output_to_the_bias(order):
    row_modes, col_modes, ranks = (3, 4), (2, 5), (3,)
    cores = [core.requires_grad_() for core in _cores(row_modes, col_modes, ranks, seed=5)]
    x = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    weight = _entrywise_matrix(cores)[:, :9].clone()
    weight[:, 4] = 0.0
    want = x @ weight + bias
    got = ttm_linear(x, cores, 9, bias, order, zero_output=4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [x, bias, *cores]
    upstream = torch.randn_like(got)
    for g, w in zip(
        torch.autograd.grad((got * upstream).sum(), inputs),
        torch.autograd.grad((want * upstream).sum(), inputs),
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"zero_output must be in \[0, 8\] or None, got 9"):
        ttm_linear(x, cores, 9, bias, order, zero_output=9)
