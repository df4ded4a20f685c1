"""The TT linear layer published with the CoMERA paper (merge ``L`` and ``R``, then ``Y = (X L) R + b`` by
plain autograd, docs/method.md section 5), rebuilt from its description over a :class:`comera.TTLinear`'s
cores as a benchmark baseline; a test checks it against the layer."""

from __future__ import annotations

import torch
from torch import nn

from comera.nn.linear import TTLinear
from comera.tt.merge import merge_tt_left, merge_tt_right

__all__ = ["PublishedTTLinear"]


class PublishedTTLinear(nn.Module):
    """The published merge-then-two-GEMMs TT layer over ``layer``'s cores: ``(B, in) -> (B, out)``.

    Args:
        layer: the :class:`comera.TTLinear` whose cores, gates and bias are shared (not copied).
    """

    def __init__(self, layer: TTLinear) -> None:
        super().__init__()
        if not isinstance(layer, TTLinear):
            raise TypeError(f"layer must be a comera.TTLinear, got {type(layer).__name__}")
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for a 2-D ``x`` of shape ``(B, in_features)``."""
        layer = self.layer
        cores, split = layer.gated_cores(), len(layer.in_shape)
        left = merge_tt_left(cores[:split])[: layer.in_features]
        right = merge_tt_right(cores[split:])[:, : layer.out_features]
        out = (x @ left) @ right
        return out if layer.bias is None else out + layer.bias
