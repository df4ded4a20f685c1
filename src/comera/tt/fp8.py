"""FP8 batch-sized GEMMs for the merge-first low-rank product: :func:`fp8_low_rank_linear` computes
``Y = (X L) R + b`` (``X`` ``(B, m)``, ``L`` ``(m, r)``, ``R`` ``(r, n)``) through ``torch._scaled_mm``, E4M3
forward, E5M2 gradients, one per-tensor scale per operand. Details: docs/method.md section 7.2,
docs/internals.md, "FP8 GEMMs"."""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "FORWARD_FORMAT",
    "GRADIENT_FORMAT",
    "CUDA_ALIGNMENT",
    "fp8_low_rank_linear",
    "fp8_supported",
    "quantize",
    "scaled_matmul",
]

FORWARD_FORMAT = torch.float8_e4m3fn
"""FP8 format of the forward operands ``X``, ``L``, ``T``, ``R``."""
GRADIENT_FORMAT = torch.float8_e5m2
"""FP8 format of the gradients ``dY`` and ``U = dY R^T``."""
CUDA_ALIGNMENT = 16
"""Multiple that every GEMM dimension is padded to on CUDA."""
_FP8_FORMATS = (FORWARD_FORMAT, GRADIENT_FORMAT)
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny


def quantize(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor amax scaling of ``tensor`` into the FP8 format ``dtype``.

    Args:
        tensor: any shape, floating point.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        ``(fp8, scale)``: ``fp8`` with the shape of ``tensor`` (contiguous), and ``scale`` a 0-dim fp32 tensor
        on the same device with ``tensor ~= fp8.float() * scale``. ``scale = amax(|tensor|) / max(dtype)``,
        at least the smallest normal fp32 number (an all-zero tensor quantises to zeros).
    """
    if dtype not in _FP8_FORMATS:
        raise ValueError(f"dtype must be one of {_FP8_FORMATS}, got {dtype!r}")
    largest = torch.finfo(dtype).max
    values = tensor.detach().float()
    if values.numel() == 0:
        return values.to(dtype), torch.ones((), dtype=torch.float32, device=tensor.device)
    scale = (values.abs().amax() / largest).clamp_min(_SMALLEST_SCALE)
    return (values / scale).clamp_(-largest, largest).to(dtype), scale


def _row_major(matrix: torch.Tensor) -> torch.Tensor:
    return matrix if matrix.stride(1) == 1 else matrix.contiguous()


def _column_major(matrix: torch.Tensor) -> torch.Tensor:
    return matrix if matrix.stride(0) == 1 else matrix.t().contiguous().t()


def scaled_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)`` with FP8 ``a`` (M, K) and ``b`` (K, N) and 0-dim fp32 scales,
    returned as ``out_dtype``; ``a`` is made row-major and ``b`` column-major where needed (a copy)."""
    return torch._scaled_mm(
        _row_major(a), _column_major(b), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype
    )


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _pad(matrix: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``matrix`` in the top-left corner of a zero ``(rows, cols)`` matrix of its dtype (FP8 included)."""
    if matrix.shape == (rows, cols):
        return matrix
    padded = matrix.new_zeros(rows, cols)
    padded[: matrix.shape[0], : matrix.shape[1]] = matrix
    return padded


class _FP8LowRankLinear(torch.autograd.Function):
    """``Y = (X @ L) @ R + bias`` with the six batch-sized GEMMs in FP8 (docs/internals.md, "FP8 GEMMs")."""

    @staticmethod
    def forward(ctx, x, left, right, bias, alignment):
        batch, in_features = x.shape
        rank, out_features = right.shape
        padded = [_round_up(size, alignment) for size in (batch, in_features, rank, out_features)]
        batch_p, in_p, rank_p, out_p = padded
        x_q, x_scale = quantize(x, FORWARD_FORMAT)
        left_q, left_scale = quantize(left, FORWARD_FORMAT)
        right_q, right_scale = quantize(right, FORWARD_FORMAT)
        x_q = _pad(x_q, batch_p, in_p)
        left_q = _pad(left_q, in_p, rank_p)
        right_q = _pad(right_q, rank_p, out_p)
        inner = scaled_matmul(x_q, x_scale, left_q, left_scale, torch.float32)
        inner_q, inner_scale = quantize(inner, FORWARD_FORMAT)
        out = scaled_matmul(inner_q, inner_scale, right_q, right_scale, x.dtype)[:batch, :out_features]
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(x_q, x_scale, left_q, left_scale, inner_q, inner_scale, right_q, right_scale)
        ctx.sizes = (batch, in_features, rank, out_features)
        ctx.padded = padded
        ctx.dtypes = (x.dtype, left.dtype, right.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x_q, x_scale, left_q, left_scale, inner_q, inner_scale, right_q, right_scale = ctx.saved_tensors
        batch, in_features, rank, out_features = ctx.sizes
        batch_p, _, _, out_p = ctx.padded
        x_dtype, left_dtype, right_dtype, bias_dtype = ctx.dtypes
        needs_x, needs_left, needs_right, needs_bias, _ = ctx.needs_input_grad
        grad_x = grad_left = grad_right = grad_bias = None
        grad_q, grad_scale = quantize(grad_out, GRADIENT_FORMAT)
        grad_q = _pad(grad_q, batch_p, out_p)
        if needs_x or needs_left:
            projected = scaled_matmul(grad_q, grad_scale, right_q.t(), right_scale, torch.float32)
            projected_q, projected_scale = quantize(projected, GRADIENT_FORMAT)
            if needs_x:
                grad_x = scaled_matmul(projected_q, projected_scale, left_q.t(), left_scale, x_dtype)
                grad_x = grad_x[:batch, :in_features]
            if needs_left:
                grad_left_t = scaled_matmul(projected_q.t(), projected_scale, x_q, x_scale, left_dtype)
                grad_left = grad_left_t[:rank, :in_features].t()
        if needs_right:
            grad_right = scaled_matmul(inner_q.t(), inner_scale, grad_q, grad_scale, right_dtype)
            grad_right = grad_right[:rank, :out_features]
        if needs_bias:
            grad_bias = grad_out.float().sum(0).to(bias_dtype)
        return grad_x, grad_left, grad_right, grad_bias, None


def _check_matrix(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != 2 or not value.is_floating_point():
        raise ValueError(
            f"{name} must be a 2-D floating-point tensor, got shape {tuple(value.shape)} dtype {value.dtype}"
        )
    return value


def _check_operands(x, left, right, bias) -> None:
    _check_matrix(x, "x")
    _check_matrix(left, "left")
    _check_matrix(right, "right")
    if left.shape[0] != x.shape[1]:
        raise ValueError(
            f"left must have shape ({x.shape[1]}, r) to match x {tuple(x.shape)}, got {tuple(left.shape)}"
        )
    if right.shape[0] != left.shape[1]:
        raise ValueError(
            f"right must have shape ({left.shape[1]}, n) to match left {tuple(left.shape)}, "
            f"got {tuple(right.shape)}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (right.shape[1],)):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be None or a tensor of shape ({right.shape[1]},), got {shape}")


def fp8_low_rank_linear(
    x: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    alignment: int | None = None,
) -> torch.Tensor:
    """``(x @ left) @ right + bias`` with its six batch-sized GEMMs in FP8 (E4M3 forward, E5M2 gradients).

    Args:
        x: ``(B, m)`` input, 2-D.
        left: ``(m, r)``, the merged input-side cores (fp32 master).
        right: ``(r, n)``, the merged output-side cores (fp32 master).
        bias: ``(n,)`` or None; added in full precision.
        alignment: pad ``B``, ``m``, ``r``, ``n`` with zeros up to multiples of this (>= 1) for the GEMMs;
            default :data:`CUDA_ALIGNMENT` on CUDA (a ``torch._scaled_mm`` requirement there), 1 elsewhere.

    Returns:
        ``(B, n)`` in ``x.dtype``. Expect a relative error of a few percent against fp32 (see
        ``tests/tt/test_fp8.py`` for the bound); gradients reach ``left``/``right``/``bias`` in their dtypes.
    """
    _check_operands(x, left, right, bias)
    if alignment is None:
        alignment = CUDA_ALIGNMENT if x.device.type == "cuda" else 1
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1 or None, got {alignment!r}")
    return _FP8LowRankLinear.apply(x, left, right, bias, alignment)


@functools.cache
def _probe(device: str) -> bool:
    try:
        ones = torch.ones(CUDA_ALIGNMENT, CUDA_ALIGNMENT, device=device)
        unit = torch.ones((), device=device)
        a = ones.to(FORWARD_FORMAT)
        b = ones.to(GRADIENT_FORMAT)
        result = scaled_matmul(b, unit, a, unit, torch.float32)
        return bool(result[0, 0] == CUDA_ALIGNMENT)
    except (AssertionError, AttributeError, ImportError, NotImplementedError, RuntimeError, TypeError):
        # AssertionError/ImportError: a backend this build lacks ("Torch not compiled with CUDA enabled")
        return False


def fp8_supported(device: torch.device | str = "cpu") -> bool:
    """Whether ``torch._scaled_mm`` runs E5M2 x E4M3 products on ``device`` (probed once; syncs)."""
    return _probe(str(torch.device(device)))
