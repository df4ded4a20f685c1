"""Dropout whose random draws are cheap: keep decisions read from the bytes of random int64 words.

``F.dropout`` draws one random float per element (``bernoulli_``), which on CPU costs several times an
element-wise op. Here one random int64 word over the full range (``torch.randint``; the range misses one of
the 2**64 values, a bias of 2**-64) yields eight independent uniform bytes, and an
element is kept when its byte is at least ``round(256 p)``: the keep decisions stay independent, with keep
probability ``1 - q`` where ``q`` is ``p`` rounded to a multiple of 1/256 (:func:`quantized_p`; 0.1 becomes
26/256 = 0.1016). Kept elements are scaled by ``1 / (1 - q)``, so the expectation is the input, as with
``F.dropout``. Mask and scale are applied by ATen's dropout-mask kernel (``native_dropout_backward``: one
pass, and its gradient is the same masked scaling), so backward costs what ``F.dropout``'s does.

There is no host synchronisation and no data-dependent shape, so ``torch.compile(fullgraph=True)`` traces it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from comera.checks import check_number

__all__ = ["FastDropout", "fast_dropout", "keep_mask", "quantized_p"]

_LEVELS = 256
_BYTES_PER_WORD = 8
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _check_p(p: float) -> float:
    return check_number(p, "dropout probability p", 0.0, 1.0, open_high=True)


def _threshold(p: float) -> int:
    """Bytes below this value drop their element: ``round(256 p)``, at least 1 when ``p > 0``."""
    level = round(_check_p(p) * _LEVELS)
    return min(max(level, 1 if p > 0 else 0), _LEVELS - 1)


def quantized_p(p: float) -> float:
    """The drop probability actually used for requested ``p``: ``p`` rounded to a multiple of 1/256.

    A positive ``p`` never rounds to 0 (the smallest is 1/256) and the largest is 255/256.
    """
    return _threshold(p) / _LEVELS


def keep_mask(
    shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """A bool tensor of ``shape``, each entry True independently with probability ``1 - quantized_p(p)``.

    Draws ``ceil(numel / 8)`` full-range int64 words from the default generator of ``device``.
    """
    count = math.prod(shape)
    words = torch.randint(
        _INT64_MIN, _INT64_MAX, (-(-count // _BYTES_PER_WORD),), dtype=torch.int64, device=device
    )
    random_bytes = words.view(torch.uint8)[:count]
    return random_bytes.view(shape) >= _threshold(p)


def fast_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout of ``x`` (any shape) with drop probability ``quantized_p(p)``; the identity when not training.

    Returns a tensor of ``x``'s shape: kept entries scaled by ``1 / (1 - quantized_p(p))``, dropped ones 0.
    """
    q = quantized_p(p)
    if not training or q == 0.0:
        return x
    keep = keep_mask(x.shape, p, x.device)
    return torch.ops.aten.native_dropout_backward(x, keep, 1.0 / (1.0 - q))


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
