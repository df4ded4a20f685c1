"""The cost model that picks a contraction order (:data:`ORDERS`: ``"merge"``, ``"sequential"``, ``"dense"``)
for TT and TTM x activation from each order's list of matrix products (MACs, memory traffic, launches), on
Python ints only, memoised per call shape. Details: docs/method.md section 5, docs/internals.md, "The cost
model's assumptions"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "ORDERS",
    "Gemm",
    "Copy",
    "CostModel",
    "DEFAULT_COST_MODEL",
    "tt_order_kernels",
    "ttm_order_kernels",
    "tt_order_costs",
    "ttm_order_costs",
    "ttm_best_split",
    "choose_order",
    "CONTESTED_MARGIN",
    "contested_orders",
    "auto_tt_order",
    "auto_ttm_order",
    "ttm_merge_split",
    "ttm_rebuild_split",
    "auto_ttm_rebuild_split",
]

ORDERS = ("merge", "sequential", "dense")


@dataclass(frozen=True)
class Gemm:
    """One matrix product ``(rows x inner) @ (inner x cols)``, run ``count`` times (a batched product).

    Attributes:
        rows, inner, cols: the product's dimensions.
        count: how many such products one batched kernel runs (1 for a plain GEMM).
    """

    rows: int
    inner: int
    cols: int
    count: int = 1

    @property
    def macs(self) -> int:
        """Multiply-accumulates: ``count * rows * inner * cols``."""
        return self.count * self.rows * self.inner * self.cols

    @property
    def elements(self) -> int:
        """Elements read and written: both operands and the result, ``count`` times."""
        return self.count * (self.rows * self.inner + self.inner * self.cols + self.rows * self.cols)

    def backward(self) -> tuple[Gemm, Gemm]:
        """The two products of this one's backward: ``dA = dC B^T`` and ``dB = A^T dC``."""
        return (
            Gemm(self.rows, self.cols, self.inner, self.count),
            Gemm(self.inner, self.rows, self.cols, self.count),
        )


@dataclass(frozen=True)
class Copy:
    """A copy of ``size`` elements into a new layout (read once, written once).

    Attributes:
        size: elements copied.
    """

    size: int
    macs = 0

    @property
    def elements(self) -> int:
        """Elements read and written: ``2 * size``."""
        return 2 * self.size


Kernel = Gemm | Copy


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

    def kernels_time(self, kernels: Sequence[Kernel]) -> float:
        """Estimated microseconds of running ``kernels`` (:class:`Gemm` or :class:`Copy`), one launch each."""
        macs = sum(kernel.macs for kernel in kernels)
        elements = sum(kernel.elements for kernel in kernels)
        return self.time(macs, elements, len(kernels))


DEFAULT_COST_MODEL = CostModel()


def _full_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    return (1, *ranks, 1)


def _with_backward(gemms: list[Gemm], backward: bool) -> list[Gemm]:
    """``gemms`` followed, with ``backward``, by the two backward products of each."""
    if not backward:
        return list(gemms)
    return [*gemms, *(part for gemm in gemms for part in gemm.backward())]


def _einsum_copies(step_inputs: Sequence[int], backward: bool) -> list[Copy]:
    """Copies made by a chain of einsum steps (the sequential orders), given each step's input size; the rule
    is in docs/internals.md, "The cost model's assumptions"."""
    if len(step_inputs) < 2:
        return []
    copies = [Copy(size) for size in step_inputs]
    if backward:
        copies += copies + [Copy(size) for size in step_inputs[1:-1]]
    return copies


def _tt_left_merges(modes: Sequence[int], full: Sequence[int]) -> list[Gemm]:
    """Merging input cores 1..d from the left: step ``k`` is ``P (p, r_{k-1}) @ G_k (r_{k-1}, n_k r_k)``."""
    return [Gemm(math.prod(modes[:k]), full[k], modes[k] * full[k + 1]) for k in range(1, len(modes))]


def _tt_right_merges(modes: Sequence[int], full: Sequence[int]) -> list[Gemm]:
    """Merging output cores from the right (``modes`` and ``full`` start at the split bond): absorbing core
    ``k`` is ``G_k (r_{k-1} n_k, r_k) @ P (r_k, q)``, ``q`` the product of the modes after ``k``."""
    return [
        Gemm(full[k] * modes[k], full[k + 1], math.prod(modes[k + 1 :]))
        for k in range(len(modes) - 2, -1, -1)
    ]


