"""Rank adaptation: size accounting, size surrogates, the two-stage objective, pruning, parameter groups."""

from comera.nn.removed import RemovedEmbedding, RemovedEmbeddingBag, RemovedLayer, RemovedLinear
from comera.rank.adaptation import RankAdaptation
from comera.rank.groups import param_groups
from comera.rank.prune import PrunedLayer, PruneResult, prune_
from comera.rank.size import gated_trains, live_ranks, mib, total_size, train_size
from comera.rank.surrogate import SURROGATES, mean_gate_surrogate, size_surrogate

__all__ = [
    "SURROGATES",
    "PruneResult",
    "PrunedLayer",
    "RankAdaptation",
    "RemovedEmbedding",
    "RemovedEmbeddingBag",
    "RemovedLayer",
    "RemovedLinear",
    "gated_trains",
    "live_ranks",
    "mean_gate_surrogate",
    "mib",
    "param_groups",
    "prune_",
    "size_surrogate",
    "total_size",
    "train_size",
]
