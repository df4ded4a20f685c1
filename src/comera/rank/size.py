"""Exact size of the active-rank model, ``sum_k c_k r_{k-1} r_k`` core entries per train (0 with a dead bond),
as Python ints for reports or as device tensors (no host sync) inside a training step. Details: docs/method.md
section 4.1."""

from __future__ import annotations

import torch
from torch import nn

from comera.nn.gated import GatedTrain
from comera.tt.cores import BYTES_PER_FP32, mib

__all__ = ["BYTES_PER_FP32", "gated_trains", "live_ranks", "train_size", "total_size", "mib"]


def gated_trains(model: nn.Module) -> list[tuple[str, GatedTrain]]:
    """Every :class:`GatedTrain` in ``model`` (itself included) with its dotted name, each once."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, GatedTrain)]


def live_ranks(train: GatedTrain) -> list[torch.Tensor]:
    """Active rank of every bond as a 0-dim int64 tensor: the number of gate entries with ``|g| > tau``."""
    return [(gate.detach().abs() > train.tau).sum() for gate in train.gates]


def train_size(train: GatedTrain) -> torch.Tensor:
    """Core entries of ``train`` at its active ranks, a 0-dim int64 tensor (0 when a bond is dead)."""
    ranks = live_ranks(train)
    one = torch.ones((), dtype=torch.int64, device=ranks[0].device if ranks else None)
    full = [one, *ranks, one]
    size = sum(c * full[k] * full[k + 1] for k, c in enumerate(train.bond_sizes))
    alive = torch.stack([r > 0 for r in full]).all()
    return size * alive


def total_size(model: nn.Module) -> torch.Tensor:
    """Sum of :func:`train_size` over every gated train of ``model`` (int64 tensor; 0 if there is none)."""
    sizes = [train_size(train) for _, train in gated_trains(model)]
    if not sizes:
        return torch.zeros((), dtype=torch.int64)
    device = sizes[0].device
    return torch.stack([size.to(device) for size in sizes]).sum()
