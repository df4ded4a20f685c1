"""Modules: TT/TTM linear layers and TTM embeddings with rank gates."""

from comera.nn.embedding import TTMEmbedding, TTMEmbeddingBag
from comera.nn.gated import DEFAULT_TAU, GatedTrain, mask_gate
from comera.nn.layer import ComeraLayer, layer_kinds, layer_type, register_layer
from comera.nn.linear import TTLinear, TTMLinear
from comera.nn.tied_head import TTMTiedHead

__all__ = [
    "ComeraLayer",
    "DEFAULT_TAU",
    "GatedTrain",
    "TTLinear",
    "TTMEmbedding",
    "TTMEmbeddingBag",
    "TTMLinear",
    "TTMTiedHead",
    "layer_kinds",
    "layer_type",
    "mask_gate",
    "register_layer",
]
