"""Batch-independent merges of consecutive cores into the two factors of the merge-first path, each walking
from the outer (small) end of a core group toward the middle bond; the TT merges also return every partial
product (``*_steps``) with a hand-written backward (``*_backward``), so
:func:`comera.tt.contract.tt_merge_linear` can recompute them backward. Details: docs/method.md section 5.

Index legend:
    a, c   ranks left / right of the core being absorbed
    i      row (input) mode of the core being absorbed; the TT mode for TT cores
    j      column (output) mode of a TTM core
    p, q   flattened rows / columns merged so far
    a      (joining two merged groups) the rank of the bond between them
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "fold_gates",
    "merge_tt_left",
    "merge_tt_left_steps",
    "merge_tt_left_backward",
    "merge_tt_right",
    "merge_tt_right_steps",
    "merge_tt_right_backward",
    "merge_ttm_left",
    "merge_ttm_matrix",
    "merge_ttm_right",
]


def fold_gates(cores: Sequence[torch.Tensor], gates: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The cores with gate ``k`` (shape ``(r_k,)``) scaling the right-rank (last) axis of core ``k``; cores
    past the last gate are returned as they are. Needs ``len(gates) < len(cores)``."""
    return [core * gates[k] if k < len(gates) else core for k, core in enumerate(cores)]


def merge_tt_left_steps(cores: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every partial product of :func:`merge_tt_left`: entry ``k`` is cores ``1..k+1`` merged, shape
    ``(n_1 * ... * n_{k+1}, r_{k+1})``; the last entry is ``L``."""
    merged = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])
    steps = [merged]
    for core in cores[1:]:
        merged = (merged @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[2])
        steps.append(merged)
    return steps


def merge_tt_left(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TT cores ``(r_{k-1}, n_k, r_k)``, k = 1..d, into ``L`` of shape ``(n_1 * ... * n_d, r_d)``, rows
    row-major over ``(n_1, ..., n_d)``; requires ``r_0 == 1``."""
    return merge_tt_left_steps(cores)[-1]


def merge_tt_left_backward(
    cores: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], grad: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of the ``cores`` given ``grad`` of ``L``, from the partial products ``steps`` of
    :func:`merge_tt_left_steps`. Step ``k`` computed ``P_k = P_{k-1} (p, a) @ G_k (a, i*c)``, so
    ``dG_k = P_{k-1}^T dP_k`` and ``dP_{k-1} = dP_k G_k^T``."""
    grads: list[torch.Tensor] = [grad] * len(cores)
    for k in range(len(cores) - 1, 0, -1):
        core, previous = cores[k], steps[k - 1]
        grad = grad.reshape(previous.shape[0], -1)
        grads[k] = (previous.t() @ grad).reshape(core.shape)
        grad = grad @ core.reshape(core.shape[0], -1).t()
    grads[0] = grad.reshape(cores[0].shape)
    return grads


def merge_tt_right_steps(cores: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every partial product of :func:`merge_tt_right`, from the last core inward: entry ``k`` is the last
    ``k + 1`` cores merged, shape ``(r, prod of their modes)``; the last entry is ``R``."""
    last = cores[-1]
    merged = last.reshape(last.shape[0], last.shape[1])
    steps = [merged]
    for core in reversed(cores[:-1]):
        merged = (core.reshape(-1, core.shape[2]) @ merged).reshape(core.shape[0], -1)
        steps.append(merged)
    return steps


def merge_tt_right(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TT cores k = d+1..K into ``R`` of shape ``(r_d, n_{d+1} * ... * n_K)``, columns row-major over
    ``(n_{d+1}, ..., n_K)``; requires ``r_K == 1``."""
    return merge_tt_right_steps(cores)[-1]


def merge_tt_right_backward(
    cores: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], grad: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of the ``cores`` given ``grad`` of ``R``, from the partial products ``steps`` of
    :func:`merge_tt_right_steps`. Absorbing core ``G`` computed ``P' = G (a*i, c) @ P (c, q)``, so
    ``dG = dP' P^T`` and ``dP = G^T dP'``."""
    grads: list[torch.Tensor] = [grad] * len(cores)
    for k in range(len(cores) - 1):
        core, previous = cores[k], steps[len(cores) - 2 - k]
        grad = grad.reshape(-1, previous.shape[1])
        grads[k] = (grad @ previous.t()).reshape(core.shape)
        grad = core.reshape(-1, core.shape[2]).t() @ grad
    grads[-1] = grad.reshape(cores[-1].shape)
    return grads


def merge_ttm_left(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TTM cores ``(r_{k-1}, m_k, n_k, r_k)``, k = 1..p, into ``A`` of shape ``(M_L, N_L, r_p)``
    (``M_L = m_1 * ... * m_p``, ``N_L = n_1 * ... * n_p``, row-major); requires ``r_0 == 1``."""
    merged = cores[0].reshape(cores[0].shape[1:])
    for core in cores[1:]:
        merged = torch.einsum("pqa,aijc->piqjc", merged, core)
        p, i, q, j, c = merged.shape
        merged = merged.reshape(p * i, q * j, c)
    return merged


def merge_ttm_right(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TTM cores k = p+1..d into ``C`` of shape ``(r_p, M_R, N_R)``; requires ``r_d == 1``."""
    last = cores[-1]
    merged = last.reshape(last.shape[:-1])
    for core in reversed(cores[:-1]):
        merged = torch.einsum("aijc,cpq->aipjq", core, merged)
        a, i, p, j, q = merged.shape
        merged = merged.reshape(a, i * p, j * q)
    return merged


def merge_ttm_matrix(cores: Sequence[torch.Tensor], split: int | None = None) -> torch.Tensor:
    """The TTM matrix ``(M, N)`` (``M = prod m_k``, ``N = prod n_k``, both row-major) of cores
    ``(r_{k-1}, m_k, n_k, r_k)``, built as the cores before bond ``split`` merged from the left
    (:func:`merge_ttm_left`), the cores after it merged from the right (:func:`merge_ttm_right`), and one
    product of the two over ``r_split``; ``split`` in ``[1, d]``, ``d`` (the default) being one
    left-to-right chain. Splitting at a middle bond keeps every merge small, so the whole matrix comes from
    one GEMM instead of a chain whose last steps are as large as the matrix.
    """
    split = len(cores) if split is None else split
    if not 1 <= split <= len(cores):
        raise ValueError(f"split must be in [1, {len(cores)}], got {split}")
    left = merge_ttm_left(cores[:split])
    if split == len(cores):
        return left.reshape(left.shape[0], left.shape[1])
    joined = torch.einsum("pqa,aij->piqj", left, merge_ttm_right(cores[split:]))
    rows_left, rows_right, cols_left, cols_right = joined.shape
    return joined.reshape(rows_left * rows_right, cols_left * cols_right)
