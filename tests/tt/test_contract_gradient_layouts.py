"""The merge-first TT and two-half TTM products with transposed and expanded upstream gradients: the
gradients of the float64 dense product, and an expanded gradient copied once, not once per GEMM.

References: ``x @ (L @ R) + b`` and the TTM weight rebuilt densely (float64, autograd); a
``TorchDispatchMode`` that lists the non-view operators receiving the whole expanded gradient. 1024 rows on
2 threads, so that the batch-sized GEMMs run by row blocks (:mod:`comera.tt.blocked`).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera.tt.contract import low_rank_linear, ttm_split_linear

_ROWS, _IN, _OUT, _RANK = 1024, 12, 10, 3


class _ExpandedReaders(TorchDispatchMode):
    """Non-view operators that receive a tensor of ``numel`` elements with a stride 0."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.readers: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        if not func.is_view and any(t.numel() == self.numel and 0 in t.stride() for t in tensors):
            self.readers.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _gradient(layout: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    if layout == "transposed":
        return torch.randn(_OUT, _ROWS, dtype=torch.float64, generator=generator).t()
    if layout == "expanded":
        return torch.randn(_OUT, dtype=torch.float64, generator=generator).expand(_ROWS, _OUT)
    return torch.randn(_ROWS, _OUT, dtype=torch.float64, generator=generator)


def _leaves(*shapes):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, dtype=torch.float64, generator=generator, requires_grad=True) for shape in shapes
    ]


def _check(product, reference, leaves, layout):
    grad = _gradient(layout)
    with _ExpandedReaders(_ROWS * _OUT) as record:
        grads = torch.autograd.grad(product(*leaves), leaves, grad_outputs=grad)
    expected = torch.autograd.grad(reference(*leaves), leaves, grad_outputs=grad.contiguous())
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    return record.readers


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_low_rank_product_gradients_for_every_layout(threads, layout):
    threads(2)
    leaves = _leaves((_ROWS, _IN), (_IN, _RANK), (_RANK, _OUT), (_OUT,))
    readers = _check(
        lambda x, left, right, bias: low_rank_linear(x, left, right, bias),
        lambda x, left, right, bias: x @ (left @ right) + bias,
        leaves,
        layout,
    )
    assert readers == (["aten.clone"] if layout == "expanded" else [])


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_ttm_split_product_gradients_for_every_layout(threads, layout):
    """``A (M_L, N_L, r) = (3, 2, 3)``, ``C (r, M_R, N_R) = (3, 4, 5)``: 12 inputs, 10 outputs."""
    threads(2)
    leaves = _leaves((_ROWS, _IN), (3, 2, _RANK), (_RANK, 4, 5), (_OUT,))

    def dense(x, left, right, bias):
        # weight[il, ir, jl, jr] = sum_a A[il, jl, a] C[a, ir, jr]; il/ir rows, jl/jr columns, a the rank
        weight = torch.einsum("lja,aik->lijk", left, right).reshape(_IN, _OUT)
        return x @ weight + bias

    readers = _check(ttm_split_linear, dense, leaves, layout)
    assert readers == (["aten.clone"] if layout == "expanded" else [])