def tt_order_kernels(
    batch: int, in_modes: Sequence[int], out_modes: Sequence[int], ranks: Sequence[int], backward: bool
) -> dict[str, list[Kernel]]:
    """The matrix products (and the sequential order's copies) each order runs for a TT layer, ``ranks`` the
    inner bond ranks; ``"merge"`` with ``backward`` lists its merges twice (they are recomputed backward)."""
    full = _full_ranks(ranks)
    d = len(in_modes)
    m, n, rank = math.prod(in_modes), math.prod(out_modes), full[d]
    merges = _tt_left_merges(in_modes, full) + _tt_right_merges(out_modes, full[d:])
    batched = [Gemm(batch, m, rank), Gemm(batch, rank, n)]
    recomputed = merges if backward else []
    kernels = {"merge": [*recomputed, *_with_backward(merges + batched, backward)]}

    sequential, step_inputs = [], []
    remaining = m
    for k, size in enumerate(in_modes):
        step_inputs.append(batch * full[k] * remaining)
        remaining //= size
        sequential.append(Gemm(batch * remaining, full[k] * size, full[k + 1]))
    produced = 1
    for k, size in enumerate(out_modes, start=d):
        sequential.append(Gemm(batch * produced, full[k], size * full[k + 1]))
        produced *= size
    kernels["sequential"] = _with_backward(sequential, backward) + _einsum_copies(step_inputs, backward)

    dense = [*merges, Gemm(m, rank, n), Gemm(batch, m, n)]
    kernels["dense"] = _with_backward(dense, backward)
    return kernels


def _ttm_left_merges(row_modes, col_modes, full) -> list[Gemm]:
    """Merging TTM cores from the left: absorbing core ``k`` is ``(p q, r_{k-1}) @ (r_{k-1}, m_k n_k r_k)``,
    ``p q`` the rows times columns merged so far."""
    gemms = []
    merged = row_modes[0] * col_modes[0]
    for k in range(1, len(row_modes)):
        gemms.append(Gemm(merged, full[k], row_modes[k] * col_modes[k] * full[k + 1]))
        merged *= row_modes[k] * col_modes[k]
    return gemms


def _ttm_right_merges(row_modes, col_modes, full) -> list[Gemm]:
    """Merging TTM cores from the right (``full`` starts at the split bond): absorbing core ``k`` is
    ``(r_{k-1} m_k n_k, r_k) @ (r_k, p q)``."""
    gemms = []
    merged = row_modes[-1] * col_modes[-1]
    for k in range(len(row_modes) - 2, -1, -1):
        gemms.append(Gemm(full[k] * row_modes[k] * col_modes[k], full[k + 1], merged))
        merged *= row_modes[k] * col_modes[k]
    return gemms


def _ttm_rebuild_merges(row_modes, col_modes, full, split) -> list[Gemm]:
    """The products that rebuild a TTM matrix split at bond ``split`` (in ``[1, d]``; see
    :func:`comera.tt.merge.merge_ttm_matrix`): the left group's merges, the right group's, and their join
    ``(M_L N_L, r_split) @ (r_split, M_R N_R)``; ``split == d`` is one left-to-right chain."""
    if split == len(row_modes):
        return _ttm_left_merges(row_modes, col_modes, full)
    left_size = math.prod(row_modes[:split]) * math.prod(col_modes[:split])
    right_size = math.prod(row_modes[split:]) * math.prod(col_modes[split:])
    return [
        *_ttm_left_merges(row_modes[:split], col_modes[:split], full[: split + 1]),
        *_ttm_right_merges(row_modes[split:], col_modes[split:], full[split:]),
        Gemm(left_size, full[split], right_size),
    ]


def ttm_rebuild_split(
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    model: CostModel = DEFAULT_COST_MODEL,
) -> int:
    """The bond (``1..d``, ``d``: one chain) at which rebuilding a TTM matrix is cheapest under ``model``
    (independent of the batch)."""
    full = _full_ranks(ranks)
    costs = {
        split: model.kernels_time(_ttm_rebuild_merges(row_modes, col_modes, full, split))
        for split in range(len(row_modes), 0, -1)
    }
    return min(costs, key=costs.get)


def _ttm_split_kernels(batch, row_modes, col_modes, full, split, backward) -> list[Gemm]:
    """The merge order split at bond ``split`` (see :func:`comera.tt.contract.ttm_split_linear`)."""
    rows_left, rows_right = math.prod(row_modes[:split]), math.prod(row_modes[split:])
    cols_left, cols_right = math.prod(col_modes[:split]), math.prod(col_modes[split:])
    rank = full[split]
    merges = _ttm_left_merges(row_modes[:split], col_modes[:split], full[: split + 1])
    merges += _ttm_right_merges(row_modes[split:], col_modes[split:], full[split:])
    first = Gemm(batch * rows_left, rows_right, rank * cols_right)
    second = Gemm(cols_left, rows_left * rank, cols_right, count=batch)
    gemms = _with_backward([*merges, first], backward)
    if not backward:
        return [*gemms, second]
    # dA of the batched product sums over the batch in one GEMM: (N_L, B N_R) @ (B N_R, M_L r)
    summed = Gemm(cols_left, batch * cols_right, rows_left * rank)
    return [*gemms, second, summed, Gemm(rows_left * rank, cols_left, cols_right, count=batch)]


