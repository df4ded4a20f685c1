"""Data-parallel helpers: rank and world size, a loss value averaged over ranks, gathers, barriers.

Under DDP every rank computes the gradient of its own shard and DDP averages them, so parameters (gates
included) stay identical across ranks. The rank objective also *reads* the task loss (its moving average
drives the late-stage switch and the loss target), so :func:`globally_averaged` gives the loss the value of
the mean over ranks while keeping the local gradient: masks, sizes, the switch and pruning decisions are then
the same on every rank.

The process group is the caller's to create (``torchrun`` sets the environment): with
``torch.distributed.init_process_group(backend_for(device))`` it uses nccl for a CUDA model and gloo for a CPU
one; on CUDA each process also selects its own GPU first (``torch.cuda.set_device(local_rank)``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "world",
    "is_distributed",
    "backend_for",
    "check_backend",
    "globally_averaged",
    "gather_objects",
    "barrier",
]


def is_distributed() -> bool:
    """Whether a process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` outside a process group."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for a model on ``device``: ``"nccl"`` on CUDA, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_backend(device: torch.device, backend: str | None = None) -> None:
    """Check ``backend`` (default: the running process group's) against the model's ``device``.

    A CPU model needs gloo: any other backend raises ``ValueError``. A CUDA model should use nccl; gloo also
    moves CUDA tensors, only slowly, so it gets a ``UserWarning``. A mixed backend such as
    ``"cpu:gloo,cuda:nccl"`` passes.
    """
    backend = str(dist.get_backend() if backend is None else backend).lower()
    needed = backend_for(device)
    if needed in backend:
        return
    message = (
        f"the process group uses backend {backend!r}, but the model is on {device}, which needs "
        f"{needed!r}: create it with torch.distributed.init_process_group(backend_for(device))"
    )
    if needed == "nccl" and "gloo" in backend:
        warnings.warn(message + " (gloo works on CUDA tensors, but slowly)", UserWarning, stacklevel=2)
        return
    raise ValueError(message)


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
