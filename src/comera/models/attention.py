"""Scaled dot-product attention whose CPU training path draws its dropout cheaply: with ``dropout_p > 0`` on a
CPU, :func:`attention_context` forms the probabilities itself and drops them with the random bytes of
:mod:`comera.models.dropout` (block by block where the scores exceed one block), and calls SDPA everywhere
else. Details: docs/internals.md, "Attention and dropout on CPU"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from comera.models.blocked_attention import BLOCK_ELEMENTS, blocked_dropout_attention
from comera.models.dropout import drop_threshold, fast_dropout, keep_scale, random_bytes

__all__ = ["attention_context", "plain_dropout_attention"]


def _blocked_path_applies(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """The blocked kernel's conditions: eager, no autocast, a mask that needs no gradient, and more scores
    than one block holds (when they all fit in one, blocking saves no memory traffic and its per-block ops
    cost more than the plain path's few whole-tensor ones: 7.9 against 6.7 ms forward + backward at
    32 x 4 x 64 x 64 on a 2-core AMD EPYC)."""
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(q.device.type):
        return False
    if q.shape[:-1].numel() * k.shape[-2] <= BLOCK_ELEMENTS:
        return False
    return mask is None or not mask.requires_grad


def attention_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    scale: float | None = None,
) -> torch.Tensor:
    """``dropout_p(softmax(q k^T * scale + mask)) v``, each query's context vector.

    Args:
        q: ``(B, H, Tq, d)`` queries.
        k, v: ``(B, H, Tk, d)`` keys and values.
        mask: None, a bool tensor broadcastable to ``(B, H, Tq, Tk)`` (True: may attend), or an additive
            float bias of that shape (``-inf`` or a large negative value where not allowed). Every query must
            be allowed at least one key.
        p: drop probability of the attention probabilities, in ``[0, 1)``; pass 0 when not training.
        scale: factor on the scores; default ``1 / sqrt(d)``.

    Returns:
        ``(B, H, Tq, d)``; from the blocked path stored as ``(B, Tq, H, d)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if p <= 0.0 or q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    if _blocked_path_applies(q, k, mask):
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        drop_bytes = random_bytes((*q.shape[:-1], k.shape[-2]), q.device)
        return blocked_dropout_attention(q, k, v, mask, drop_bytes, drop_threshold(p), scale, keep_scale(p))
    return plain_dropout_attention(q, k, v, mask, p, scale)


def plain_dropout_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float, scale: float
) -> torch.Tensor:
    """:func:`attention_context`'s training computation with plain ops over the whole ``(B, H, Tq, Tk)``
    scores (its form under ``torch.compile`` and autocast); same arguments, same random draws."""
    # the scale on q: (B, H, Tq, d) elements instead of the (B, H, Tq, Tk) scores
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    # dropout's 1 / (1 - q) on v: (B, H, Tk, d) elements instead of the (B, H, Tq, Tk) probabilities
    kept = fast_dropout(scores.softmax(dim=-1), p, rescale=False)
    return torch.matmul(kept, v * keep_scale(p))
