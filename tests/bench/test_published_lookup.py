"""The benchmark's rebuilt published lookup returns the embedding's rows and gradients (float64)."""

from __future__ import annotations

import pytest
import torch

from comera import TTMEmbedding
from comera.bench.published_lookup import PublishedOrderLookup


def make_table() -> TTMEmbedding:
    """A 97 x 10 table on 3 * 4 * 3 * 3 = 108 rows and 2 * 1 * 3 * 2 = 12 columns, with uneven gates."""
    table = TTMEmbedding(
        97, 10, row_shape=(3, 4, 3, 3), col_shape=(2, 1, 3, 2), rank=3, dtype=torch.float64, lookup="naive"
    )
    with torch.no_grad():
        for gate in table.gates:
            gate.uniform_(0.5, 1.5)
    return table


@pytest.mark.parametrize("unique", [False, True])
def test_rows_and_gradients_match_the_dense_table(unique):
    torch.manual_seed(0)
    table = make_table()
    ids = torch.tensor([5, 96, 0, 5, 41, 96, 5, 77])
    upstream = torch.randn(ids.shape[0], 10, dtype=torch.float64)
    dense = table.to_dense()
    (dense[ids] * upstream).sum().backward()
    expected = [param.grad.clone() for param in table.parameters()]
    table.zero_grad(set_to_none=True)
    rows = PublishedOrderLookup(table, unique=unique)(ids)
    torch.testing.assert_close(rows, dense.detach()[ids])
    (rows * upstream).sum().backward()
    for param, want in zip(table.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, want)


def test_needs_four_cores():
    table = TTMEmbedding(30, 6, row_shape=(5, 6), col_shape=(2, 3), rank=2)
    with pytest.raises(ValueError, match="embedding must have 4 cores"):
        PublishedOrderLookup(table)
