"""Batch-sized CPU GEMMs run as one batched GEMM over equal blocks of batch rows.

The merge-first path (:mod:`comera.tt.contract`) multiplies batch-sized operands by thin rank-sized ones.
Two of its GEMM shapes use a CPU's threads poorly when handed to the BLAS as one product while the
feature width ``n`` is moderate:

- a wide output from a thin inner dimension, ``(B, r) @ (r, n)`` (the forward's ``[X L, 1] [R; b]`` and
  the backward's ``dY R^T L^T``);
- a small output summed over the batch, ``(r, B) @ (B, n)`` (the weight gradients ``T^T dY`` and
  ``U^T X``).

Cut into one block of rows per intra-op thread and run as a single ``torch.bmm``, each block is one
thread's single-threaded GEMM. On a 2-thread Intel Xeon (torch 2.13 CPU build, MKL, fp32, rank 30,
B = 4096) the 768-wide products took 0.54-0.65 ms blocked against 0.66-0.86 ms as one GEMM, and a 768->768
layer's forward + backward ran 5.86x faster than ``nn.Linear`` against 5.28x for the same layer with one
GEMM each; with every width blocked, wider layers lost (1024->4096 12.35x vs 13.86x, 4096->1024 10.53x vs
12.15x) (docs/benchmarks.md, "Row blocks for the thin GEMMs"). Below about 512 rows per block the split cost
more than it gained, hence :data:`MIN_ROWS_PER_BLOCK`.

These are the BLAS's threading choices on one machine, so whether a GEMM is split is measured on the
machine: with autotuning on (the default, :mod:`comera.tt.autotune`), the first GEMM of each shape times one
plain GEMM against one block per thread and keeps the faster. Without measuring (autotuning off,
deterministic algorithms, ``torch.compile``), :func:`rule_blocks` decides from the Xeon's measurements:
GEMMs whose width ``n`` is below :data:`MAX_WIDTH` are split. Only CPU tensors are split, and not while
``torch.compile`` traces. Inside :func:`single_gemms` every product is one plain GEMM again
(``comera bench layers`` times both).

Index legend:
    s      block of batch rows (one per thread)
    b      row within a block
    k      the thin (rank) dimension
    n      the wide (feature) dimension
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from comera.tt.autotune import size_bucket, tuned

__all__ = [
    "MAX_WIDTH",
    "MIN_ROWS_PER_BLOCK",
    "batch_blocks",
    "rule_blocks",
    "blocked_mm_into",
    "blocked_batch_sum_mm",
    "single_gemms",
]

MIN_ROWS_PER_BLOCK = 512
"""Fewest batch rows per block worth a batched GEMM (module docstring)."""

MAX_WIDTH = 1024
"""GEMMs whose feature width is this or more run as one GEMM (module docstring)."""

_single_gemm_depth = 0


@contextmanager
def single_gemms() -> Iterator[None]:
    """Within this block (process-wide, nestable), every product of this module is one plain GEMM."""
    global _single_gemm_depth
    _single_gemm_depth += 1
    try:
        yield
    finally:
        _single_gemm_depth -= 1


def rule_blocks(rows: int, width: int, device: torch.device) -> int:
    """The estimate: how many equal row blocks a GEMM over a batch of ``rows`` and a feature width ``width``
    is cut into without measuring: one per intra-op thread, each at least :data:`MIN_ROWS_PER_BLOCK` rows,
    for widths below :data:`MAX_WIDTH`, on CPU only and not while ``torch.compile`` traces (the compiler
    picks its own kernels); 1 means one plain GEMM."""
    if device.type != "cpu" or _single_gemm_depth or rows < 2 * MIN_ROWS_PER_BLOCK:
        return 1
    if torch.compiler.is_compiling():
        return 1
    return min(torch.get_num_threads(), rows // MIN_ROWS_PER_BLOCK) if width < MAX_WIDTH else 1


def batch_blocks(kind: str, first: torch.Tensor, second: torch.Tensor, run: Callable[[int], object]) -> int:
    """How many row blocks this call's GEMM runs in: :func:`rule_blocks`'s estimate, or, with autotuning on
    (:mod:`comera.tt.autotune`) and a split possible, the faster of one GEMM and one block per thread,
    measured with ``run(blocks)`` at the first call of the shape (``kind``, the batch's power-of-two range,
    the other dimensions, the thread count, the dtype)."""
    rows = first.shape[0] if kind == "rows" else second.shape[0]
    inner, width = first.shape[1] if kind == "rows" else first.shape[0], second.shape[1]
    estimate = rule_blocks(rows, width, first.device)
    if first.device.type != "cpu" or _single_gemm_depth or torch.compiler.is_compiling():
        return estimate  # get_num_threads() inside a trace would break fullgraph compiles
    threads = torch.get_num_threads()
    split = min(threads, rows // MIN_ROWS_PER_BLOCK)
    if split < 2:
        return estimate
    key = ("blocked", kind, size_bucket(rows), inner, width, threads, first.dtype)
    return tuned(key, lambda: (1, split), estimate, run, first.device)


def _mm_into_blocks(first: torch.Tensor, second: torch.Tensor, out: torch.Tensor, blocks: int) -> None:
    if blocks == 1:
        torch.mm(first, second, out=out)
        return
    rows = first.shape[0]
    size = rows // blocks
    whole = size * blocks
    torch.bmm(
        first[:whole].unflatten(0, (blocks, size)),
        second.expand(blocks, *second.shape),
        out=out[:whole].unflatten(0, (blocks, size)),
    )
    if whole < rows:
        torch.mm(first[whole:], second, out=out[whole:])


def blocked_mm_into(first: torch.Tensor, second: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = first @ second`` for ``first`` ``(B, k)``, ``second`` ``(k, n)``, contiguous ``out``
    ``(B, n)``, computed block of rows by block of rows in one batched GEMM (``s b k, s k n -> s b n``, the
    same ``second`` for every block; :func:`batch_blocks` says how many); rows past the last whole block by
    a plain GEMM. Returns ``out``."""
    blocks = batch_blocks("rows", first, second, lambda count: _mm_into_blocks(first, second, out, count))
    _mm_into_blocks(first, second, out, blocks)
    return out


def _batch_sum_blocks(first: torch.Tensor, second: torch.Tensor, blocks: int) -> torch.Tensor:
    if blocks == 1:
        return first @ second
    rows = second.shape[0]
    size = rows // blocks
    whole = size * blocks
    partials = torch.bmm(
        first[:, :whole].unflatten(1, (blocks, size)).transpose(0, 1),
        second[:whole].unflatten(0, (blocks, size)),
    )
    total = partials.sum(0)
    if whole < rows:
        total.addmm_(first[:, whole:], second[whole:])
    return total


def blocked_batch_sum_mm(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``first @ second`` for ``first`` ``(k, B)`` and ``second`` ``(B, n)``, the batch ``B`` being the
    summed dimension: one partial product per block of batch rows in one batched GEMM
    (``s k b, s b n -> s k n``; :func:`batch_blocks` says how many blocks), then their sum over ``s``; rows
    past the last whole block are added by a plain GEMM. Returns a new ``(k, n)`` tensor."""
    blocks = batch_blocks("summed", first, second, lambda count: _batch_sum_blocks(first, second, count))
    return _batch_sum_blocks(first, second, blocks)
