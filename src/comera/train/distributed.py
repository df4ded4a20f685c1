"""Data-parallel helpers: rank and world size, a loss value averaged over ranks, gathers, barriers.

Under DDP every rank computes the gradient of its own shard and DDP averages them, so parameters (gates
included) stay identical across ranks. The rank objective also *reads* the task loss (its moving average
drives the late-stage switch and the loss target), so :func:`globally_averaged` gives the loss the value of
the mean over ranks while keeping the local gradient: masks, sizes, the switch and pruning decisions are then
the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["world", "is_distributed", "globally_averaged", "gather_objects", "barrier"]


def is_distributed() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` outside a process group."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def globally_averaged(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` with the value of its mean over ranks and the gradient of the local ``loss``."""
    if not is_distributed():
        return loss
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return loss + (mean - loss.detach())


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (``[value]`` outside a process group)."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    """Wait for every rank (no-op outside a process group)."""
    if is_distributed():
        dist.barrier()
