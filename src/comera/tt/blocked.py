"""Batch-sized CPU GEMMs of the merge path (``(B, r) @ (r, n)`` and ``(r, B) @ (B, n)``) run as one GEMM, as
one ``torch.bmm`` over equal blocks of batch rows (one per thread), or by oneDNN's kernel, as measured per
call shape (:mod:`comera.tt.autotune`) or, without measuring, by :func:`rule_blocks`. Details:
docs/internals.md, "Row blocks and oneDNN for the thin GEMMs".

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
from comera.tt.onednn import onednn_mm, onednn_usable

__all__ = [
    "MAX_WIDTH",
    "MIN_ROWS_PER_BLOCK",
    "ONEDNN",
    "blocked_batch_sum_mm",
    "blocked_mm_into",
    "gemm_choice",
    "mkl_only",
    "rule_blocks",
    "single_gemms",
    "thin_mm",
]

MIN_ROWS_PER_BLOCK = 512
"""Fewest batch rows per block worth a batched GEMM (docs/internals.md, "Row blocks and oneDNN")."""

MAX_WIDTH = 1024
"""GEMMs whose feature width is this or more run as one GEMM (docs/internals.md, "Row blocks and oneDNN")."""

ONEDNN = "onednn"
"""The :func:`gemm_choice` that runs a product by oneDNN's kernel (:mod:`comera.tt.onednn`)."""

_single_gemm_depth = 0
_mkl_only_depth = 0


@contextmanager
def single_gemms() -> Iterator[None]:
    """Within this block (process-wide, nestable), every product of this module is one plain ``torch.mm``
    GEMM (neither row blocks nor oneDNN's kernel)."""
    global _single_gemm_depth
    _single_gemm_depth += 1
    try:
        yield
    finally:
        _single_gemm_depth -= 1


@contextmanager
def mkl_only() -> Iterator[None]:
    """Within this block (process-wide, nestable), no product of this module is measured with or run by
    oneDNN's kernel (row blocks are still measured): ``comera bench layers`` times the layer both ways."""
    global _mkl_only_depth
    _mkl_only_depth += 1
    try:
        yield
    finally:
        _mkl_only_depth -= 1


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


def _layout(tensor: torch.Tensor) -> str:
    """``"c"`` for a contiguous matrix, ``"t"`` for a transposed contiguous one, ``"s"`` otherwise."""
    if tensor.is_contiguous():
        return "c"
    return "t" if tensor.t().is_contiguous() else "s"


def gemm_choice(
    kind: str,
    first: torch.Tensor,
    second: torch.Tensor,
    run: Callable[[int | str], object],
    split: bool = True,
) -> int | str:
    """How this call's GEMM runs: a number of row blocks (1: one plain ``torch.mm``) or :data:`ONEDNN`,
    measured with ``run(choice)`` at the first call of the shape (``kind``: ``"rows"``, ``"summed"`` or
    ``"thin"``, never split), else :func:`rule_blocks`'s estimate (1 where ``split`` is False)."""
    rows = second.shape[0] if kind == "summed" else first.shape[0]
    inner, width = first.shape[0] if kind == "summed" else first.shape[1], second.shape[1]
    estimate = rule_blocks(rows, width, first.device) if split else 1
    if first.device.type != "cpu" or _single_gemm_depth or torch.compiler.is_compiling():
        return estimate  # get_num_threads() inside a trace would break fullgraph compiles
    threads = torch.get_num_threads()
    onednn = not _mkl_only_depth and onednn_usable(first, second)
    layouts = (_layout(first), _layout(second))
    key = ("gemm", kind, size_bucket(rows), inner, width, *layouts, threads, first.dtype, onednn)

    def candidates() -> tuple[int | str, ...]:
        blocks = min(threads, rows // MIN_ROWS_PER_BLOCK)
        return (1, *((blocks,) if split and blocks >= 2 else ()), *((ONEDNN,) if onednn else ()))

    return tuned(key, candidates, estimate, run, first.device)


def _mm_into_blocks(
    first: torch.Tensor, second: torch.Tensor, out: torch.Tensor, blocks: int | str
) -> torch.Tensor:
    if blocks == ONEDNN:
        return onednn_mm(first, second)
    if blocks == 1:
        return torch.mm(first, second, out=out)
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
    return out


def blocked_mm_into(first: torch.Tensor, second: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``first @ second`` for ``first`` ``(B, k)``, ``second`` ``(k, n)``, into the contiguous ``out``
    ``(B, n)``, block of rows by block of rows in one batched GEMM (``s b k, s k n -> s b n``, the same
    ``second`` for every block; :func:`gemm_choice` says how many), rows past the last whole block by a plain
    GEMM. Returns ``out``, or a new tensor where oneDNN's kernel was measured faster for the shape."""
    choice = gemm_choice("rows", first, second, lambda count: _mm_into_blocks(first, second, out, count))
    return _mm_into_blocks(first, second, out, choice)


def thin_mm(first: torch.Tensor, second: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``first @ second`` for ``first`` ``(B, k)`` and a thin ``second`` ``(k, n)`` (a rank-sized ``n``): one
    GEMM, by ``torch.mm`` (into ``out`` where given) or by oneDNN's kernel where it was measured faster for
    the shape (:func:`gemm_choice`, kind ``"thin"``; then a new tensor)."""

    def run(choice: int | str) -> torch.Tensor:
        if choice == ONEDNN:
            return onednn_mm(first, second)
        return torch.mm(first, second) if out is None else torch.mm(first, second, out=out)

    return run(gemm_choice("thin", first, second, run, split=False))


def _batch_sum_blocks(first: torch.Tensor, second: torch.Tensor, blocks: int | str) -> torch.Tensor:
    if blocks == ONEDNN:
        return onednn_mm(first, second)
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
    (``s k b, s b n -> s k n``; :func:`gemm_choice` says how many blocks, or oneDNN's kernel in one product),
    then their sum over ``s``; rows past the last whole block are added by a plain GEMM. Returns a new
    ``(k, n)`` tensor."""
    blocks = gemm_choice("summed", first, second, lambda count: _batch_sum_blocks(first, second, count))
    return _batch_sum_blocks(first, second, blocks)
