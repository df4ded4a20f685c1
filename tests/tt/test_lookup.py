"""TTM row lookup against the dense reconstruction ``ttm_full`` (float64), gradcheck, the split cost model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comera.tt.lookup as lookup_module
from comera.tt.cores import ttm_core_shapes, ttm_full
from comera.tt.lookup import (
    best_lookup_split,
    dedup_threshold,
    in_graph_capture,
    lookup_split_cost,
    row_digits,
    ttm_lookup,
    ttm_lookup_naive,
    ttm_lookup_rows,
    ttm_lookup_split,
)
from comera.tt.shapes import resolve_ranks

PAPER_SHAPES = ttm_core_shapes((16, 20, 10, 10), (4, 4, 8, 6), (32, 32, 32))


def random_cores(row_modes, col_modes, rank, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ranks = resolve_ranks(rank, [m * n for m, n in zip(row_modes, col_modes)])
    shapes = ttm_core_shapes(row_modes, col_modes, ranks)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True) for shape in shapes
    ]


def dense_reference(cores, indices, grad_out):
    """Rows and core gradients through the dense table (independent of the lookup code)."""
    rows = ttm_full(cores)[indices]
    grads = torch.autograd.grad((rows * grad_out).sum(), cores)
    return rows.detach(), grads


def assert_lookup_matches(cores, indices, **kwargs):
    out = ttm_lookup(cores, indices, **kwargs)
    assert out.shape == (indices.shape[0], math.prod(core.shape[2] for core in cores))
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * grad_out).sum(), cores)
    ref_rows, ref_grads = dense_reference(cores, indices, grad_out)
    torch.testing.assert_close(out.detach(), ref_rows, rtol=1e-10, atol=1e-10)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-10)


def test_row_digits_match_numpy_unravel():
    modes = (3, 4, 5)
    indices = torch.arange(60)
    digits = row_digits(indices, modes)
    expected = np.unravel_index(indices.numpy(), modes)
    for got, want in zip(digits, expected):
        np.testing.assert_array_equal(got.numpy(), want)


INDEX_CASES = {
    "duplicates": [5, 5, 0, 59, 5, 17, 0],
    "one": [42],
    "empty": [],
    "all_rows": list(range(60)),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
@pytest.mark.parametrize(
    "kwargs",
    [
        {"path": "naive", "dedup": False},
        {"path": "naive", "dedup": True},
        {"path": "optimized", "dedup": False},
        {"path": "optimized", "dedup": True},
        {"path": "optimized", "dedup": None},
        {"path": "optimized", "dedup": False, "split": 1},
        {"path": "optimized", "dedup": True, "split": 2},
    ],
    ids=lambda kwargs: "-".join(f"{key}={value}" for key, value in kwargs.items()),
)
def test_every_path_matches_dense_rows_and_gradients(case, kwargs):
    cores = random_cores((3, 4, 5), (2, 3, 2), 4)
    assert_lookup_matches(cores, torch.tensor(INDEX_CASES[case], dtype=torch.long), **kwargs)


@settings(max_examples=25, deadline=None)
@given(
    modes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4),
    rank=st.integers(1, 5),
    batch=st.integers(0, 12),
    seed=st.integers(0, 2**16),
    path=st.sampled_from(["naive", "optimized"]),
    dedup=st.sampled_from([False, True, None]),
)
def test_random_trains_match_dense(modes, rank, batch, seed, path, dedup):
    row_modes, col_modes = zip(*modes)
    cores = random_cores(row_modes, col_modes, rank, seed)
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, math.prod(row_modes), (batch,), generator=generator)
    assert_lookup_matches(cores, indices, path=path, dedup=dedup)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_lookup_matches_naive_for_each_split(split):
    cores = random_cores((2, 3, 2, 3), (2, 2, 1, 3), 3)
    indices = torch.tensor([0, 35, 7, 7, 20, 1])
    torch.testing.assert_close(ttm_lookup_split(cores, indices, split), ttm_lookup_naive(cores, indices))


def test_split_lookup_gradcheck():
    cores = random_cores((3, 2, 2), (2, 1, 2), 2)
    indices = torch.tensor([0, 11, 5, 5])
    for split in (1, 2):
        assert torch.autograd.gradcheck(
            lambda *c, split=split: ttm_lookup_split(list(c), indices, split), tuple(cores)
        )


def test_chunked_batched_gemm_matches_single_chunk(monkeypatch):
    cores = random_cores((4, 5, 6), (2, 3, 2), 4)
    indices = torch.randint(0, 120, (100,), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(lookup_module, "_CHUNK_ELEMENTS", 64)  # a handful of rows per chunk
    chunk_rows = []
    real_bmm = torch.bmm

    def counting_bmm(*args, **kwargs):
        if "out" in kwargs:  # the chunked batched GEMM writes into a slice of its output
            chunk_rows.append(kwargs["out"].shape[0])
        return real_bmm(*args, **kwargs)

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(torch, "bmm", counting_bmm)
        ttm_lookup(cores, indices, path="optimized", dedup=False)
    assert sum(chunk_rows) == 100 and max(chunk_rows) < 10  # the forward ran in chunks of a few rows
    assert_lookup_matches(cores, indices, path="optimized", dedup=False)


@settings(max_examples=25, deadline=None)
@given(
    modes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=2, max_size=4),
    rank=st.integers(1, 4),
    batch=st.integers(1, 40),
    chunk_elements=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_chunked_gemm_with_reused_buffers_matches_dense(modes, rank, batch, chunk_elements, seed):
    """Any chunk size (down to one row per chunk, a short last chunk) gives the dense rows and gradients."""
    row_modes, col_modes = zip(*modes)
    cores = random_cores(row_modes, col_modes, rank, seed)
    indices = torch.randint(0, math.prod(row_modes), (batch,), generator=torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lookup_module, "_CHUNK_ELEMENTS", chunk_elements)
        assert_lookup_matches(cores, indices, path="optimized", dedup=False)


def test_split_lookup_saves_no_per_row_or_table_sized_tensors():
    cores = random_cores((8, 8, 8), (4, 4, 4), 4)
    table_size = 512 * 64
    indices = torch.randint(0, 512, (2000,), generator=torch.Generator().manual_seed(0))
    saved_sizes = []

    def pack(tensor):
        saved_sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = ttm_lookup(cores, indices, path="optimized", dedup=False)
    assert out.shape == (2000, 64)
    # per-row slices would be 2000 * (4 + 16) * 4 entries; the table 512 * 64
    assert max(saved_sizes) < min(table_size, 2000 * 4)


def test_single_core_train_is_a_plain_gather():
    cores = random_cores((7,), (3,), 4)
    assert cores[0].shape == (1, 7, 3, 1)
    assert_lookup_matches(cores, torch.tensor([6, 0, 6]), path="optimized", dedup=None)
    assert_lookup_matches(cores, torch.tensor([6, 0, 6]), path="naive", dedup=True)


def test_split_out_of_range_raises():
    cores = random_cores((2, 3), (2, 2), 2)
    with pytest.raises(ValueError, match=r"split must be in \[1, 1\], got 2"):
        ttm_lookup_split(cores, torch.tensor([0]), 2)


def test_unknown_path_raises():
    cores = random_cores((2, 3), (2, 2), 2)
    with pytest.raises(ValueError, match="path must be one of"):
        ttm_lookup(cores, torch.tensor([0]), path="fast")


def test_auto_dedup_follows_the_repeat_rate():
    cores = random_cores((10, 10, 10), (2, 2, 2), 4)
    repeated = torch.zeros(500, dtype=torch.long)
    _, position = ttm_lookup_rows(cores, repeated, dedup=None)
    assert position is not None and position.shape == (500,)
    distinct = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:500]
    rows, position = ttm_lookup_rows(cores, distinct, dedup=None)
    assert position is None and rows.shape == (500, 8)
    _, position = ttm_lookup_rows(cores, repeated, dedup=False)
    assert position is None


def test_dedup_threshold_is_a_fraction():
    threshold = dedup_threshold(PAPER_SHAPES, 2)
    assert 0.0 < threshold < 1.0
    # rows that are cheap to compute (width 1, rank 1) need a larger share of repeats than the paper's
    assert dedup_threshold(ttm_core_shapes((10, 10), (1, 1), (1,)), 1) > threshold


def test_not_in_graph_capture_in_eager_mode():
    assert in_graph_capture() is False


def test_best_split_is_the_cheapest_and_handles_any_order():
    assert best_lookup_split(10_000, PAPER_SHAPES) == 2
    for order in range(2, 7):
        shapes = ttm_core_shapes((6,) * order, (2,) * order, resolve_ranks(8, (12,) * order))
        best = best_lookup_split(4096, shapes)
        costs = [lookup_split_cost(4096, shapes, split) for split in range(1, order)]
        assert costs[best - 1] == min(costs)


def test_best_split_prefers_the_small_rank_bond():
    shapes = ttm_core_shapes((8, 8, 8, 8), (4, 4, 4, 4), (16, 2, 16))
    assert best_lookup_split(10_000, shapes) == 2


def test_best_split_needs_two_cores():
    with pytest.raises(ValueError, match="at least 2 cores"):
        best_lookup_split(10, ttm_core_shapes((5,), (3,), ()))
