"""Rows of a TTM matrix computed from its cores (``(r_{k-1}, m_k, n_k, r_k)``) for a batch of row indices: the
naive path (one slice chain per index), the split path (two merged halves, one batched GEMM) and row-level
deduplication. Details: docs/method.md section 6, docs/internals.md, "The lookup's gradients"."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from comera.tt.costs import DEFAULT_COST_MODEL, CostModel
from comera.tt.merge import merge_ttm_left, merge_ttm_right
from comera.tt.workspace import Workspace, in_graph_capture, scratch

__all__ = [
    "LOOKUP_PATHS",
    "in_graph_capture",
    "row_digits",
    "ttm_lookup_naive",
    "split_halves",
    "ttm_lookup_split",
    "lookup_split_cost",
    "best_lookup_split",
    "dedup_threshold",
    "ttm_lookup_rows",
    "rows_at",
    "ttm_lookup",
]

LOOKUP_PATHS = ("naive", "optimized")

# Rows gathered per chunk of the batched GEMM: about this many gathered elements (4 MiB in float32), so that
# the gathered slices of one chunk stay in cache and their buffers are reused instead of freshly faulted in.
_CHUNK_ELEMENTS = 1 << 20


def _core_shapes(cores: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    return [tuple(core.shape) for core in cores]


def row_digits(indices: torch.Tensor, row_modes: Sequence[int]) -> list[torch.Tensor]:
    """Row-major digits ``(i_1, ..., i_d)`` of each index over ``row_modes``: ``d`` tensors shaped like
    ``indices``."""
    digits = []
    rest = indices
    for size in reversed(row_modes[1:]):
        digits.append(rest % size)
        rest = rest // size
    digits.append(rest)
    return digits[::-1]


def ttm_lookup_naive(cores: Sequence[torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
    """Rows of a TTM matrix, one chain of slice products per index (the reference path).

    Args:
        cores: TTM cores ``(r_{k-1}, m_k, n_k, r_k)`` with ``r_0 = r_d = 1``, gates already folded in.
        indices: 1-D integer tensor of rows, each in ``[0, prod m_k)`` (not checked).

    Returns:
        ``(len(indices), prod n_k)``, columns row-major over ``(n_1, ..., n_d)``.
    """
    batch = indices.shape[0]
    digits = row_digits(indices, [core.shape[1] for core in cores])
    state = cores[0][0, digits[0]]  # (batch, n_1, r_1)
    produced = cores[0].shape[2]
    for core, digit in zip(cores[1:], digits[1:]):
        rank_in, _, cols, rank_out = core.shape
        chosen = core.transpose(0, 1)[digit].reshape(batch, rank_in, cols * rank_out)
        state = torch.bmm(state, chosen).reshape(batch, produced * cols, rank_out)
        produced *= cols
    return state.reshape(batch, produced)


def _chunk_rows(left: torch.Tensor, right_rows: torch.Tensor) -> int:
    per_row = left.shape[1] * left.shape[2] + right_rows.shape[1] * right_rows.shape[2]
    return max(1, _CHUNK_ELEMENTS // max(per_row, 1))


def _chunks(batch: int, size: int) -> list[tuple[int, int]]:
    if in_graph_capture() or batch <= size:
        return [(0, batch)] if batch else []
    return [(start, min(start + size, batch)) for start in range(0, batch, size)]


class _DenseChunks:
    """Chunks of rows of an upstream gradient, each contiguous for the batched GEMMs: views of a contiguous
    gradient, else copies into the workspace buffer ``"grad_out"`` of ``size`` rows (an expanded gradient is
    copied once and serves every chunk)."""

    def __init__(self, grad: torch.Tensor, size: int, workspace: Workspace | None) -> None:
        self.grad = grad
        self.buffer = None
        if not grad.is_contiguous():
            self.buffer = scratch(workspace, "grad_out", (size, *grad.shape[1:]), grad)
        self.repeated = grad.stride(0) == 0
        self.copied = False

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (at most ``size``) of the gradient, contiguous (a view of the buffer, valid
        until the next call)."""
        chunk = self.grad[start:stop]
        if self.buffer is None:
            return chunk
        dense = self.buffer[: stop - start]
        if not (self.repeated and self.copied):
            dense.copy_(chunk)
            self.copied = True
        return dense


