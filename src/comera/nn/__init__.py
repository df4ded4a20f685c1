"""Modules: TT/TTM linear layers and TTM embeddings with rank gates."""

from comera.nn.embedding import TTMEmbedding, TTMEmbeddingBag, TTMTiedHead
from comera.nn.gated import DEFAULT_TAU, GatedTrain, mask_gate
from comera.nn.linear import TTLinear, TTMLinear

__all__ = [
    "DEFAULT_TAU",
    "GatedTrain",
    "TTLinear",
    "TTMEmbedding",
    "TTMEmbeddingBag",
    "TTMLinear",
    "TTMTiedHead",
    "mask_gate",
]
