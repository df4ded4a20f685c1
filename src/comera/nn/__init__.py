"""Modules: TT/TTM linear layers (and, later, embeddings) with rank gates."""

from comera.nn.gated import DEFAULT_TAU, GatedTrain, mask_gate
from comera.nn.linear import TTLinear, TTMLinear

__all__ = ["DEFAULT_TAU", "GatedTrain", "TTLinear", "TTMLinear", "mask_gate"]