class _GatherProduct(torch.autograd.Function):
    """``out[b] = left[left_idx[b]] @ right_rows[right_idx[b]]`` without keeping the gathered slices.

    Shapes: ``left`` ``(M_L, N_L, r)``, ``right_rows`` ``(M_R, r, N_R)``, ``out`` ``(B, N_L, N_R)``; at most
    one chunk of gathered slices exists at a time, in scratch buffers.
    """

    @staticmethod
    def forward(ctx, left_idx, right_idx, left, right_rows, workspace):
        ctx.save_for_backward(left_idx, right_idx, left, right_rows)
        ctx.workspace = workspace
        if in_graph_capture():
            return torch.bmm(left.index_select(0, left_idx), right_rows.index_select(0, right_idx))
        batch = left_idx.shape[0]
        size = min(_chunk_rows(left, right_rows), batch)
        chunks = _chunks(batch, size)
        size = max(stop - start for start, stop in chunks) if chunks else 0
        out = left.new_empty(batch, left.shape[1], right_rows.shape[2])
        gathered_left = scratch(workspace, "left", (size, *left.shape[1:]), left)
        gathered_right = scratch(workspace, "right", (size, *right_rows.shape[1:]), right_rows)
        for start, stop in chunks:
            rows = stop - start
            torch.index_select(left, 0, left_idx[start:stop], out=gathered_left[:rows])
            torch.index_select(right_rows, 0, right_idx[start:stop], out=gathered_right[:rows])
            torch.bmm(gathered_left[:rows], gathered_right[:rows], out=out[start:stop])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        left_idx, right_idx, left, right_rows = ctx.saved_tensors
        workspace = ctx.workspace
        needs_left, needs_right = ctx.needs_input_grad[2:4]
        grad_left = torch.zeros_like(left) if needs_left else None
        grad_right = torch.zeros_like(right_rows) if needs_right else None
        batch = left_idx.shape[0]
        chunks = _chunks(batch, min(_chunk_rows(left, right_rows), batch))
        size = max(stop - start for start, stop in chunks) if chunks else 0
        # gathered[0]/[1]: slices of left/right; slice_grad[0]/[1]: their gradients (one chunk each).
        gathered = (
            scratch(workspace, "left", (size, *left.shape[1:]), left),
            scratch(workspace, "right", (size, *right_rows.shape[1:]), right_rows),
        )
        slice_grad = (
            scratch(workspace, "grad_left", gathered[0].shape, left),
            scratch(workspace, "grad_right", gathered[1].shape, right_rows),
        )
        dense_grad = _DenseChunks(grad_out, size, workspace)
        for start, stop in chunks:
            rows = stop - start
            grad = dense_grad.rows(start, stop)
            rows_left, rows_right = left_idx[start:stop], right_idx[start:stop]
            if needs_left:
                torch.index_select(right_rows, 0, rows_right, out=gathered[1][:rows])
                torch.bmm(grad, gathered[1][:rows].transpose(1, 2), out=slice_grad[0][:rows])
                grad_left.index_add_(0, rows_left, slice_grad[0][:rows])
            if needs_right:
                torch.index_select(left, 0, rows_left, out=gathered[0][:rows])
                torch.bmm(gathered[0][:rows].transpose(1, 2), grad, out=slice_grad[1][:rows])
                grad_right.index_add_(0, rows_right, slice_grad[1][:rows])
        return None, None, grad_left, grad_right, None


