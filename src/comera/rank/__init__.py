"""Rank adaptation: size accounting, size surrogates, the two-stage objective and its late-stage controller,
the exact trim, pruning, parameter groups."""

from comera.nn.removed import RemovedEmbedding, RemovedEmbeddingBag, RemovedLayer, RemovedLinear
from comera.rank.adaptation import LateStageEvent, RankAdaptation
from comera.rank.groups import param_groups
from comera.rank.prune import PrunedLayer, PruneResult, prune_
from comera.rank.size import gated_trains, live_ranks, mib, total_size, train_size
from comera.rank.surrogate import SURROGATES, mean_gate_surrogate, size_surrogate
from comera.rank.trim import TrimChoice, choose_entries, entry_scores, hold_entries

__all__ = [
    "SURROGATES",
    "LateStageEvent",
    "TrimChoice",
    "choose_entries",
    "entry_scores",
    "hold_entries",
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
