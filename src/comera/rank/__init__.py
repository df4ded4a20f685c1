"""Rank adaptation: size accounting, size surrogates, the two-stage objective and its late-stage controller,
the exact trim, pruning, parameter groups, the spectral rule and uneven rank allocation.
"""

from comera.nn.removed import RemovedEmbedding, RemovedEmbeddingBag, RemovedLayer, RemovedLinear
from comera.rank.adaptation import LateStageEvent, RankAdaptation
from comera.rank.allocation import allocate_ranks, core_entries, ranks_from_gates
from comera.rank.groups import param_groups
from comera.rank.prune import PrunedLayer, PruneResult, prune_
from comera.rank.size import gated_trains, live_ranks, mib, total_size, train_size
from comera.rank.spectral import CORE_RULES, spectral_init_, spectral_lr_scales
from comera.rank.surrogate import SURROGATES, mean_gate_surrogate, size_surrogate
from comera.rank.trim import TrimChoice, choose_entries, entry_scores, hold_entries

__all__ = [
    "CORE_RULES",
    "SURROGATES",
    "allocate_ranks",
    "ranks_from_gates",
    "core_entries",
    "spectral_init_",
    "spectral_lr_scales",
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
