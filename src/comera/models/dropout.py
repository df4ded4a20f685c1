"""Dropout whose random draws are cheap: keep decisions read from the eight bytes of each random int64 word,
``p`` quantised to a multiple of 1/256 (:func:`quantized_p`), kept elements scaled by ``1 / (1 - q)``; no host
sync, so ``torch.compile(fullgraph=True)`` traces it. Details: docs/internals.md, "Attention and dropout on
CPU"."""

from __future__ import annotations

import math

import torch
from torch import nn

from comera.checks import check_number

__all__ = [
    "FastDropout",
    "drop_threshold",
    "fast_dropout",
    "keep_mask",
    "keep_scale",
    "quantized_p",
    "random_bytes",
]

_LEVELS = 256
_BYTES_PER_WORD = 8
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _check_p(p: float) -> float:
    return check_number(p, "dropout probability p", 0.0, 1.0, open_high=True)


def drop_threshold(p: float) -> int:
    """Bytes below this value drop their element: ``round(256 p)``, at least 1 when ``p > 0``."""
    level = round(_check_p(p) * _LEVELS)
    return min(max(level, 1 if p > 0 else 0), _LEVELS - 1)


def quantized_p(p: float) -> float:
    """The drop probability actually used for requested ``p``: ``p`` rounded to a multiple of 1/256, a
    positive ``p`` never to 0 (at least 1/256, at most 255/256)."""
    return drop_threshold(p) / _LEVELS


def keep_scale(p: float) -> float:
    """The factor on kept elements for requested ``p``: ``1 / (1 - quantized_p(p))``."""
    return 1.0 / (1.0 - quantized_p(p))


def random_bytes(shape: torch.Size | tuple[int, ...], device: torch.device | str | None) -> torch.Tensor:
    """Uniform uint8 bytes of ``shape``: ``ceil(numel / 8)`` full-range int64 words of the default generator
    of ``device``, viewed as bytes."""
    count = math.prod(shape)
    words = torch.randint(
        _INT64_MIN, _INT64_MAX, (-(-count // _BYTES_PER_WORD),), dtype=torch.int64, device=device
    )
    return words.view(torch.uint8)[:count].view(shape)


def keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """A bool tensor of ``shape``, each entry True independently with probability ``1 - quantized_p(p)``, from
    ``ceil(numel / 8)`` full-range int64 words of ``device``'s default generator (the draws
    :func:`fast_dropout` makes)."""
    return random_bytes(shape, device) >= drop_threshold(p)


def _scaled_mask(
    random_bytes: torch.Tensor, threshold: int, scale: float, like: torch.Tensor
) -> torch.Tensor:
    """``scale`` where a byte is at least ``threshold``, else 0, in ``like``'s dtype."""
    if torch.compiler.is_compiling():
        return (random_bytes >= threshold).to(like.dtype) * scale
    mask = torch.empty(random_bytes.shape, dtype=like.dtype, device=like.device)
    torch.ge(random_bytes, threshold, out=mask)
    return mask if scale == 1.0 else mask.mul_(scale)


class _MaskedScale(torch.autograd.Function):
    """``x * mask * scale`` with ``mask`` read from random bytes; saves only the bytes for backward."""

    @staticmethod
    def forward(x: torch.Tensor, random_bytes: torch.Tensor, threshold: int, scale: float) -> torch.Tensor:
        return x * _scaled_mask(random_bytes, threshold, scale, x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, random_bytes, ctx.threshold, ctx.scale = inputs
        ctx.save_for_backward(random_bytes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (random_bytes,) = ctx.saved_tensors
        return grad * _scaled_mask(random_bytes, ctx.threshold, ctx.scale, grad), None, None, None


def fast_dropout(x: torch.Tensor, p: float, training: bool = True, *, rescale: bool = True) -> torch.Tensor:
    """Dropout of ``x`` (any shape) with drop probability ``quantized_p(p)``; the identity when not training.
    Returns ``x``'s shape, dropped entries 0, kept ones scaled by ``1 / (1 - quantized_p(p))`` (unscaled with
    ``rescale=False``)."""
    q = quantized_p(p)
    if not training or q == 0.0:
        return x
    scale = keep_scale(p) if rescale else 1.0
    return _MaskedScale.apply(x, random_bytes(x.shape, x.device), drop_threshold(p), scale)


class FastDropout(nn.Module):
    """``nn.Dropout`` drawing its keep decisions with :func:`keep_mask` (``p`` quantised to 1/256).

    Shape: any input shape; the output has the same shape.
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = _check_p(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p} (used: {quantized_p(self.p):.6g})"
