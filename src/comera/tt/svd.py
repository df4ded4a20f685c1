"""TT-SVD: tensor-train cores from a dense tensor or matrix by successive truncated SVDs in float64 (exact at
the ranks of :func:`comera.tt.shapes.max_ranks`, else the quasi-optimal truncation), returned in the input's
dtype. Details: docs/method.md section 2.6."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from comera.tt.shapes import resolve_ranks

__all__ = ["tt_svd", "ttm_svd"]


def tt_svd(tensor: torch.Tensor, ranks: int | Sequence[int]) -> list[torch.Tensor]:
    """Decompose ``tensor`` of shape ``(n_1, ..., n_K)`` into TT cores ``(r_{k-1}, n_k, r_k)``.

    Args:
        tensor: the dense tensor, any float dtype.
        ranks: maximum rank per inner bond (int or ``K - 1`` ints), clipped to what the shape allows.

    Returns:
        ``K`` cores whose contraction approximates ``tensor``.
    """
    modes = tuple(tensor.shape)
    bond_ranks = resolve_ranks(ranks, modes)
    work = tensor.detach().to(torch.float64)
    cores = []
    left_rank = 1
    for k, size in enumerate(modes[:-1]):
        unfolding = work.reshape(left_rank * size, -1)
        u, s, vh = torch.linalg.svd(unfolding, full_matrices=False)
        rank = min(bond_ranks[k], s.shape[0])
        cores.append(u[:, :rank].reshape(left_rank, size, rank))
        work = s[:rank, None] * vh[:rank]
        left_rank = rank
    cores.append(work.reshape(left_rank, modes[-1], 1))
    return [core.to(tensor.dtype).contiguous() for core in cores]


def ttm_svd(
    matrix: torch.Tensor, row_modes: Sequence[int], col_modes: Sequence[int], ranks: int | Sequence[int]
) -> list[torch.Tensor]:
    """Decompose a ``(prod m_k, prod n_k)`` matrix into TTM cores ``(r_{k-1}, m_k, n_k, r_k)``."""
    d = len(row_modes)
    if matrix.shape != (math.prod(row_modes), math.prod(col_modes)):
        raise ValueError(
            f"matrix must have shape ({math.prod(row_modes)}, {math.prod(col_modes)}) for row_modes "
            f"{tuple(row_modes)} and col_modes {tuple(col_modes)}, got {tuple(matrix.shape)}"
        )
    interleave = [axis for k in range(d) for axis in (k, d + k)]
    paired = matrix.reshape(*row_modes, *col_modes).permute(interleave)
    paired = paired.reshape([m * n for m, n in zip(row_modes, col_modes)])
    cores = tt_svd(paired, ranks)
    return [
        core.reshape(core.shape[0], m, n, core.shape[2]) for core, m, n in zip(cores, row_modes, col_modes)
    ]