class _RowsAt(torch.autograd.Function):
    """``rows[position]`` (``functional.embedding``) whose backward never copies an expanded gradient.

    Shapes: ``rows`` ``(R, D)``, ``position`` 1-D, output ``(len(position), D)``; an expanded gradient
    gives row ``r`` ``count(r) * g``, a strided one is summed by :func:`_summed_by_blocks`.
    """

    @staticmethod
    def forward(ctx, rows, position):
        ctx.save_for_backward(position)
        ctx.num_rows = rows.shape[0]
        return torch.nn.functional.embedding(position, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (position,) = ctx.saved_tensors
        if grad.shape[0] and grad.stride(0) == 0:
            counts = torch.bincount(position, minlength=ctx.num_rows).to(grad.dtype)
            return torch.outer(counts, grad[0]), None
        if grad.is_contiguous():
            return torch.ops.aten.embedding_dense_backward(grad, position, ctx.num_rows, -1, False), None
        return _summed_by_blocks(grad, position, ctx.num_rows), None


SUM_ROWS = 512
"""Rows per block when :func:`_summed_by_blocks` reads a strided gradient. Chosen on the AMD EPYC (40,000 x
768 float32: 22.9 ms at 512 rows, 24.5 at 256); not measured on the Xeon. Rows are added in batch order
whatever the size."""


def _summed_by_blocks(grad: torch.Tensor, position: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Row sums of a strided ``grad``: ``out[r]`` sums ``grad[b]`` over ``position[b] == r``, read
    :data:`SUM_ROWS` rows at a time (docs/internals.md, "The lookup's gradients").

    Shapes: ``grad`` ``(N, D)``, ``position`` ``(N,)`` in ``[0, num_rows)``; returns ``(num_rows, D)``.
    """
    summed = grad.new_zeros(num_rows, grad.shape[1])
    block = grad.new_empty(min(SUM_ROWS, grad.shape[0]), grad.shape[1])
    for start in range(0, grad.shape[0], SUM_ROWS):
        rows = grad[start : start + SUM_ROWS]
        dense = block[: rows.shape[0]]
        dense.copy_(rows)
        summed.index_add_(0, position[start : start + SUM_ROWS], dense)
    return summed


def rows_at(rows: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``rows[position]``, differentiable with respect to ``rows``, for the ``(rows, position)`` pair of
    :func:`ttm_lookup_rows`.

    Args:
        rows: ``(R, D)`` distinct rows.
        position: 1-D integer tensor of positions in ``[0, R)``.

    Returns:
        ``(len(position), D)``. Its backward sums each row's gradients; a gradient expanded along the rows
        (every row the same) is not materialised.
    """
    return _RowsAt.apply(rows, position)


def split_halves(cores: Sequence[torch.Tensor], split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves of the split path: ``A (M_L, N_L, r)`` and ``C`` by rows, ``(M_R, r, N_R)``.

    Args:
        cores: TTM cores ``(r_{k-1}, m_k, n_k, r_k)``, gates folded in, at least two.
        split: number of cores in the left half, ``1 <= split < d``.
    """
    if not 1 <= split < len(cores):
        raise ValueError(f"split must be in [1, {len(cores) - 1}], got {split}")
    left = merge_ttm_left(cores[:split])
    right_rows = merge_ttm_right(cores[split:]).transpose(0, 1).contiguous()
    return left, right_rows


def ttm_lookup_split(
    cores: Sequence[torch.Tensor],
    indices: torch.Tensor,
    split: int,
    halves: tuple[torch.Tensor, torch.Tensor] | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Rows of a TTM matrix by the two-half path, split after core ``split`` (``1 <= split < d``).

    Args:
        cores: TTM cores ``(r_{k-1}, m_k, n_k, r_k)``, gates folded in, at least two.
        indices: 1-D integer tensor of rows in ``[0, prod m_k)`` (not checked).
        split: number of cores in the left half.
        halves: :func:`split_halves` of ``cores`` at ``split`` when already at hand (then ``cores`` serve for
            their shapes only).
        workspace: scratch buffers reused across calls (owned by the caller's module); None: per call.

    Returns:
        ``(len(indices), prod n_k)``, the same as :func:`ttm_lookup_naive`.
    """
    left, right_rows = split_halves(cores, split) if halves is None else halves
    right_size = right_rows.shape[0]
    out = _GatherProduct.apply(indices // right_size, indices % right_size, left, right_rows, workspace)
    return out.reshape(indices.shape[0], left.shape[1] * right_rows.shape[2])


def _merge_work(shapes: Sequence[tuple[int, int, int, int]]) -> tuple[int, int]:
    """MACs and elements written when merging ``shapes`` (ordered from the outer end inward)."""
    macs = elements = 0
    merged = shapes[0][1] * shapes[0][2]
    for rank_outer, rows, cols, rank_inner in shapes[1:]:
        macs += merged * rank_outer * rows * cols * rank_inner
        merged *= rows * cols
        elements += merged * rank_inner
    return macs, elements


def lookup_split_cost(
    batch: int,
    core_shapes: Sequence[tuple[int, int, int, int]],
    split: int,
    backward: bool = True,
    model: CostModel = DEFAULT_COST_MODEL,
) -> float:
    """Estimated microseconds of :func:`ttm_lookup_split` for ``batch`` rows at ``split``: the two merges, the
    gathers and the batched GEMM (with ``backward``, also their backward passes)."""
    shapes = [tuple(shape) for shape in core_shapes]
    left_shapes = shapes[:split]
    right_shapes = [(c, m, n, a) for a, m, n, c in reversed(shapes[split:])]
    left_macs, left_elements = _merge_work(left_shapes)
    right_macs, right_elements = _merge_work(right_shapes)
    rank = shapes[split][0]
    cols_left = math.prod([shape[2] for shape in shapes[:split]])
    cols_right = math.prod([shape[2] for shape in shapes[split:]])
    row_macs = batch * cols_left * rank * cols_right
    row_elements = batch * ((cols_left + cols_right) * rank + cols_left * cols_right)
    factor = 3 if backward else 1
    ops = len(shapes) + 3
    return model.time(
        factor * (left_macs + right_macs + row_macs),
        factor * (left_elements + right_elements + row_elements),
        factor * ops,
    )


def best_lookup_split(
    batch: int,
    core_shapes: Sequence[tuple[int, int, int, int]],
    backward: bool = True,
    model: CostModel = DEFAULT_COST_MODEL,
) -> int:
    """The bond (``1..d-1``) at which :func:`ttm_lookup_split` is cheapest for ``batch`` rows."""
    if len(core_shapes) < 2:
        raise ValueError(f"a split lookup needs at least 2 cores, got {len(core_shapes)}")
    best, best_cost = 1, math.inf
    for split in range(1, len(core_shapes)):
        cost = lookup_split_cost(batch, core_shapes, split, backward, model)
        if cost < best_cost:
            best, best_cost = split, cost
    return best


def dedup_threshold(
    core_shapes: Sequence[tuple[int, int, int, int]], split: int, model: CostModel = DEFAULT_COST_MODEL
) -> float:
    """Fraction of repeated indices above which computing each distinct row once pays off: each repeat saves
    one row's work, deduplication costs three rows of traffic per index (docs/method.md section 6)."""
    shapes = [tuple(shape) for shape in core_shapes]
    cols = math.prod([shape[2] for shape in shapes])
    if len(shapes) == 1:
        row_time = 3 * model.time(0, 2 * cols, 0)
    else:
        row_time = lookup_split_cost(1, shapes, split, True, model) - lookup_split_cost(
            0, shapes, split, True, model
        )
    overhead = model.time(0, 3 * cols, 0)
    return min(1.0, overhead / row_time)


def _repeats_pay(
    shapes: list[tuple[int, int, int, int]], count: int, distinct: int, split: int | None
) -> bool:
    if split is None and len(shapes) > 1:
        split = best_lookup_split(distinct, shapes, torch.is_grad_enabled())
    return 1.0 - distinct / count >= dedup_threshold(shapes, split or 1)


def ttm_lookup_rows(
    cores: Sequence[torch.Tensor],
    indices: torch.Tensor,
    path: str = "optimized",
    dedup: bool | None = None,
    split: int | None = None,
    halves: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows needed for ``indices`` and where each index finds its row.

    Args:
        cores: TTM cores ``(r_{k-1}, m_k, n_k, r_k)``, gates folded in.
        indices: 1-D integer tensor of rows in ``[0, prod m_k)`` (not checked here).
        path: ``"naive"`` or ``"optimized"`` (:data:`LOOKUP_PATHS`).
        dedup: ``True``: compute each distinct index once (``torch.unique``; not allowed in a captured graph).
            ``False``: one row per index. ``None``: deduplicate when the batch's fraction of repeated indices
            exceeds :func:`dedup_threshold`, never while :func:`in_graph_capture`.
        split: bond of the optimized path; default :func:`best_lookup_split` for the rows computed.
        halves: ``halves(split)`` returns :func:`split_halves` of the gated cores (e.g. from a cache); with
            it, the optimized path uses ``cores`` for their shapes only (and a one-core train as is).
        workspace: scratch buffers of the optimized path, reused across calls (see :func:`ttm_lookup_split`).

    Returns:
        ``(rows, position)``: ``rows`` is ``(R, prod n_k)``; ``position`` is None when ``rows[b]`` belongs to
        ``indices[b]`` (``R == len(indices)``), else a tensor shaped like ``indices`` with
        ``rows[position[b]]`` the row of ``indices[b]``.
    """
    if path not in LOOKUP_PATHS:
        raise ValueError(f"path must be one of {LOOKUP_PATHS}, got {path!r}")
    shapes = _core_shapes(cores)
    position = None
    if dedup or (dedup is None and indices.shape[0] > 1 and not in_graph_capture()):
        distinct, inverse = torch.unique(indices, return_inverse=True)
        if dedup or _repeats_pay(shapes, indices.shape[0], distinct.shape[0], split):
            indices, position = distinct, inverse
    if len(cores) == 1:
        return cores[0][0, :, :, 0].index_select(0, indices), position
    if path == "naive":
        return ttm_lookup_naive(cores, indices), position
    if split is None:
        split = best_lookup_split(indices.shape[0], shapes, torch.is_grad_enabled())
    pair = None if halves is None else halves(split)
    return ttm_lookup_split(cores, indices, split, pair, workspace), position


def ttm_lookup(
    cores: Sequence[torch.Tensor],
    indices: torch.Tensor,
    path: str = "optimized",
    dedup: bool | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """Rows ``indices`` of the TTM matrix given by ``cores`` (arguments as :func:`ttm_lookup_rows`),
    ``(len(indices), prod n_k)``, differentiable with respect to the cores."""
    rows, position = ttm_lookup_rows(cores, indices, path, dedup, split)
    return rows if position is None else rows_at(rows, position)
