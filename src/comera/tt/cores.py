"""Core shapes, initialisation, parameter counts and dense reconstruction for TT and TTM trains.

Index legend (einsum strings in this module):
    a, c   ranks on the left / right of a core (r_{k-1}, r_k)
    i      mode of a TT core, or the row mode m_k of a TTM core
    j      column mode n_k of a TTM core
    p, q   flattened modes already merged on the left (rows / columns)

A TT core has shape ``(r_{k-1}, n_k, r_k)``; a TTM core ``(r_{k-1}, m_k, n_k, r_k)``; ``r_0 = r_K = 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "tt_core_shapes",
    "ttm_core_shapes",
    "core_std",
    "spectral_std",
    "spectral_lr_scale",
    "num_train_parameters",
    "tt_full",
    "ttm_full",
    "BYTES_PER_FP32",
    "mib",
]


def tt_core_shapes(modes: Sequence[int], ranks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Shapes ``(r_{k-1}, n_k, r_k)`` of TT cores for ``modes`` and inner ``ranks`` (len(modes) - 1)."""
    full = (1, *ranks, 1)
    return [(full[k], n, full[k + 1]) for k, n in enumerate(modes)]


def ttm_core_shapes(
    row_modes: Sequence[int], col_modes: Sequence[int], ranks: Sequence[int]
) -> list[tuple[int, int, int, int]]:
    """Shapes ``(r_{k-1}, m_k, n_k, r_k)`` of TTM cores."""
    full = (1, *ranks, 1)
    return [(full[k], m, n, full[k + 1]) for k, (m, n) in enumerate(zip(row_modes, col_modes))]


def core_std(target_std: float, ranks: Sequence[int]) -> list[float]:
    """Per-core Gaussian std so that every reconstructed entry has standard deviation ``target_std``: core k
    of K is drawn from N(0, s^(2/K) / r_k) (r_k its right rank, r_K = 1), which gives E[W_ij^2] = s^2."""
    right = (*ranks, 1)
    order = len(right)
    return [target_std ** (1.0 / order) / math.sqrt(r) for r in right]


def spectral_std(fan_in: int, fan_out: int) -> float:
    """Std of a core read as a ``fan_in x fan_out`` matrix under the spectral rule of Qiu et al. (ICML 2024,
    "Compute Better Spent"): ``sqrt(min(fan_in, fan_out)) / fan_in``, which gives the core a spectral norm
    of about ``sqrt(fan_out / fan_in)``, as a dense layer of those fans has."""
    if fan_in < 1 or fan_out < 1:
        raise ValueError(f"fan_in and fan_out must be >= 1, got {fan_in} and {fan_out}")
    return math.sqrt(min(fan_in, fan_out)) / fan_in


def spectral_lr_scale(dense_fan_in: int, fan_in: int, num_cores: int) -> float:
    """Adam learning-rate multiplier of one core under the same rule: ``(dense_fan_in / fan_in) / num_cores``,
    ``dense_fan_in`` the fan-in of the dense layer the train stands for (its ``in_features``)."""
    if min(dense_fan_in, fan_in, num_cores) < 1:
        raise ValueError(
            f"dense_fan_in, fan_in and num_cores must be >= 1, got {dense_fan_in}, {fan_in}, {num_cores}"
        )
    return dense_fan_in / fan_in / num_cores


def num_train_parameters(bond_sizes: Sequence[int], ranks: Sequence[int]) -> int:
    """Entries of a train whose core k holds ``bond_sizes[k] * r_{k-1} * r_k`` values; 0 if a rank is 0."""
    full = (1, *ranks, 1)
    if min(full) == 0:
        return 0
    return sum(c * full[k] * full[k + 1] for k, c in enumerate(bond_sizes))


def tt_full(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract TT cores ``(r_{k-1}, n_k, r_k)`` into the full tensor of shape ``(n_1, ..., n_K)``."""
    result = cores[0].reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        result = result @ core.reshape(core.shape[0], -1)
        result = result.reshape(-1, core.shape[-1])
    return result.reshape([c.shape[1] for c in cores])


def ttm_full(cores: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract TTM cores ``(r_{k-1}, m_k, n_k, r_k)`` into the matrix ``(prod m_k, prod n_k)``, rows
    row-major over ``(m_1..m_d)``, columns over ``(n_1..n_d)``."""
    result = cores[0].reshape(cores[0].shape[1], cores[0].shape[2], cores[0].shape[3])
    for core in cores[1:]:
        result = torch.einsum("pqa,aijc->piqjc", result, core)
        p, i, q, j, c = result.shape
        result = result.reshape(p * i, q * j, c)
    return result.reshape(result.shape[0], result.shape[1])


BYTES_PER_FP32 = 4


def mib(parameters: int | float) -> float:
    """Mebibytes taken by ``parameters`` fp32 values."""
    return parameters * BYTES_PER_FP32 / 2**20
