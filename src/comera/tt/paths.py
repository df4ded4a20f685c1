"""Contraction orders for TT x activation and TTM x activation: the code that runs the order
:mod:`comera.tt.costs` chose or :mod:`comera.tt.autotune` measured (``"merge"``, ``"sequential"``,
``"dense"``, and for TT :data:`FACTORS`, the merge order by plain autograd), all computing ``y = x W + b``
with ``W`` ``in x out``. Details: docs/method.md section 5.

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

import torch

from comera.tt.contract import tt_merge_linear, ttm_split_linear
from comera.tt.costs import ORDERS, auto_ttm_rebuild_split
from comera.tt.fp8 import fp8_low_rank_linear
from comera.tt.merge import (
    fold_gates,
    merge_tt_left,
    merge_tt_right,
    merge_ttm_left,
    merge_ttm_matrix,
    merge_ttm_right,
)
from comera.tt.padded import padded_rows_linear
from comera.tt.workspace import Workspace

__all__ = ["FACTORS", "GEMMS", "tt_linear", "ttm_linear"]

FACTORS = "factors"
"""The ``"merge"`` order of a TT layer in its small-batch form: ``L`` and ``R`` merged from the gated cores
by differentiable products, then ``(X L) R + b`` by plain differentiable GEMMs (:func:`_factor_product`),
autograd doing the whole backward. It runs the same products as the merge-first custom function
(:func:`comera.tt.contract.tt_merge_linear`) but none of its batch-sized savings (fused bias gradient,
blocked GEMMs, oneDNN, recycled outputs, merges done again in the backward instead of kept), so it can win
for small batches, where per-call overhead dominates; the cost model does not tell the two apart, so only
autotuning picks it."""

GEMMS = ("fp32", "fp8")
"""Number formats of the merge order's batch-sized GEMMs: the input dtype, or FP8 with per-tensor scales
(:mod:`comera.tt.fp8`). The other orders always run in the input dtype."""


def _check_order(order: str, extra: tuple[str, ...] = ()) -> None:
    if order not in ORDERS + extra:
        raise ValueError(f"order must be one of {ORDERS + extra}, got {order!r}")


def _pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _first_rows(matrix: torch.Tensor, rows: int) -> torch.Tensor:
    """``matrix[:rows]``, or ``matrix`` itself where it has no more rows: no view (and no autograd node)
    is made for the usual unpadded layer, which counts for small batches, where per-op overhead dominates."""
    return matrix if matrix.shape[0] == rows else matrix[:rows]


def _first_columns(matrix: torch.Tensor, columns: int) -> torch.Tensor:
    """``matrix[:, :columns]``, or ``matrix`` itself where it has no more columns (:func:`_first_rows`)."""
    return matrix if matrix.shape[1] == columns else matrix[:, :columns]


def _pin_output(y: torch.Tensor, column: int | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``y`` with ``column`` replaced by the bias alone (zeros without one); ``y`` itself for None."""
    if column is None:
        return y
    index = torch.tensor([column], device=y.device)
    filler = y.new_zeros(y.shape[0], 1) if bias is None else bias[index].expand(y.shape[0], 1)
    return y.index_copy(1, index, filler.to(y.dtype))


