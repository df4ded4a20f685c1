"""Data-parallel helpers: rank and world size, a loss value averaged over ranks (so every rank takes the same
decisions), gathers, barriers, and the backend for a device (nccl for CUDA, gloo for the CPU). Details:
docs/training.md, 'More than one process'.
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
    """Check ``backend`` (default: the running process group's) against the model's ``device``: a CPU model
    needs gloo (``ValueError`` otherwise), a CUDA model on gloo gets a ``UserWarning``, a mixed backend
    such as ``"cpu:gloo,cuda:nccl"`` passes.
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
