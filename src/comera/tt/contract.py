"""Custom autograd functions for the batch-sized GEMMs of the merge-first path: TT ``Y = (X L) R + b`` with
``X`` ``(B, m)``, ``L`` ``(m, r)``, ``R`` ``(r, n)``, and TTM ``Y`` from ``A`` ``(M_L, N_L, r)`` and ``C``
``(r, M_R, N_R)``; the backward re-enters the forward's autocast state. Details: docs/method.md section 5,
docs/internals.md, "The merge-first autograd functions".

Index legend:
    b      batch (all leading dims of the input flattened)
    il/ir  input (row) modes of the left / right half, M_L / M_R values
    jl/jr  output (column) modes of the left / right half, N_L / N_R values
    a      the rank of the bond between the two halves
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from comera.tt.blocked import blocked_batch_sum_mm, blocked_mm_into, thin_mm
from comera.tt.merge import (
    fold_gates,
    merge_tt_left_backward,
    merge_tt_left_steps,
    merge_tt_right_backward,
    merge_tt_right_steps,
)
from comera.tt.recycle import pooled_output
from comera.tt.workspace import Workspace, scratch

__all__ = ["low_rank_linear", "tt_merge_linear", "ttm_split_linear"]


def _record_autocast(ctx, x: torch.Tensor) -> None:
    device_type = x.device.type
    ctx.autocast_device = device_type
    ctx.autocast_enabled = torch.is_autocast_enabled(device_type)
    ctx.autocast_dtype = torch.get_autocast_dtype(device_type)


def _replay_autocast(ctx) -> torch.autocast:
    return torch.autocast(ctx.autocast_device, dtype=ctx.autocast_dtype, enabled=ctx.autocast_enabled)


def _plain_gemm(ctx, first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether ``first @ second`` must be a plain product: under autocast (whose GEMMs pick their own output
    dtype), for mixed dtypes, and while ``torch.compile`` or ``torch.export`` traces (a product written into
    a buffer, ``out=``, would be recorded in the graph, and an exported program run outside ``no_grad`` then
    fails on it: such products do not support autograd)."""
    return ctx.autocast_enabled or first.dtype != second.dtype or torch.compiler.is_compiling()


