"""``TTMEmbedding`` with sequence-first ids and every layout of the upstream gradient (contiguous, sequence-
first, column-major, expanded by ``out.sum()``) gives the forward and core gradients of a float64
``nn.Embedding`` holding its table, with every lookup and with a ``padding_idx``.

Reference: ``functional.embedding`` over :meth:`TTMEmbedding.to_dense` (float64), differentiated by autograd.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from comera import TTMEmbedding

_BATCH, _STEPS, _DIM = 6, 5, 12


def _upstream(layout: str) -> torch.Tensor:
    """A ``(batch, steps, dim)`` float64 gradient laid out as ``layout``."""
    generator = torch.Generator().manual_seed(2)
    if layout == "contiguous":
        return torch.randn(_BATCH, _STEPS, _DIM, dtype=torch.float64, generator=generator)
    if layout == "sequence-first":
        return torch.randn(_STEPS, _BATCH, _DIM, dtype=torch.float64, generator=generator).transpose(0, 1)
    if layout == "column-major":
        return torch.randn(_DIM, _STEPS, _BATCH, dtype=torch.float64, generator=generator).permute(2, 1, 0)
    return torch.ones((), dtype=torch.float64).expand(_BATCH, _STEPS, _DIM)


@pytest.mark.parametrize("layout", ["contiguous", "sequence-first", "column-major", "expanded"])
@pytest.mark.parametrize("lookup", ["naive", "split", "optimized"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_every_gradient_layout_matches_the_dense_embedding(layout, lookup, padding_idx):
    table = TTMEmbedding(
        40, _DIM, padding_idx, row_shape=(4, 10), col_shape=(3, 4), rank=3, lookup=lookup, dtype=torch.float64
    )
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 12, (_STEPS, _BATCH), generator=generator).t()  # sequence-first, repeats
    ids[0, 0] = 3
    grad = _upstream(layout)
    out = table(ids)
    grads = torch.autograd.grad(out, table.cores, grad_outputs=grad)
    expected_out = functional.embedding(ids, table.to_dense())
    expected = torch.autograd.grad(expected_out, table.cores, grad_outputs=grad.contiguous())
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
