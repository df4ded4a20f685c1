"""Attention with dropout on the probabilities, computed block by block (a block of heads of one batch
element, at most :data:`BLOCK_ELEMENTS` scores) so each pass over the scores after the first reads from cache
(CPU); inputs ``(B, H, T, d)``, output and gradients stored as ``(B, T, H, d)``. Details: docs/internals.md,
"Attention and dropout on CPU"."""

from __future__ import annotations

import torch

__all__ = ["BLOCK_ELEMENTS", "blocked_dropout_attention"]

BLOCK_ELEMENTS = 1 << 19
"""Most scores per block (2 MiB in fp32); measured best at T=512 (two heads of 512 x 512)."""


def _blocks(batch: int, heads: int, rows: int, cols: int):
    """``(batch index, head slice)`` pairs covering ``batch x heads``, at most BLOCK_ELEMENTS scores each
    (at least one head). A block never spans two batch elements: then the head-split views of q, k and v,
    stored token-major, are plain strided 3-D matrices that the matrix products read without a copy."""
    step = max(1, BLOCK_ELEMENTS // (rows * cols))
    for b in range(batch):
        for start in range(0, heads, step):
            yield b, slice(start, min(start + step, heads))


def _token_major(like: torch.Tensor, length: int) -> torch.Tensor:
    """An uninitialised ``(B, H, length, d)`` tensor stored as ``(B, length, H, d)``."""
    batch, heads, _, width = like.shape
    return like.new_empty(batch, length, heads, width).transpose(1, 2)


def _product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, factor: float) -> None:
    """``out = factor * (a @ b)`` for 3-D ``a``, ``b``; ``out`` may be a strided view."""
    out.copy_(torch.bmm(a, b).mul_(factor))


class _BlockedDropoutAttention(torch.autograd.Function):
    """``(keep(bytes) * softmax(q k^T * scale + bias) * keep_scale) v``, block by block.

    Index legend (per block of one batch element): h head, i query position, j key position.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, random_bytes, threshold, scale, keep_scale):
        batch, heads, rows, _ = q.shape
        cols = k.shape[-2]
        probabilities = q.new_empty(batch, heads, rows, cols)
        output = _token_major(v, rows)
        bias_full = None if bias is None else bias.expand(batch, heads, rows, cols)
        for b, hs in _blocks(batch, heads, rows, cols):
            keys = k[b, hs].transpose(-2, -1)
            if bias_full is None:
                scores = torch.bmm(q[b, hs], keys).mul_(scale)  # hij
            else:
                scores = torch.baddbmm(bias_full[b, hs], q[b, hs], keys, alpha=scale)  # hij
            kept = probabilities[b, hs]
            torch.softmax(scores, -1, out=kept)
            mask = torch.ge(random_bytes[b, hs], threshold, out=scores)
            _product_into(output[b, hs], mask.mul_(kept), v[b, hs], keep_scale)
        ctx.save_for_backward(q, k, v, probabilities, random_bytes)
        ctx.threshold, ctx.scale, ctx.keep_scale = threshold, scale, keep_scale
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        q, k, v, probabilities, random_bytes = ctx.saved_tensors
        batch, heads, rows, _ = q.shape
        cols = k.shape[-2]
        grad_q, grad_k, grad_v = _token_major(q, rows), _token_major(k, cols), _token_major(v, cols)
        score_factor = ctx.scale * ctx.keep_scale
        for b, hs in _blocks(batch, heads, rows, cols):
            kept_probabilities = probabilities[b, hs]
            grad_block = grad_output[b, hs]
            mask = torch.ge(random_bytes[b, hs], ctx.threshold, out=torch.empty_like(kept_probabilities))
            grad_kept = torch.bmm(grad_block, v[b, hs].transpose(-2, -1)).mul_(mask)  # hij
            dropped = mask.mul_(kept_probabilities).transpose(-2, -1)
            _product_into(grad_v[b, hs], dropped, grad_block, ctx.keep_scale)
            grad_scores = torch._softmax_backward_data(grad_kept, kept_probabilities, -1, grad_kept.dtype)
            _product_into(grad_q[b, hs], grad_scores, k[b, hs], score_factor)
            _product_into(grad_k[b, hs], grad_scores.transpose(-2, -1), q[b, hs], score_factor)
        return grad_q, grad_k, grad_v, None, None, None, None, None


def blocked_dropout_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    random_bytes: torch.Tensor,
    threshold: int,
    scale: float,
    keep_scale: float,
) -> torch.Tensor:
    """Attention whose probabilities are dropped where ``random_bytes < threshold``, block by block.

    Args:
        q: ``(B, H, Tq, d)`` queries; k, v: ``(B, H, Tk, d)`` keys and values (any strides).
        bias: None or an additive float bias broadcastable to ``(B, H, Tq, Tk)`` (``-inf`` where a key may
            not be attended); it gets no gradient.
        random_bytes: ``(B, H, Tq, Tk)`` uint8; a probability is kept where its byte is ``>= threshold``.
        threshold: in ``[0, 256]``.
        scale: factor on the scores.
        keep_scale: factor on the kept probabilities (``1 / (1 - drop probability)``).

    Returns:
        ``(B, H, Tq, d)``, stored as ``(B, Tq, H, d)`` (so ``.transpose(1, 2)`` is contiguous).
    """
    if bias is not None and bias.requires_grad:
        raise ValueError("bias: an attention bias that requires grad is not supported by the blocked path")
    expected = (*q.shape[:-1], k.shape[-2])
    if random_bytes.shape != expected or random_bytes.dtype != torch.uint8:
        raise ValueError(
            f"random_bytes must be uint8 of shape {tuple(expected)}, got {random_bytes.dtype} "
            f"{tuple(random_bytes.shape)}"
        )
    return _BlockedDropoutAttention.apply(q, k, v, bias, random_bytes, threshold, scale, keep_scale)