def _thin_product(ctx, first: torch.Tensor, second: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """``first @ second`` with a thin (rank-sized) ``second``, by the GEMM kernel measured fastest for the
    shape (:func:`comera.tt.blocked.thin_mm`); into the call's workspace buffer ``name`` where ``torch.mm``
    runs and a name is given (a fresh tensor otherwise)."""
    if _plain_gemm(ctx, first, second):
        return first @ second
    out = None if name is None else scratch(ctx.workspace, name, (first.shape[0], second.shape[1]), first)
    return thin_mm(first, second, out)


def _output_product(ctx, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``first @ second`` (batch rows x thin inner dimension x wide output) to be returned to the caller, in
    a recycled buffer of the output pool (:mod:`comera.tt.recycle`) where it applies, by blocks of batch
    rows on CPU (:func:`comera.tt.blocked.blocked_mm_into`)."""
    if _plain_gemm(ctx, first, second):
        return first @ second
    return blocked_mm_into(first, second, pooled_output((first.shape[0], second.shape[1]), first))


def _batch_sum_product(ctx, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``first @ second`` summed over the batch (``(k, B) @ (B, n)``), by blocks of batch rows on CPU
    (:func:`comera.tt.blocked.blocked_batch_sum_mm`)."""
    if _plain_gemm(ctx, first, second):
        return first @ second
    return blocked_batch_sum_mm(first, second)


def _low_rank_forward(ctx, x, left, right, bias):
    """``(out, inner)``: ``out = [X L, 1] @ [R; b]``, ``inner = X L`` (ones column appended if biased)."""
    inner = _thin_product(ctx, x, left)
    if bias is not None:
        inner = torch.nn.functional.pad(inner, (0, 1), value=1.0)
        right = torch.cat([right, bias.unsqueeze(0)], dim=0)
    return _output_product(ctx, inner, right), inner


def _gemm_operand(grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out`` copied once into a contiguous tensor if it has a stride 0 (an expanded gradient, such as
    ``out.sum()`` sends), else as it is: every GEMM handed an expanded operand would copy it again."""
    return grad_out.contiguous() if 0 in grad_out.stride() else grad_out


def _low_rank_backward(ctx, grad_out, x, inner, left, right, needs):
    """Gradients of ``x``, ``L``, ``R`` and the bias (None where ``needs`` says not wanted)."""
    grad_out = _gemm_operand(grad_out)
    rank = left.shape[1]
    needs_x, needs_left, needs_right, needs_bias = needs
    grad_x = grad_left = grad_right = grad_bias = None
    if needs_x or needs_left:
        projected = _thin_product(ctx, grad_out, right[:rank].t(), "projected")
        if needs_x:
            grad_x = _output_product(ctx, projected, left.t())
        if needs_left:
            grad_left = _batch_sum_product(ctx, projected.t(), x).t()
    if needs_right or needs_bias:
        grad_right_aug = _batch_sum_product(ctx, inner.t(), grad_out)
        grad_right = grad_right_aug[:rank] if needs_right else None
        grad_bias = grad_right_aug[rank] if needs_bias else None
    return grad_x, grad_left, grad_right, grad_bias


def _in_autocast_replay(ctx, backward, grad_out):
    if not ctx.autocast_enabled and not torch.is_autocast_enabled(ctx.autocast_device):
        return backward(ctx, grad_out)  # nothing to replay: skip the context's cost
    with _replay_autocast(ctx):
        return backward(ctx, grad_out)


class _LowRankLinear(torch.autograd.Function):
    """``Y = (X @ L) @ R + bias`` for 2-D ``X`` (B, m), ``L`` (m, r), ``R`` (r, n), ``bias`` (n,) or None."""

    @staticmethod
    def forward(ctx, x, left, right, bias, workspace):
        _record_autocast(ctx, x)
        ctx.workspace = workspace
        out, inner = _low_rank_forward(ctx, x, left, right, bias)
        ctx.save_for_backward(x, inner, left, right)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return _in_autocast_replay(ctx, _LowRankLinear._backward, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, inner, left, right = ctx.saved_tensors
        return (*_low_rank_backward(ctx, grad_out, x, inner, left, right, ctx.needs_input_grad[:4]), None)


def low_rank_linear(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    bias: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """``(x @ left) @ right + bias`` with the merge-first backward.

    Args:
        x: ``(B, m)`` input, 2-D.
        left: ``(m, r)``.
        right: ``(r, n)``.
        bias: ``(n,)`` or None.
        workspace: holds the backward's scratch ``dY R^T`` across calls (None: allocated per call).

    Returns:
        ``(B, n)``.
    """
    return _LowRankLinear.apply(x, left, right, bias, workspace)


def keeps_merges(input_elements: int, merges: Sequence[torch.Tensor]) -> bool:
    """Whether the merge order keeps its folded cores and partial merges for the backward instead of
    merging again there: when they hold no more elements than the input ``X`` (``input_elements``), which a
    linear layer keeps anyway, so the kept memory at most doubles the layer's. Large batches keep them (the
    merges are then tiny next to ``X``), a handful of rows merges again (the merges would dominate)."""
    return sum(merge.numel() for merge in merges) <= input_elements


class _TTMergeLinear(torch.autograd.Function):
    """``Y = (X @ L) @ R + bias``; ``L``, ``R`` merged from gated TT cores here, and kept for the backward
    only while they are small next to ``X`` (:func:`keeps_merges`), merged again there otherwise."""

    @staticmethod
    def forward(ctx, x, bias, workspace, num_in_cores, out_features, num_cores, *cores_and_gates):
        _record_autocast(ctx, x)
        ctx.workspace = workspace
        ctx.num_in_cores, ctx.out_features, ctx.num_cores = num_in_cores, out_features, num_cores
        ctx.num_gates = len(cores_and_gates) - num_cores
        cores = fold_gates(cores_and_gates[:num_cores], cores_and_gates[num_cores:])
        left_steps = merge_tt_left_steps(cores[:num_in_cores])
        right_steps = merge_tt_right_steps(cores[num_in_cores:])
        left = left_steps[-1][: x.shape[1]]
        right = right_steps[-1][:, :out_features]
        out, inner = _low_rank_forward(ctx, x, left, right, bias)
        ctx.kept_steps = keeps_merges(x.numel(), [*left_steps, *right_steps, *cores])
        if ctx.kept_steps:
            ctx.num_left_steps = len(left_steps)
            ctx.save_for_backward(x, inner, *cores_and_gates, *cores, *left_steps, *right_steps)
        else:
            ctx.save_for_backward(x, inner, *cores_and_gates)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return _in_autocast_replay(ctx, _TTMergeLinear._backward, grad_out)

    @staticmethod
    def _saved_merges(ctx, saved):
        """``(cores_and_gates, folded cores, left steps, right steps)`` from the saved tensors, merging again
        what the forward did not keep."""
        num_in, num_cores = ctx.num_in_cores, ctx.num_cores
        cores_and_gates = saved[: num_cores + ctx.num_gates]
        if not ctx.kept_steps:
            cores = fold_gates(cores_and_gates[:num_cores], cores_and_gates[num_cores:])
            left_steps, right_steps = (
                merge_tt_left_steps(cores[:num_in]),
                merge_tt_right_steps(cores[num_in:]),
            )
            return cores_and_gates, cores, left_steps, right_steps
        rest = saved[num_cores + ctx.num_gates :]
        cores, steps = rest[:num_cores], rest[num_cores:]
        return cores_and_gates, cores, steps[: ctx.num_left_steps], steps[ctx.num_left_steps :]

    @staticmethod
    def _backward(ctx, grad_out):
        x, inner, *saved = ctx.saved_tensors
        num_in, num_cores = ctx.num_in_cores, ctx.num_cores
        cores_and_gates, cores, left_steps, right_steps = _TTMergeLinear._saved_merges(ctx, saved)
        raw_cores, gates = cores_and_gates[:num_cores], cores_and_gates[num_cores:]
        left_cores, right_cores = cores[:num_in], cores[num_in:]
        left = left_steps[-1][: x.shape[1]]
        right = right_steps[-1][:, : ctx.out_features]
        needs_x, needs_bias = ctx.needs_input_grad[:2]
        needs_tensor = ctx.needs_input_grad[6:]
        needs_left = any(needs_tensor[:num_in]) or any(needs_tensor[num_cores : num_cores + num_in])
        needs_right = any(needs_tensor[num_in:num_cores]) or any(needs_tensor[num_cores + num_in :])
        needs = (needs_x, needs_left, needs_right, needs_bias)
        grads = _low_rank_backward(ctx, grad_out, x, inner, left, right, needs)
        grad_x, grad_left, grad_right, grad_bias = grads
        grad_gated: list[torch.Tensor | None] = [None] * num_cores
        if needs_left:
            grad_left = _pad_to(grad_left, left_steps[-1].shape)
            grad_gated[:num_in] = merge_tt_left_backward(left_cores, left_steps, grad_left)
        if needs_right:
            grad_right = _pad_to(grad_right, right_steps[-1].shape)
            grad_gated[num_in:] = merge_tt_right_backward(right_cores, right_steps, grad_right)
        # gated[a, i, c] = core[a, i, c] gate[c]: d core = d gated * gate; d gate = sum_{a, i} d gated * core
        grad_cores = [
            grad if grad is None or k >= len(gates) else grad * gates[k] for k, grad in enumerate(grad_gated)
        ]
        grad_gates = [
            None if grad is None or not needs_tensor[num_cores + k] else (grad * raw_cores[k]).sum((0, 1))
            for k, grad in enumerate(grad_gated[: len(gates)])
        ]
        return grad_x, grad_bias, None, None, None, None, *grad_cores, *grad_gates


def _pad_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` of a leading slice of a 2-D tensor of ``shape``, zero-padded to the full ``shape``."""
    if grad.shape == shape:
        return grad
    return torch.nn.functional.pad(grad, (0, shape[1] - grad.shape[1], 0, shape[0] - grad.shape[0]))


def tt_merge_linear(
    x: torch.Tensor,
    cores: Sequence[torch.Tensor],
    num_in_cores: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    gates: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``x @ W + bias`` for a TT-folded weight by the merge-first path, holding no merged factor for backward:
    only ``x``, the small ``(B, r+1)`` product, the cores and the gates are saved, and the backward folds and
    merges again (docs/method.md section 5).

    Args:
        x: ``(B, in_features)``, ``in_features <= n_1 * ... * n_d`` (missing input entries are zero).
        cores: TT cores ``(r_{k-1}, n_k, r_k)`` with ``r_0 = r_K = 1``.
        num_in_cores: how many leading cores carry input modes (``1 <= d < len(cores)``).
        out_features: output columns kept (``<=`` the product of the output modes).
        bias: ``(out_features,)`` or None.
        workspace: holds the backward's scratch ``dY R^T`` across calls (None: allocated per call).
        gates: at most ``len(cores) - 1`` vectors; gate ``k`` (``(r_k,)``) scales the right-rank axis of
            core ``k`` (empty: the cores are used as given).

    Returns:
        ``(B, out_features)``.
    """
    if len(gates) >= len(cores):
        raise ValueError(
            f"gates must hold at most len(cores) - 1 = {len(cores) - 1} vectors, got {len(gates)}"
        )
    return _TTMergeLinear.apply(x, bias, workspace, num_in_cores, out_features, len(cores), *cores, *gates)


def _batched_product(ctx, matrix: torch.Tensor, batched: torch.Tensor) -> torch.Tensor:
    """``matrix @ batched[b]`` for every ``b``, into the workspace buffer ``"grad_inner"`` if there is one."""
    if ctx.workspace is None or _plain_gemm(ctx, matrix, batched):
        return torch.matmul(matrix, batched)
    shape = (batched.shape[0], matrix.shape[0], batched.shape[2])
    out = scratch(ctx.workspace, "grad_inner", shape, batched)
    return torch.matmul(matrix, batched, out=out)


class _TTMSplitLinear(torch.autograd.Function):
    """Two-half TTM product (shapes: docs/internals.md)."""

    @staticmethod
    def forward(ctx, x, left, right, bias, workspace):
        _record_autocast(ctx, x)
        ctx.workspace = workspace
        rows_left, cols_left, rank = left.shape
        _, rows_right, cols_right = right.shape
        batch = x.shape[0]
        right_mat = right.permute(1, 0, 2).reshape(rows_right, rank * cols_right)
        left_mat = left.permute(1, 0, 2).reshape(cols_left, rows_left * rank)
        inner = (x.reshape(batch * rows_left, rows_right) @ right_mat).reshape(
            batch, rows_left * rank, cols_right
        )
        out = torch.matmul(left_mat, inner)
        if bias is not None:
            bias = bias.reshape(cols_left, cols_right)
            out = out.add_(bias) if bias.dtype == out.dtype else out + bias
        ctx.save_for_backward(x, inner, left_mat, right_mat)
        ctx.dims = (rows_left, cols_left, rank, rows_right, cols_right)
        return out.reshape(batch, cols_left * cols_right)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return _in_autocast_replay(ctx, _TTMSplitLinear._backward, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, inner, left_mat, right_mat = ctx.saved_tensors
        rows_left, cols_left, rank, rows_right, cols_right = ctx.dims
        needs_x, needs_left, needs_right, needs_bias = ctx.needs_input_grad[:4]
        batch = x.shape[0]
        grad_out = _gemm_operand(grad_out).reshape(batch, cols_left, cols_right)
        grad_x = grad_left = grad_right = grad_bias = None
        if needs_left:
            grad_left_mat = torch.einsum("bpq,bkq->pk", grad_out, inner)
            grad_left = grad_left_mat.reshape(cols_left, rows_left, rank).permute(1, 0, 2)
        if needs_x or needs_right:
            grad_inner = _batched_product(ctx, left_mat.t(), grad_out)
            grad_inner = grad_inner.reshape(batch * rows_left, rank * cols_right)
            if needs_right:
                grad_right_mat = x.reshape(batch * rows_left, rows_right).t() @ grad_inner
                grad_right = grad_right_mat.reshape(rows_right, rank, cols_right).permute(1, 0, 2)
            if needs_x:
                grad_x = (grad_inner @ right_mat.t()).reshape(batch, rows_left * rows_right)
        if needs_bias:
            grad_bias = grad_out.sum(0).reshape(-1)
        return grad_x, grad_left, grad_right, grad_bias, None


def ttm_split_linear(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    bias: torch.Tensor | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """TTM layer product from its two merged halves.

    Args:
        x: ``(B, M_L * M_R)`` input, 2-D, row-major over (left rows, right rows).
        left: ``(M_L, N_L, r)``, the merged left half.
        right: ``(r, M_R, N_R)``, the merged right half.
        bias: ``(N_L * N_R,)`` or None.
        workspace: holds the backward's scratch gradient of ``T`` across calls (None: allocated per call).

    Returns:
        ``(B, N_L * N_R)``.
    """
    return _TTMSplitLinear.apply(x, left, right, bias, workspace)