def _factor_product(x, left, right, bias):
    """``(x @ left) @ right + bias`` by plain differentiable GEMMs, ``x @ left`` computed as
    ``(left^T x^T)^T``: a GEMM with a thin (rank-wide) output runs slower on CPU BLAS than the same product
    transposed. Custom autograd functions that also ran the backward's thin products transposed were
    measured and dropped: at ``B = 128`` (AMD EPYC, 2 threads, the three paper shapes, rank 30) a Python
    backward costs more than those products save, most of all when the caches are cold, as they are in a
    model between two calls of one layer; this form was 6-18 % faster than the published layer there, the
    custom functions 0.92-1.01x."""
    inner = (left.t() @ x.t()).t()
    return inner @ right if bias is None else torch.addmm(bias, inner, right)


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
    workspace: Workspace | None = None,
    gates: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``x @ W + bias`` for a TT-folded weight ``W`` (input modes on the first ``num_in_cores`` cores).

    Args:
        x: ``(B, in_features)``; ``in_features`` may be smaller than the product of the input modes, in which
            case the missing (padded) input entries are zero.
        cores: TT cores ``(r_{k-1}, n_k, r_k)``.
        num_in_cores: how many leading cores carry input modes (``1 <= d < len(cores)``).
        out_features: output columns kept (the product of the output modes may be larger).
        bias: ``(out_features,)`` or None.
        order: one of :data:`ORDERS`, or :data:`FACTORS`.
        gemm: one of :data:`GEMMS`; ``"fp8"`` affects the ``"merge"`` order only.
        workspace: scratch buffers of the ``"merge"`` order's backward, reused across calls.
        gates: at most ``len(cores) - 1`` bond gates; gate ``k`` scales the right-rank axis of core ``k``
            (the fp32 ``"merge"`` order folds them in itself, see :func:`comera.tt.contract.tt_merge_linear`).

    Returns:
        ``(B, out_features)``.
    """
    _check_order(order, (FACTORS,))
    if gemm not in GEMMS:
        raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
    in_features = x.shape[1]
    if order == "merge" and gemm == "fp32":
        return tt_merge_linear(x, cores, num_in_cores, out_features, bias, workspace, gates)
    cores = fold_gates(cores, gates)
    if order in (FACTORS, "merge"):
        left = _first_rows(merge_tt_left(cores[:num_in_cores]), in_features)
        right = _first_columns(merge_tt_right(cores[num_in_cores:]), out_features)
        if order == "merge":
            return fp8_low_rank_linear(x, left, right, bias)
        return _factor_product(x, left, right, bias)
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
    workspace: Workspace | None = None,
    zero_output: int | None = None,
) -> torch.Tensor:
    """``x @ W + bias`` for a TTM weight ``W`` whose cores ``(r_{k-1}, m_k, n_k, r_k)`` have gates folded in.

    Args:
        x: ``(B, in_features)`` with ``in_features <= prod(m_k)`` (missing entries are zero padding).
        cores: TTM cores.
        out_features: output columns kept (``<= prod(n_k)``).
        bias: ``(out_features,)`` or None.
        order: one of :data:`ORDERS`; ``"merge"`` needs at least two cores (one core is a dense matrix).
        split: bond at which ``"merge"`` splits the train (default: the middle).
        workspace: scratch buffers of the ``"merge"`` order's backward, reused across calls.
        zero_output: an output column in ``[0, out_features)`` computed as if its column of ``W`` were zero
            (the bias alone; a tied head's padding token), its column getting no gradient; None for none.

    Returns:
        ``(B, out_features)``.
    """
    _check_order(order)
    if zero_output is not None and not 0 <= zero_output < out_features:
        raise ValueError(f"zero_output must be in [0, {out_features - 1}] or None, got {zero_output}")
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
        y = ttm_split_linear(_pad_columns(x, rows), left, right, padded_bias, workspace)
        return _pin_output(y[:, :out_features], zero_output, bias)
    if order == "sequential":
        y = _add_bias(_ttm_sequential(_pad_columns(x, rows), cores, out_features), bias)
        return _pin_output(y, zero_output, bias)
    split = auto_ttm_rebuild_split(
        tuple(c.shape[1] for c in cores),
        tuple(c.shape[2] for c in cores),
        tuple(c.shape[3] for c in cores[:-1]),
    )
    # W^T (out x in), nn.Linear's layout: its gradient is then dY^T X, whose output is the long side first;
    # X^T dY into an (in x out) matrix ran 5x slower for a (768 x 50274) tied vocabulary head
    weight = merge_ttm_matrix([core.transpose(1, 2) for core in cores], split)
    if x.shape[1] < rows:  # a full-range slice would still cost a weight-sized fill and copy in backward
        weight = weight[:, : x.shape[1]]
    # plain ops under autocast (dtype handling) and under torch.compile: with the custom function inside, a
    # compiled Trainer step crossing a prune failed in backward with stale shapes (in the full test suite,
    # not alone), and the compiler fuses the slicing anyway
    if not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling():
        return padded_rows_linear(x, weight, bias, out_features, zero_output)
    if out_features < cols:
        weight = weight[:out_features]
    return _pin_output(torch.nn.functional.linear(x, weight, bias), zero_output, bias)
