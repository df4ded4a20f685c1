"""The cost model that picks a contraction order for TT x activation and TTM x activation.

The orders (:data:`ORDERS`, computed by :mod:`comera.tt.paths`) compute the same ``y = x W + b``:
``"merge"`` (merge each core group once, then the batch-sized GEMMs), ``"sequential"`` (one core at a time)
and ``"dense"`` (rebuild ``W``, one GEMM). The model estimates the wall time of forward (and backward when
gradients are needed) from multiply-accumulates, memory traffic and a per-kernel launch overhead. Its inputs
are Python ints (shapes and ranks), so choosing an order never syncs with the device and is a trace-time
constant under ``torch.compile``; choices are memoised per distinct call shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "ORDERS",
    "CostModel",
    "DEFAULT_COST_MODEL",
    "tt_order_costs",
    "ttm_order_costs",
    "ttm_best_split",
    "choose_order",
    "auto_tt_order",
    "auto_ttm_order",
    "ttm_merge_split",
]

ORDERS = ("merge", "sequential", "dense")


@dataclass(frozen=True)
class CostModel:
    """Machine constants of the cost model (defaults measured on a 2-core AVX2 CPU, fp32).

    Attributes:
        macs_per_us: sustained multiply-accumulates per microsecond of a large GEMM.
        elements_per_us: fp32 elements per microsecond of memory traffic (reads plus writes).
        launch_us: fixed cost of one kernel / op, in microseconds.
    """

    macs_per_us: float = 40_000.0
    elements_per_us: float = 1_500.0
    launch_us: float = 8.0

    def time(self, macs: float, elements: float, ops: int) -> float:
        """Estimated microseconds of ``ops`` kernels doing ``macs`` MACs over ``elements`` of traffic."""
        return macs / self.macs_per_us + elements / self.elements_per_us + ops * self.launch_us


DEFAULT_COST_MODEL = CostModel()
_EINSUM_OPS = 3
"""Kernels one input-side step of the sequential order launches (permute copy, batched GEMM, reshape copy)."""


_MERGE_RECOMPUTE_FACTOR = 4
"""Passes over the TT merges in a training step of the merge order: forward, the backward's recomputation
(:func:`comera.tt.contract.tt_merge_linear` keeps no merged factor) and the two GEMMs of their backward."""


def _full_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    return (1, *ranks, 1)


def _tt_merge_work(modes: Sequence[int], ranks: Sequence[int], from_left: bool) -> tuple[int, int, int]:
    """MACs, traffic and op count of merging TT cores with ``modes`` and full boundary ``ranks``."""
    macs = elements = 0
    sizes = list(zip(modes, ranks[:-1], ranks[1:]))
    if not from_left:
        sizes = [(n, right, left) for n, left, right in reversed(sizes)]
    merged_rows = sizes[0][0]
    for n, left_rank, right_rank in sizes[1:]:
        macs += merged_rows * left_rank * n * right_rank
        merged_rows *= n
        elements += merged_rows * right_rank + n * left_rank * right_rank
    return macs, elements, max(len(sizes) - 1, 0)


def tt_order_costs(
    batch: int,
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    model: CostModel = DEFAULT_COST_MODEL,
) -> dict[str, float]:
    """Estimated microseconds of each order for a TT layer; ``ranks`` are the inner bond ranks."""
    full = _full_ranks(ranks)
    d = len(in_modes)
    m, n, mid = math.prod(in_modes), math.prod(out_modes), full[d]
    grad_factor = 3 if backward else 1
    traffic_factor = 3 if backward else 1

    left = _tt_merge_work(in_modes, full[: d + 1], from_left=True)
    right = _tt_merge_work(out_modes, full[d:], from_left=False)
    merge_macs = left[0] + right[0]
    merge_elements = left[1] + right[1]
    merge_ops = left[2] + right[2]

    costs: dict[str, float] = {}
    batch_macs = batch * mid * (m + n)
    batch_elements = batch * (m + n + 2 * mid)
    merge_factor = _MERGE_RECOMPUTE_FACTOR if backward else 1
    costs["merge"] = model.time(
        merge_factor * merge_macs + grad_factor * batch_macs,
        merge_factor * merge_elements + traffic_factor * batch_elements,
        merge_factor * merge_ops + grad_factor * 2,
    )

    seq_macs = seq_elements = 0
    remaining = m
    for k, size in enumerate(in_modes):
        remaining //= size
        seq_macs += batch * full[k] * size * full[k + 1] * remaining
        seq_elements += 2 * batch * (full[k] * size * remaining + full[k + 1] * remaining)
    produced = 1
    for k, size in enumerate(out_modes, start=d):
        seq_macs += batch * produced * full[k] * size * full[k + 1]
        produced *= size
        seq_elements += batch * produced * full[k + 1] + batch * (produced // size) * full[k]
    seq_ops = _EINSUM_OPS * d + len(out_modes)
    costs["sequential"] = model.time(
        grad_factor * seq_macs, traffic_factor * seq_elements, grad_factor * seq_ops
    )

    dense_macs = merge_macs + m * mid * n + batch * m * n
    dense_elements = merge_elements + 2 * m * n + batch * (m + n)
    costs["dense"] = model.time(
        grad_factor * dense_macs, traffic_factor * dense_elements, grad_factor * (merge_ops + 2)
    )
    return costs


def _ttm_half_work(row_modes, col_modes, ranks, from_left: bool) -> tuple[int, int, int]:
    sizes = list(zip(row_modes, col_modes, ranks[:-1], ranks[1:]))
    if not from_left:
        sizes = [(i, j, right, left) for i, j, left, right in reversed(sizes)]
    macs = elements = 0
    merged = sizes[0][0] * sizes[0][1]
    for i, j, left_rank, right_rank in sizes[1:]:
        macs += merged * left_rank * i * j * right_rank
        merged *= i * j
        elements += 2 * merged * right_rank
    return macs, elements, 2 * max(len(sizes) - 1, 0)


def _ttm_split_cost(batch, row_modes, col_modes, full, split, grad_factor, traffic_factor, model):
    rows_left, rows_right = math.prod(row_modes[:split]), math.prod(row_modes[split:])
    cols_left, cols_right = math.prod(col_modes[:split]), math.prod(col_modes[split:])
    rank = full[split]
    left = _ttm_half_work(row_modes[:split], col_modes[:split], full[: split + 1], from_left=True)
    right = _ttm_half_work(row_modes[split:], col_modes[split:], full[split:], from_left=False)
    inner = batch * rows_left * rank * cols_right
    macs = left[0] + right[0] + inner * (rows_right + cols_left)
    elements = left[1] + right[1] + batch * (rows_left * rows_right + cols_left * cols_right) + 2 * inner
    ops = left[2] + right[2] + 4
    return model.time(grad_factor * macs, traffic_factor * elements, grad_factor * ops)


def ttm_best_split(
    batch: int,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    model: CostModel = DEFAULT_COST_MODEL,
) -> tuple[int, float]:
    """Cheapest bond ``p`` (1..d-1) at which to split a TTM layer, and its estimated microseconds."""
    full = _full_ranks(ranks)
    factor = 3 if backward else 1
    best = None
    for split in range(1, len(row_modes)):
        cost = _ttm_split_cost(batch, row_modes, col_modes, full, split, factor, factor, model)
        if best is None or cost < best[1]:
            best = (split, cost)
    if best is None:
        raise ValueError(f"a TTM split needs at least 2 cores, got {len(row_modes)}")
    return best


def ttm_order_costs(
    batch: int,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    model: CostModel = DEFAULT_COST_MODEL,
) -> dict[str, float]:
    """Estimated microseconds of each order for a TTM layer (``merge`` at its best split)."""
    full = _full_ranks(ranks)
    factor = 3 if backward else 1
    m, n = math.prod(row_modes), math.prod(col_modes)
    costs: dict[str, float] = {}
    if len(row_modes) > 1:
        costs["merge"] = ttm_best_split(batch, row_modes, col_modes, ranks, backward, model)[1]

    seq_macs = seq_elements = 0
    produced, remaining = 1, m
    for k, (i, j) in enumerate(zip(row_modes, col_modes)):
        remaining //= i
        seq_macs += batch * produced * full[k] * i * j * full[k + 1] * remaining
        before = batch * produced * full[k] * i * remaining
        produced *= j
        seq_elements += 3 * (before + batch * produced * full[k + 1] * remaining)
    costs["sequential"] = model.time(factor * seq_macs, factor * seq_elements, factor * 2 * len(row_modes))

    whole = _ttm_half_work(row_modes, col_modes, full, from_left=True)
    dense_macs = whole[0] + batch * m * n
    dense_elements = whole[1] + 2 * m * n + batch * (m + n)
    costs["dense"] = model.time(factor * dense_macs, factor * dense_elements, factor * (whole[2] + 2))
    return costs


def choose_order(costs: dict[str, float]) -> str:
    """The order with the smallest estimated cost (ties broken by the order of :data:`ORDERS`)."""
    best = None
    for name in ORDERS:
        if name in costs and (best is None or costs[name] < costs[best]):
            best = name
    if best is None:
        raise ValueError(f"costs must name at least one of {ORDERS}, got {sorted(costs)}")
    return best


def _tt_order(batch, in_modes, out_modes, ranks, backward) -> str:
    return choose_order(tt_order_costs(batch, in_modes, out_modes, ranks, backward))


def _ttm_order(batch, row_modes, col_modes, ranks, backward) -> str:
    return choose_order(ttm_order_costs(batch, row_modes, col_modes, ranks, backward))


def _ttm_split(batch, row_modes, col_modes, ranks, backward) -> int | None:
    if len(row_modes) < 2:
        return None
    return ttm_best_split(batch, row_modes, col_modes, ranks, backward)[0]


_MEMOISED = {function: lru_cache(maxsize=4096)(function) for function in (_tt_order, _ttm_order, _ttm_split)}


def _memoised(function, *args):
    """``function(*args)`` through its cache in eager mode; traced directly under ``torch.compile``."""
    return function(*args) if torch.compiler.is_compiling() else _MEMOISED[function](*args)


def auto_tt_order(
    batch: int, in_modes: tuple[int, ...], out_modes: tuple[int, ...], ranks: tuple[int, ...], backward: bool
) -> str:
    """The cheapest order for a TT layer call (memoised: the cost model runs once per distinct call shape)."""
    return _memoised(_tt_order, batch, in_modes, out_modes, ranks, backward)


def auto_ttm_order(
    batch: int, row_modes: tuple[int, ...], col_modes: tuple[int, ...], ranks: tuple[int, ...], backward: bool
) -> str:
    """The cheapest order for a TTM layer call (memoised)."""
    return _memoised(_ttm_order, batch, row_modes, col_modes, ranks, backward)


def ttm_merge_split(
    batch: int, row_modes: tuple[int, ...], col_modes: tuple[int, ...], ranks: tuple[int, ...], backward: bool
) -> int | None:
    """The bond at which the ``"merge"`` order splits a TTM layer call (None for a single core; memoised)."""
    return _memoised(_ttm_split, batch, row_modes, col_modes, ranks, backward)
