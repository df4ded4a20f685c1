"""``ttm_lookup``'s defaults and its ``split`` argument reach the lookup.

References: rows of the float64 dense table (:func:`comera.tt.cores.ttm_full`); the work of a split lookup
(a ``TorchDispatchMode`` sums ``2 m k n`` over the GEMMs dispatched) against hand-counted FLOPs of the
merges and the batched GEMM at the requested split (derived in ``_split_flops``).

The train: row modes ``(2, 3, 4)``, column modes ``(3, 2, 2)``, bond ranks ``(2, 3)``; cores
``F_k (r_{k-1}, m_k, n_k, r_k)``.
"""

from __future__ import annotations

import pytest
import torch
from tt_dispatch import GemmFlops, OpNames

from comera.tt.cores import ttm_core_shapes, ttm_full
from comera.tt.lookup import ttm_lookup

_INDICES = torch.tensor([0, 7, 23, 11, 5])  # distinct rows of the 24-row table


def _cores():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
        for shape in ttm_core_shapes((2, 3, 4), (3, 2, 2), (2, 3))
    ]


def test_default_path_is_the_optimized_lookup_and_matches_the_dense_rows():
    cores = _cores()
    torch.testing.assert_close(ttm_lookup(cores, _INDICES), ttm_full(cores)[_INDICES], rtol=1e-12, atol=1e-12)


def _split_flops(split: int, batch: int = 5) -> int:
    """FLOPs (2 per multiply-add) of a split lookup without backward.

    split 1: A = F_1 as is; C = F_2 x F_3 over r_2 = 3: (r_1 m_2 n_2) (m_3 n_3) outputs = 2 * 3 * 2 * 4 * 2
        = 96 entries, 3 MACs each; rows: B (n_1, r_1) @ (r_1, n_2 n_3) = 5 * 3 * 2 * 4 MACs.
    split 2: A = F_1 x F_2 over r_1 = 2: (m_1 n_1) (m_2 n_2 r_2) = 6 * 18 = 108 entries, 2 MACs each; C = F_3
        as is; rows: B (n_1 n_2, r_2) @ (r_2, n_3) = 5 * 6 * 3 * 2 MACs.
    """
    macs = {1: 96 * 3 + batch * 3 * 2 * 4, 2: 108 * 2 + batch * 6 * 3 * 2}[split]
    return 2 * macs


@pytest.mark.parametrize("split", [1, 2])
def test_requested_split_is_the_one_computed(split):
    cores = _cores()
    assert _split_flops(1) != _split_flops(2)
    with torch.no_grad(), GemmFlops() as counter:
        rows = ttm_lookup(cores, _INDICES, dedup=False, split=split)
    assert counter.flops == _split_flops(split)
    torch.testing.assert_close(rows, ttm_full(cores)[_INDICES], rtol=1e-12, atol=1e-12)


def test_split_out_of_range_is_refused_by_ttm_lookup():
    with pytest.raises(ValueError, match=r"split must be in \[1, 2\], got 3"):
        ttm_lookup(_cores(), _INDICES, dedup=False, split=3)


def test_naive_path_runs_the_per_index_chain():
    """Naive: per index, (n_1, r_1) @ (r_1, n_2 r_2), then (n_1 n_2, r_2) @ (r_2, n_3):
    2 * 5 * (3 * 2 * 6 + 6 * 3 * 2) = 720 FLOPs for 5 rows, unlike either split (816, 792)."""
    cores = _cores()
    with torch.no_grad(), GemmFlops() as counter:
        rows = ttm_lookup(cores, _INDICES, path="naive", dedup=False)
    assert counter.flops == 2 * 5 * (3 * 2 * 6 + 6 * 3 * 2)
    torch.testing.assert_close(rows, ttm_full(cores)[_INDICES], rtol=1e-12, atol=1e-12)


def test_a_single_index_is_not_checked_for_repeats():
    """One index cannot repeat: the automatic dedup rule runs no ``unique`` (a host sync) for it."""
    cores = _cores()
    with torch.no_grad(), OpNames() as ops:
        rows = ttm_lookup(cores, _INDICES[:1])
    assert not [name for name in ops.names if "unique" in name]
    torch.testing.assert_close(rows, ttm_full(cores)[_INDICES[:1]], rtol=1e-12, atol=1e-12)
    with torch.no_grad(), OpNames() as ops:
        ttm_lookup(cores, _INDICES[:2])
    assert [name for name in ops.names if "unique" in name]  # two indices are checked
