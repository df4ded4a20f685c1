"""oneDNN's matrix product (``torch.ops.mkldnn._linear_pointwise``) as a second GEMM kernel for the thin
batch-sized float32 CPU products, checked once per process (:func:`onednn_usable`) and chosen only where
:mod:`comera.tt.blocked` measured it faster. Details: docs/internals.md, "Row blocks and oneDNN for the thin
GEMMs".

Index legend:
    b      rows of the first operand (the batch, or the rank of a batch-summed product)
    k      the summed dimension
    n      columns of the output
"""

from __future__ import annotations

import functools

import torch

__all__ = ["onednn_available", "onednn_mm", "onednn_usable"]


def _kernel():
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's linear op and it multiplies a small float32 case correctly
    (checked once per process against ``torch.mm`` in float64)."""
    kernel = _kernel()
    if kernel is None or not torch.backends.mkldnn.is_available():
        return False
    first = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    second = torch.arange(20, dtype=torch.float32).reshape(4, 5) / 11
    try:
        got = kernel(first, second.t(), None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    want = (first.double() @ second.double()).float()
    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))


def onednn_usable(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether :func:`onednn_mm` may compute ``first @ second``: both plain float32 CPU tensors with
    no zero-sized dimension, not while ``torch.compile`` traces, on a PyTorch with the op."""
    return (
        first.device.type == "cpu"
        and second.device.type == "cpu"
        and first.dtype == torch.float32
        and second.dtype == torch.float32
        and first.layout == torch.strided
        and second.layout == torch.strided
        and first.numel() > 0
        and second.numel() > 0
        and not torch.compiler.is_compiling()
        and onednn_available()
    )


def onednn_mm(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``first @ second`` (``b k, k n -> b n``) by oneDNN: ``(b, k) @ (k, n) -> (b, n)``, a new contiguous
    tensor. Only for operands :func:`onednn_usable` accepts."""
    return _kernel()(first, second.t(), None, "none", [], "")