def _ttm_unsplit_kernels(batch, row_modes, col_modes, full, backward) -> dict[str, list[Kernel]]:
    """The kernels of the TTM orders that do not split the train: ``"sequential"`` and ``"dense"``."""
    sequential, step_inputs = [], []
    produced, remaining = 1, math.prod(row_modes)
    for k, (i, j) in enumerate(zip(row_modes, col_modes)):
        step_inputs.append(batch * produced * full[k] * remaining)
        remaining //= i
        sequential.append(Gemm(batch * produced * remaining, full[k] * i, j * full[k + 1]))
        produced *= j
    split = auto_ttm_rebuild_split(tuple(row_modes), tuple(col_modes), tuple(full[1:-1]))
    dense = [
        *_ttm_rebuild_merges(row_modes, col_modes, full, split),
        Gemm(batch, math.prod(row_modes), produced),
    ]
    return {
        "sequential": _with_backward(sequential, backward) + _einsum_copies(step_inputs, backward),
        "dense": _with_backward(dense, backward),
    }


def ttm_order_kernels(
    batch: int,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    split: int | None = None,
) -> dict[str, list[Kernel]]:
    """The matrix products (and the sequential order's copies) each order runs for a TTM layer;
    ``"merge"`` (at bond ``split``, default the middle) only for two or more cores."""
    full = _full_ranks(ranks)
    cores = len(row_modes)
    kernels: dict[str, list[Kernel]] = {}
    if cores > 1:
        split = cores // 2 if split is None else split
        if not 1 <= split < cores:
            raise ValueError(f"split must be in [1, {cores - 1}], got {split}")
        kernels["merge"] = _ttm_split_kernels(batch, row_modes, col_modes, full, split, backward)
    return {**kernels, **_ttm_unsplit_kernels(batch, row_modes, col_modes, full, backward)}


def tt_order_costs(
    batch: int,
    in_modes: Sequence[int],
    out_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    model: CostModel = DEFAULT_COST_MODEL,
) -> dict[str, float]:
    """Estimated microseconds of each order for a TT layer; ``ranks`` are the inner bond ranks."""
    kernels = tt_order_kernels(batch, in_modes, out_modes, ranks, backward)
    return {order: model.kernels_time(listed) for order, listed in kernels.items()}


def ttm_best_split(
    batch: int,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    model: CostModel = DEFAULT_COST_MODEL,
) -> tuple[int, float]:
    """Cheapest bond ``p`` (1..d-1) at which to split a TTM layer, and its estimated microseconds."""
    if len(row_modes) < 2:
        raise ValueError(f"a TTM split needs at least 2 cores, got {len(row_modes)}")
    full = _full_ranks(ranks)
    costs = {
        split: model.kernels_time(_ttm_split_kernels(batch, row_modes, col_modes, full, split, backward))
        for split in range(1, len(row_modes))
    }
    best = min(costs, key=costs.get)
    return best, costs[best]


def ttm_order_costs(
    batch: int,
    row_modes: Sequence[int],
    col_modes: Sequence[int],
    ranks: Sequence[int],
    backward: bool,
    model: CostModel = DEFAULT_COST_MODEL,
) -> dict[str, float]:
    """Estimated microseconds of each order for a TTM layer (``merge`` at its best split)."""
    kernels = _ttm_unsplit_kernels(batch, row_modes, col_modes, _full_ranks(ranks), backward)
    costs = {order: model.kernels_time(listed) for order, listed in kernels.items()}
    if len(row_modes) > 1:
        costs["merge"] = ttm_best_split(batch, row_modes, col_modes, ranks, backward, model)[1]
    return costs


CONTESTED_MARGIN = 4.0
"""Orders estimated at most this many times slower than the cheapest are measured by autotuning
(:func:`contested_orders`): the estimate's machine constants come from one CPU, and overheads it does not
model dominate small calls."""


def contested_orders(costs: dict[str, float], margin: float = CONTESTED_MARGIN) -> tuple[str, ...]:
    """The orders of ``costs`` whose estimate is within ``margin`` times the cheapest, in :data:`ORDERS`
    order: the ones the estimate cannot tell apart on an unknown machine."""
    if not costs:
        raise ValueError(f"costs must name at least one of {ORDERS}, got none")
    cheapest = min(costs.values())
    return tuple(name for name in ORDERS if name in costs and costs[name] <= margin * cheapest)


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


_MEMOISED = {
    function: lru_cache(maxsize=4096)(function)
    for function in (_tt_order, _ttm_order, _ttm_split, ttm_rebuild_split)
}


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


def auto_ttm_rebuild_split(
    row_modes: tuple[int, ...], col_modes: tuple[int, ...], ranks: tuple[int, ...]
) -> int:
    """:func:`ttm_rebuild_split` under the default cost model (memoised)."""
    return _memoised(ttm_rebuild_split, row_modes, col_modes, ranks)


def ttm_merge_split(
    batch: int, row_modes: tuple[int, ...], col_modes: tuple[int, ...], ranks: tuple[int, ...], backward: bool
) -> int | None:
    """The bond at which the ``"merge"`` order splits a TTM layer call (None for a single core; memoised)."""
    return _memoised(_ttm_split, batch, row_modes, col_modes, ranks, backward)
