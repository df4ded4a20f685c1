"""Custom autograd functions for the batch-sized part of the merge-first contraction path.

TT (docs/method.md §5): with ``L = merge(G_1..G_d)`` of shape ``(m, r)`` and ``R = merge(G_{d+1}..G_K)`` of
shape ``(r, n)``, a TT layer computes ``Y = (X L) R + b`` with two GEMMs. The bias rides inside the second
GEMM: ``T_aug = [X L, 1]`` (B x (r+1)) times ``R_aug = [R; b]`` ((r+1) x n), so no output-sized bias pass
is made, and in the backward ``T_aug^T dY`` yields ``dR`` and ``db`` in one pass over ``dY``. Backward:
``U = dY R^T``, ``dX = U L^T``, ``dR_aug = T_aug^T dY``, ``dL = (U^T X)^T``: four batch-sized GEMMs
(``dL`` is computed transposed: the wide-output layout runs about 25% faster than ``X^T U`` on CPU). Saved per
call: ``X`` (as any linear layer) and the small ``T_aug``.

TTM: with ``A = merge(F_1..F_p)`` of shape ``(M_L, N_L, r)`` and ``C = merge(F_{p+1}..F_d)`` of shape
``(r, M_R, N_R)``, ``Y[b, jl, jr] = sum_{il, ir, a} X[b, il, ir] A[il, jl, a] C[a, ir, jr] + bias``:
first ``T = X(B*M_L, M_R) @ C'(M_R, r*N_R)``, then the batched ``Y[b] = A'(N_L, M_L*r) @ T[b](M_L*r, N_R)``.

Autocast: the forward runs under whatever autocast state is active (its GEMMs take the autocast dtype, e.g.
bf16, while cores stay fp32 masters), and the backward re-enters that same state, as
``torch.amp.custom_bwd`` does, so its GEMMs see matching dtypes; gradients reach fp32 parameters as fp32.

Index legend:
    b      batch (all leading dims of the input flattened)
    il/ir  input (row) modes of the left / right half, M_L / M_R values
    jl/jr  output (column) modes of the left / right half, N_L / N_R values
    a      the rank of the bond between the two halves
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["low_rank_linear", "ttm_split_linear"]


def _record_autocast(ctx, x: torch.Tensor) -> None:
    device_type = x.device.type
    ctx.autocast_device = device_type
    ctx.autocast_enabled = torch.is_autocast_enabled(device_type)
    ctx.autocast_dtype = torch.get_autocast_dtype(device_type)


def _replay_autocast(ctx) -> torch.autocast:
    return torch.autocast(ctx.autocast_device, dtype=ctx.autocast_dtype, enabled=ctx.autocast_enabled)


class _LowRankLinear(torch.autograd.Function):
    """``Y = (X @ L) @ R + bias`` for 2-D ``X`` (B, m), ``L`` (m, r), ``R`` (r, n), ``bias`` (n,) or None."""

    @staticmethod
    def forward(ctx, x, left, right, bias):
        _record_autocast(ctx, x)
        rank = left.shape[1]
        inner = x @ left
        if bias is not None:
            inner = torch.nn.functional.pad(inner, (0, 1), value=1.0)
            right = torch.cat([right, bias.unsqueeze(0)], dim=0)
        ctx.save_for_backward(x, inner, left, right)
        ctx.rank = rank
        return inner @ right

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        with _replay_autocast(ctx):
            return _LowRankLinear._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, inner, left, right = ctx.saved_tensors
        rank = ctx.rank
        needs_x, needs_left, needs_right, needs_bias = ctx.needs_input_grad
        grad_x = grad_left = grad_right = grad_bias = None
        if needs_x or needs_left:
            projected = grad_out @ right[:rank].t()
            if needs_x:
                grad_x = projected @ left.t()
            if needs_left:
                grad_left = (projected.t() @ x).t()
        if needs_right or needs_bias:
            grad_right_aug = inner.t() @ grad_out
            grad_right = grad_right_aug[:rank] if needs_right else None
            grad_bias = grad_right_aug[rank] if needs_bias else None
        return grad_x, grad_left, grad_right, grad_bias


def low_rank_linear(
    x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``(x @ left) @ right + bias`` with the merge-first backward.

    Args:
        x: ``(B, m)`` input, 2-D.
        left: ``(m, r)``.
        right: ``(r, n)``.
        bias: ``(n,)`` or None.

    Returns:
        ``(B, n)``.
    """
    return _LowRankLinear.apply(x, left, right, bias)


class _TTMSplitLinear(torch.autograd.Function):
    """Two-half TTM product, see the module docstring for the shapes."""

    @staticmethod
    def forward(ctx, x, left, right, bias):
        _record_autocast(ctx, x)
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
            out = out + bias.reshape(cols_left, cols_right)
        ctx.save_for_backward(x, inner, left_mat, right_mat)
        ctx.dims = (rows_left, cols_left, rank, rows_right, cols_right)
        return out.reshape(batch, cols_left * cols_right)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        with _replay_autocast(ctx):
            return _TTMSplitLinear._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        x, inner, left_mat, right_mat = ctx.saved_tensors
        rows_left, cols_left, rank, rows_right, cols_right = ctx.dims
        needs_x, needs_left, needs_right, needs_bias = ctx.needs_input_grad
        batch = x.shape[0]
        grad_out = grad_out.reshape(batch, cols_left, cols_right)
        grad_x = grad_left = grad_right = grad_bias = None
        if needs_left:
            grad_left_mat = torch.einsum("bpq,bkq->pk", grad_out, inner)
            grad_left = grad_left_mat.reshape(cols_left, rows_left, rank).permute(1, 0, 2)
        if needs_x or needs_right:
            grad_inner = torch.matmul(left_mat.t(), grad_out).reshape(batch * rows_left, rank * cols_right)
            if needs_right:
                grad_right_mat = x.reshape(batch * rows_left, rows_right).t() @ grad_inner
                grad_right = grad_right_mat.reshape(rows_right, rank, cols_right).permute(1, 0, 2)
            if needs_x:
                grad_x = (grad_inner @ right_mat.t()).reshape(batch, rows_left * rows_right)
        if needs_bias:
            grad_bias = grad_out.sum(0).reshape(-1)
        return grad_x, grad_left, grad_right, grad_bias


def ttm_split_linear(
    x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """TTM layer product from its two merged halves.

    Args:
        x: ``(B, M_L * M_R)`` input, 2-D, row-major over (left rows, right rows).
        left: ``(M_L, N_L, r)``, the merged left half.
        right: ``(r, M_R, N_R)``, the merged right half.
        bias: ``(N_L * N_R,)`` or None.

    Returns:
        ``(B, N_L * N_R)``.
    """
    return _TTMSplitLinear.apply(x, left, right, bias)
