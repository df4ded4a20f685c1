"""oneDNN's matrix product as a second GEMM kernel for the thin batch-sized CPU products.

PyTorch's ``torch.mm`` on an x86 CPU runs the BLAS it was built with (MKL in the official wheels). MKL picks
its code path by CPU vendor; oneDNN, also part of every official x86 wheel, picks its kernels by the
instruction set. On an AMD EPYC (2 logical CPUs, AVX-512, torch 2.13 CPU build, fp32) the products of a
rank-30 TT layer at 768 features ran about twice as fast through oneDNN as through MKL where the output is
thin (``X L`` and ``dY R^T``, ``(4096, 768) @ (768, 30)``: 1.1 ms against 2.2-2.6 ms) and 1.2-1.4x as fast for
the batch-summed weight gradients (docs/benchmarks.md, "Linear layers", column "TT merge, no oneDNN"). Which
kernel wins depends on the CPU and the shape, so it is never assumed: :mod:`comera.tt.blocked` measures it per
call shape with :mod:`comera.tt.autotune`, and without measuring (autotuning off, deterministic algorithms,
``torch.compile``) ``torch.mm`` runs as before.

The kernel is reached through ``torch.ops.mkldnn._linear_pointwise`` (the op ``torch.compile``'s CPU backend
emits for a linear layer), which computes ``X W^T + b`` with a weight ``W`` of shape ``(out, in)`` and reads
transposed views without copying them. It is an internal op of PyTorch: :func:`onednn_usable` checks once
per process that it exists and computes a small product correctly, and says no for anything but plain
float32 CPU tensors. Not used on GPUs (cuBLAS is not in question there).

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
