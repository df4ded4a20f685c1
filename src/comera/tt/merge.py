"""Batch-independent merges of consecutive cores into the two factors used by the merge-first path.

Every merge walks from the outer end of a core group toward the middle bond, so the running product stays
as small as possible (outer modes are the small ones, see :func:`comera.tt.shapes.auto_modes`). These are
plain differentiable torch ops: autograd keeps the partial merges it needs, so per-core gradients come from
saved partial products and nothing is recomputed in the backward pass.

Index legend:
    a, c   ranks left / right of the core being absorbed
    i      row (input) mode of the core being absorbed; the TT mode for TT cores
    j      column (output) mode of a TTM core
    p, q   flattened rows / columns merged so far
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["merge_tt_left", "merge_tt_right", "merge_ttm_left", "merge_ttm_right"]


def merge_tt_left(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TT cores ``(r_{k-1}, n_k, r_k)``, k = 1..d, into ``L`` of shape ``(n_1 * ... * n_d, r_d)``.

    Rows of ``L`` unravel row-major over ``(n_1, ..., n_d)``; requires ``r_0 == 1``.
    """
    merged = cores[0].reshape(cores[0].shape[1], cores[0].shape[2])
    for core in cores[1:]:
        merged = (merged @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[2])
    return merged


def merge_tt_right(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TT cores k = d+1..K into ``R`` of shape ``(r_d, n_{d+1} * ... * n_K)``; requires ``r_K == 1``.

    Columns of ``R`` unravel row-major over ``(n_{d+1}, ..., n_K)``.
    """
    last = cores[-1]
    merged = last.reshape(last.shape[0], last.shape[1])
    for core in reversed(cores[:-1]):
        merged = (core.reshape(-1, core.shape[2]) @ merged).reshape(core.shape[0], -1)
    return merged


def merge_ttm_left(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge TTM cores ``(r_{k-1}, m_k, n_k, r_k)``, k = 1..p, into ``A`` of shape ``(M_L, N_L, r_p)``.

    ``M_L = m_1 * ... * m_p`` and ``N_L = n_1 * ... * n_p``, both unravelled row-major; requires ``r_0 == 1``.
    """
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
