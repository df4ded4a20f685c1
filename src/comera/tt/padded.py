"""A linear map by the first rows of a rebuilt weight (``(rows, in)``, ``rows >= out_features``), with no copy
of the weight or the output. Details: docs/internals.md, "Padded rows"."""

from __future__ import annotations

import torch

__all__ = ["padded_rows_linear"]


class _PaddedRowsLinear(torch.autograd.Function):
    """``y = x @ weight[:out]^T + bias`` with row ``zero_row`` of ``weight`` read as zero."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_features, zero_row):
        kept = weight[:out_features]
        y = x @ kept.t() if bias is None else torch.addmm(bias, x, kept.t())
        if zero_row is not None:
            y[:, zero_row] = 0.0 if bias is None else bias[zero_row]
        ctx.save_for_backward(x, weight)
        ctx.out_features, ctx.zero_row, ctx.has_bias = out_features, zero_row, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        out, zero_row = ctx.out_features, ctx.zero_row
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ weight[:out]
            if zero_row is not None:  # the zero row contributed nothing: take back what the GEMM added
                grad_x -= grad[:, zero_row, None] * weight[zero_row]
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(weight)
            grad_weight[out:].zero_()
            torch.mm(grad.t(), x, out=grad_weight[:out])
            if zero_row is not None:
                grad_weight[zero_row].zero_()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias, None, None


def padded_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    zero_row: int | None = None,
) -> torch.Tensor:
    """``x @ weight[:out_features]^T + bias``, with row ``zero_row`` of ``weight`` taken as zero.

    Args:
        x: ``(B, in)``.
        weight: ``(rows, in)`` contiguous, ``rows >= out_features``; rows past ``out_features`` are padding
            (their gradient is zero).
        bias: ``(out_features,)`` or None.
        out_features: outputs kept, in ``[1, rows]``.
        zero_row: an output in ``[0, out_features)`` that is the bias alone (0 without one), its weight row
            getting no gradient; None for none.

    Returns:
        ``(B, out_features)``, contiguous.
    """
    if not 1 <= out_features <= weight.shape[0]:
        raise ValueError(f"out_features must be in [1, {weight.shape[0]}], got {out_features}")
    if zero_row is not None and not 0 <= zero_row < out_features:
        raise ValueError(f"zero_row must be in [0, {out_features - 1}] or None, got {zero_row}")
    return _PaddedRowsLinear.apply(x, weight.contiguous(), bias, out_features, zero_row)
