"""The float64 dense reference of a TTM lookup: rows of the full table and their gradients."""

from __future__ import annotations

import torch

from comera.tt.cores import ttm_full


def assert_lookup_matches_the_table(out, grads, cores, indices, grad_out) -> None:
    """``out`` is rows ``indices`` of ``ttm_full(cores)``, and ``grads`` (of ``(out * grad_out).sum()`` with
    respect to ``cores``) are the same sum's gradients through the dense table, both to 1e-12."""
    table = ttm_full(cores)
    torch.testing.assert_close(out, table[indices], rtol=1e-12, atol=1e-12)
    expected = torch.autograd.grad((table[indices] * grad_out).sum(), cores)
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference, rtol=1e-12, atol=1e-12)
