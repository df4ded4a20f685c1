"""Tensor math on plain tensors: shapes, cores, merges, TT-SVD and the contraction engine."""

from comera.tt.contract import low_rank_linear, ttm_split_linear
from comera.tt.cores import core_std, num_train_parameters, tt_core_shapes, tt_full, ttm_core_shapes, ttm_full
from comera.tt.costs import ORDERS, CostModel, choose_order, tt_order_costs, ttm_best_split, ttm_order_costs
from comera.tt.merge import merge_tt_left, merge_tt_right, merge_ttm_left, merge_ttm_right
from comera.tt.paths import tt_linear, ttm_linear
from comera.tt.recycle import OutputPool, configure_output_pool, output_pool
from comera.tt.shapes import auto_modes, auto_num_modes, factorize, max_ranks, resolve_ranks, suggest_padding
from comera.tt.svd import tt_svd, ttm_svd

__all__ = [
    "ORDERS",
    "CostModel",
    "OutputPool",
    "auto_modes",
    "auto_num_modes",
    "choose_order",
    "configure_output_pool",
    "core_std",
    "factorize",
    "low_rank_linear",
    "max_ranks",
    "merge_tt_left",
    "merge_tt_right",
    "merge_ttm_left",
    "merge_ttm_right",
    "num_train_parameters",
    "output_pool",
    "resolve_ranks",
    "suggest_padding",
    "tt_core_shapes",
    "tt_full",
    "tt_linear",
    "tt_order_costs",
    "tt_svd",
    "ttm_best_split",
    "ttm_core_shapes",
    "ttm_full",
    "ttm_linear",
    "ttm_order_costs",
    "ttm_split_linear",
    "ttm_svd",
]
