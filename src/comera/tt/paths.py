"""Contraction orders for TT x activation and TTM x activation, and the cost model that picks one.

Three orders compute the same ``y = x W + b`` (``W`` is ``in x out``, folded row-major, input modes first):

- ``"merge"``: merge-first (docs/method.md section 5). Batch-independent merges of each core group, then the
  batch-sized GEMMs of :mod:`comera.tt.contract`. Best once the batch is larger than the ranks.
- ``"sequential"``: contract the activation with one core at a time (plain autograd). Avoids the merges,
  which can win for a handful of rows.
- ``"dense"``: rebuild ``W`` and do one GEMM. Wins only when the ranks are close to full.

The cost model estimates the wall time of forward (and backward when gradients are needed) from
multiply-accumulates, memory traffic and a per-kernel launch overhead. Its inputs are Python ints (shapes and
ranks), so choosing an order never syncs with the device and is a trace-time constant under
``torch.compile``.

Index legend (einsum strings):
    b      batch rows
    a, c   ranks on the left / right of the core being absorbed
    i      input mode of the core being absorbed; j its output mode (TTM)
    p      flattened output modes produced so far
    q      flattened input modes not yet absorbed
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from comera.tt.contract import low_rank_linear, ttm_split_linear
from comera.tt.fp8 import fp8_low_rank_linear
from comera.tt.merge import merge_tt_left, merge_tt_right, merge_ttm_left, merge_ttm_right

__all__ = [
    "ORDERS",
    "GEMMS",
    "CostModel",
    "DEFAULT_COST_MODEL",
    "tt_order_costs",
    "ttm_order_costs",
    "ttm_best_split",
    "choose_order",
    "auto_tt_order",
    "auto_ttm_order",
    "ttm_merge_split",
    "tt_linear",
    "ttm_linear",
]

ORDERS = ("merge", "sequential", "dense")
GEMMS = ("fp32", "fp8")
"""Number formats of the merge order's batch-sized GEMMs: the input dtype, or FP8 with per-tensor scales
(:mod:`comera.tt.fp8`). The other orders always run in the input dtype."""


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
    costs["merge"] = model.time(
        grad_factor * (merge_macs + batch_macs),
        traffic_factor * (merge_elements + batch_elements),
        grad_factor * (merge_ops + 2),
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


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _tt_sequential(x, cores, num_in_cores, out_features):
    batch, remaining = x.shape
    state = x.reshape(batch, 1, remaining)
    for core in cores[:num_in_cores]:
        rank_in, size, rank_out = core.shape
        remaining //= size
        state = torch.einsum("baiq,aic->bcq", state.reshape(batch, rank_in, size, remaining), core)
    produced = 1
    for core in cores[num_in_cores:]:
        rank_in, size, rank_out = core.shape
        state = state.reshape(batch * produced, rank_in) @ core.reshape(rank_in, size * rank_out)
        produced *= size
    return state.reshape(batch, produced)[:, :out_features]


def tt_linear(
    x: torch.Tensor,
    cores: Sequence[torch.Tensor],
    num_in_cores: int,
    out_features: int,
    bias: torch.Tensor | None,
    order: str = "merge",
    gemm: str = "fp32",
) -> torch.Tensor:
    """``x @ W + bias`` for a TT-folded weight ``W`` (input modes on the first ``num_in_cores`` cores).

    Args:
        x: ``(B, in_features)``; ``in_features`` may be smaller than the product of the input modes, in which
            case the missing (padded) input entries are zero.
        cores: TT cores ``(r_{k-1}, n_k, r_k)``, gates already folded in.
        num_in_cores: how many leading cores carry input modes (``1 <= d < len(cores)``).
        out_features: output columns kept (the product of the output modes may be larger).
        bias: ``(out_features,)`` or None.
        order: one of :data:`ORDERS`.
        gemm: one of :data:`GEMMS`; ``"fp8"`` affects the ``"merge"`` order only.

    Returns:
        ``(B, out_features)``.
    """
    _check_order(order)
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    in_features = x.shape[1]
    if order == "merge":
        left = merge_tt_left(cores[:num_in_cores])[:in_features]
        right = merge_tt_right(cores[num_in_cores:])[:, :out_features]
        product = fp8_low_rank_linear if gemm == "fp8" else low_rank_linear
        return product(x, left, right, bias)
    if order == "sequential":
        padded = _pad_columns(x, math.prod([c.shape[1] for c in cores[:num_in_cores]]))
        return _add_bias(_tt_sequential(padded, cores, num_in_cores, out_features), bias)
    weight = merge_tt_left(cores[:num_in_cores])[:in_features] @ merge_tt_right(cores[num_in_cores:])
    weight = weight[:, :out_features]
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


def _ttm_sequential(x, cores, out_features):
    batch, remaining = x.shape
    produced = 1
    state = x.reshape(batch, 1, 1, remaining)
    for core in cores:
        rank_in, rows, cols, rank_out = core.shape
        remaining //= rows
        state = state.reshape(batch, produced, rank_in, rows, remaining)
        state = torch.einsum("bpaiq,aijc->bpjcq", state, core)
        produced *= cols
    return state.reshape(batch, produced)[:, :out_features]


def ttm_linear(
    x: torch.Tensor,
    cores: Sequence[torch.Tensor],
    out_features: int,
    bias: torch.Tensor | None,
    order: str = "merge",
    split: int | None = None,
) -> torch.Tensor:
    """``x @ W + bias`` for a TTM weight ``W`` whose cores ``(r_{k-1}, m_k, n_k, r_k)`` have gates folded in.

    Args:
        x: ``(B, in_features)`` with ``in_features <= prod(m_k)`` (missing entries are zero padding).
        cores: TTM cores.
        out_features: output columns kept (``<= prod(n_k)``).
        bias: ``(out_features,)`` or None.
        order: one of :data:`ORDERS`; ``"merge"`` needs at least two cores (one core is a dense matrix).
        split: bond at which ``"merge"`` splits the train (default: the middle).

    Returns:
        ``(B, out_features)``.
    """
    _check_order(order)
    if order == "merge" and len(cores) == 1:
        order = "dense"
    rows = math.prod([c.shape[1] for c in cores])
    cols = math.prod([c.shape[2] for c in cores])
    if order == "merge":
        split = len(cores) // 2 if split is None else split
        if not 1 <= split < len(cores):
            raise ValueError(f"split must be in [1, {len(cores) - 1}], got {split}")
        left = merge_ttm_left(cores[:split])
        right = merge_ttm_right(cores[split:])
        padded_bias = bias
        if bias is not None and out_features < cols:
            padded_bias = torch.nn.functional.pad(bias, (0, cols - out_features))
        y = ttm_split_linear(_pad_columns(x, rows), left, right, padded_bias)
        return y[:, :out_features]
    if order == "sequential":
        return _add_bias(_ttm_sequential(_pad_columns(x, rows), cores, out_features), bias)
    weight = merge_ttm_left(cores).reshape(rows, cols)[: x.shape[1], :out_features]
    return x @ weight if bias is None else torch.addmm(bias, x, weight)
