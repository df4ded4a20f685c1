"""Running one training job as several processes (``torchrun``): the process group from the environment, the
global batch split over ranks, decisions and records that every rank agrees on, and jobs run on rank 0
alone. Details: docs/training.md, 'More than one process'.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from comera.process import stop_with_parent
from comera.train.distributed import backend_for, gather_objects, is_distributed, world

__all__ = [
    "RankError",
    "RankLostError",
    "lost_rank",
    "peer_failure",
    "environment_world_size",
    "environment_device",
    "training_device",
    "init_from_environment",
    "shutdown",
    "per_process_batch",
    "all_true",
    "on_rank_zero",
    "rank_zero_first",
    "per_rank_values",
    "rank_seed",
    "seed_process",
]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a collective call waits for the other ranks before failing (``COMERA_DIST_TIMEOUT`` overrides)."""


class RankError(RuntimeError):
    """A job run on rank 0 (:func:`on_rank_zero`) failed; raised on the other ranks with rank 0's message.

    Attributes:
        kind: the name of the exception class rank 0 raised.
    """

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


class RankLostError(RuntimeError):
    """A collective call failed because another process of the run stopped (or timed out): every process
    stops with this error and the run continues from its newest checkpoint (``fit(resume=True)``,
    ``comera train --resume``)."""


_PEER_FAILURES = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo/transport",
    "nccl",
)
"""Words of the ``RuntimeError`` s that the backends raise when another rank is gone (gloo raises plain
``RuntimeError`` s, not ``torch.distributed.DistError`` s)."""


def peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective call failing because another rank stopped or stopped answering."""
    if isinstance(error, dist.DistError):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in message for words in _PEER_FAILURES)


def lost_rank(error: Exception, checkpoint_dir: os.PathLike | str | None) -> RankLostError:
    """The :class:`RankLostError` for ``error``, a failed collective call, naming where to resume from."""
    rank, world_size = world()
    where = (
        "the run had no checkpoint folder, so it starts again from step 0"
        if checkpoint_dir is None
        else f"continue it from the newest checkpoint in {checkpoint_dir} (fit(resume=True), --resume)"
    )
    return RankLostError(
        f"process {rank} of {world_size} stopped: another process of the run stopped or stopped answering "
        f"({type(error).__name__}: {error}); {where}"
    )


def environment_world_size() -> int:
    """``WORLD_SIZE`` from the environment (set by ``torchrun``); 1 when it is not set.

    Raises:
        ValueError: ``WORLD_SIZE`` is not a positive integer.
    """
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be a positive integer, got {value!r}")
    return int(value)


def environment_device() -> torch.device:
    """The device of this process: CUDA device ``LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def training_device(name: str) -> torch.device:
    """The device a :attr:`comera.TrainConfig.device` name means in this process (``"cuda"``: GPU
    ``LOCAL_RANK`` under ``torchrun``, else the current GPU), checked on this machine.

    Raises:
        ValueError: CUDA is not available, or N of ``"cuda:N"`` is not below the number of GPUs.
    """
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(
            f"train.device={name!r}: CUDA is not available here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); use train.device='cpu'"
        )
    count = torch.cuda.device_count()
    index = device.index
    if index is None:
        local = os.environ.get("LOCAL_RANK")
        index = int(local) if local is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise ValueError(
            f"train.device={name!r}: GPU {index} does not exist; this machine has {count} "
            f"(indices 0 to {count - 1})"
        )
    return torch.device("cuda", index)


def init_from_environment(device: torch.device | None = None) -> bool:
    """Create the process group ``torchrun`` describes in the environment (nccl on CUDA after selecting the
    device, gloo on the CPU; collectives time out after ``COMERA_DIST_TIMEOUT`` seconds); True if this call
    created it, False outside ``torchrun`` or when a group exists.
    """
    if environment_world_size() == 1 or (dist.is_available() and dist.is_initialized()):
        return False
    stop_with_parent()
    device = environment_device() if device is None else torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = float(os.environ.get("COMERA_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout))
    return True


def shutdown(wait: bool = True) -> None:
    """Destroy the process group, if one exists, after collecting the wrappers that hold it; with ``wait`` the
    ranks first meet at a barrier (pass ``wait=False`` after a rank was lost).
    """
    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def per_process_batch(batch_size: int, world_size: int) -> int:
    """Each process's share of the global ``batch_size`` (``batch_size / world_size``).

    Raises:
        ValueError: ``batch_size`` is not a multiple of ``world_size`` (naming ``train.batch_size``).
    """
    if batch_size % world_size:
        raise ValueError(
            f"train.batch_size={batch_size} is the global batch and must be a multiple of the number of "
            f"processes ({world_size}); choose e.g. train.batch_size={batch_size - batch_size % world_size}"
            f" or {batch_size + world_size - batch_size % world_size}"
        )
    return batch_size // world_size


def all_true(flag: bool) -> bool:
    """Whether ``flag`` is True on every rank (``flag`` itself outside a process group)."""
    if not is_distributed():
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() == 1.0)


def on_rank_zero(job: Callable[[], T]) -> T | None:
    """Run ``job`` on rank 0 only and wait for it on every rank; its result on rank 0, None elsewhere. An
    exception is raised on rank 0 as it was and as :class:`RankError` on the other ranks.
    """
    rank, _ = world()
    failure: tuple[str, str] | None = None
    result = None
    if rank == 0:
        try:
            result = job()
        except Exception as error:
            if not is_distributed():
                raise
            failure = (type(error).__name__, str(error))
            gather_objects(failure)
            raise
    failures = gather_objects(failure)
    if failures[0] is not None:
        raise RankError(*failures[0])
    return result


def rank_zero_first(job: Callable[[], T]) -> T:
    """Run ``job`` on rank 0, then on the other ranks (for a job that fills a shared cache, e.g. building a
    vocabulary); its result on every rank. Rank 0's failure is raised everywhere, as in :func:`on_rank_zero`.
    """
    result = on_rank_zero(job)
    if world()[0] != 0:
        result = job()
    return result


def rank_seed(seed: int, rank: int) -> int:
    """The seed of the global RNGs (dropout, masking) on ``rank``: ``seed`` itself on rank 0, a different
    one on every other rank, so that ranks do not draw the same random numbers for different examples."""
    return (seed + rank * 1_000_033) % (2**63 - 1)


def seed_process(seed: int, rank: int) -> None:
    """Seed torch's, Python's and NumPy's global generators with :func:`rank_seed` of ``seed`` on ``rank``
    (NumPy's legacy seed takes ``[0, 2**32)``: it gets that seed modulo ``2**32``, since config seeds and
    ranks go beyond)."""
    seeded = rank_seed(seed, rank)
    torch.manual_seed(seeded)
    random.seed(seeded)
    np.random.seed(seeded % 2**32)


def per_rank_values(**values: float) -> dict[str, list[Any]]:
    """``{name + "_per_rank": [value on rank 0, rank 1, ...]}`` for every keyword (collective)."""
    gathered = gather_objects(values)
    return {f"{name}_per_rank": [ranks[name] for ranks in gathered] for name in values}
