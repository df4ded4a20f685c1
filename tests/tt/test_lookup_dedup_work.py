"""Deduplicated lookups contract each distinct row once: the work is counted, not just the output compared.

The contraction functions of :mod:`comera.tt.lookup` (``ttm_lookup_split`` and ``ttm_lookup_naive``) are
wrapped by spies that record the indices they are asked for; outputs and core gradients are checked against
the dense table (float64), so a lookup that skips work wrongly fails as well.
"""

from __future__ import annotations

import pytest
import torch
from lookup_reference import assert_lookup_matches_the_table

import comera.tt.lookup as lookup_module
from comera import TTMEmbedding
from comera.tt.cores import ttm_core_shapes, ttm_full
from comera.tt.lookup import ttm_lookup, ttm_lookup_rows

_INDICES = torch.tensor([5, 3, 5, 5, 9, 3, 5, 0])  # distinct: 0, 3, 5, 9


def _cores(row_modes=(3, 4), col_modes=(2, 3), ranks=(3,)):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
        for shape in ttm_core_shapes(row_modes, col_modes, ranks)
    ]


@pytest.fixture
def contracted(monkeypatch):
    """The index tensors handed to the lookup's contraction functions, in call order."""
    calls: list[torch.Tensor] = []
    for name in ("ttm_lookup_split", "ttm_lookup_naive"):
        original = getattr(lookup_module, name)

        def spy(cores, indices, *args, original=original, **kwargs):
            calls.append(indices.clone())
            return original(cores, indices, *args, **kwargs)

        monkeypatch.setattr(lookup_module, name, spy)
    return calls


@pytest.mark.parametrize("path", ["optimized", "naive"])
def test_dedup_contracts_each_distinct_row_once(contracted, path):
    cores = _cores()
    out = ttm_lookup(cores, _INDICES, path=path, dedup=True)
    assert len(contracted) == 1
    assert sorted(contracted[0].tolist()) == [0, 3, 5, 9]
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * grad_out).sum(), cores)
    assert_lookup_matches_the_table(out, grads, cores, _INDICES, grad_out)


@pytest.mark.parametrize("path", ["optimized", "naive"])
def test_without_dedup_every_index_is_contracted(contracted, path):
    ttm_lookup(_cores(), _INDICES, path=path, dedup=False)
    assert len(contracted) == 1 and contracted[0].tolist() == _INDICES.tolist()


def test_dedup_true_deduplicates_even_below_the_repeat_threshold(contracted):
    cores = _cores((10, 10), (2, 2), (4,))
    indices = torch.cat([torch.arange(99), torch.tensor([7])])  # 1 % repeats, far below any threshold
    assert ttm_lookup_rows(cores, indices, dedup=None)[1] is None  # the automatic rule would not deduplicate
    contracted.clear()
    rows, position = ttm_lookup_rows(cores, indices, dedup=True)
    assert [len(call) for call in contracted] == [99]
    assert rows.shape == (99, 4) and position is not None
    torch.testing.assert_close(rows[position], ttm_full(cores)[indices], rtol=1e-12, atol=1e-12)


def test_single_core_train_computes_each_distinct_row_once():
    cores = _cores((12,), (5,), ())
    rows, position = ttm_lookup_rows(cores, _INDICES, dedup=True)
    assert rows.shape == (4, 5)
    torch.testing.assert_close(rows[position], ttm_full(cores)[_INDICES])


def test_embedding_optimized_lookup_contracts_distinct_rows_once(contracted):
    table = TTMEmbedding(12, 6, row_shape=(3, 4), col_shape=(2, 3), rank=3, lookup="optimized")
    ids = _INDICES.reshape(2, 4)
    out = table(ids)
    assert [sorted(call.tolist()) for call in contracted] == [[0, 3, 5, 9]]
    torch.testing.assert_close(out, table.to_dense()[ids])
    contracted.clear()
    table.lookup = "split"
    table(ids)
    assert [call.tolist() for call in contracted] == [_INDICES.tolist()]
