"""Checkpoints of a sharded (FSDP2) run as ``torch.distributed.checkpoint`` folders ``step-XXXXXXXX.dcp``
(every rank writes its shards, rank 0 ``trainer.pt``; installed atomically), read back by any number of
processes, sharded or not. Details: docs/training.md, 'Checkpoints across process counts'.
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from comera.atomic import atomic_write, install_folder
from comera.train.checkpoint import TRAINER_FILE
from comera.train.distributed import barrier, is_distributed

__all__ = ["load_sharded_state", "save_sharded_checkpoint"]


def _dcp():
    """``torch.distributed.checkpoint`` and its ``state_dict`` helpers, imported on first use (about a
    second, which runs that never shard should not pay)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict

    return dcp, state_dict


def _shared_token() -> str:
    """A random hex token, the same on every rank (rank 0's, broadcast)."""
    token = [uuid.uuid4().hex]
    if is_distributed():
        dist.broadcast_object_list(token, src=0)
    return token[0]


def save_sharded_checkpoint(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
) -> Path:
    """Write the checkpoint folder ``path`` (replacing one already there in one step): the model and optimizer
    state by DCP, ``trainer_state`` (read on rank 0 only) as ``trainer.pt``; collective, every rank calls
    it. Returns ``path``.
    """
    dcp, state_dict = _dcp()
    path = Path(path)
    staging = path.parent / f".{path.name}.{_shared_token()}.tmp"
    model_state, optimizer_state = state_dict.get_state_dict(module, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=str(staging),
        no_dist=not is_distributed(),
    )
    barrier()
    if not is_distributed() or dist.get_rank() == 0:
        atomic_write(staging / TRAINER_FILE, lambda file: torch.save(trainer_state, file))
        install_folder(staging, path)
    barrier()
    return path


def load_sharded_state(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimizer state of the checkpoint folder ``path`` into ``module`` (sharded or
    not, already given the checkpoint's shapes) and ``optimizer``; collective where a process group exists.
    """
    dcp, state_dict = _dcp()
    model_state, optimizer_state = state_dict.get_state_dict(module, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    with warnings.catch_warnings():  # one process reading on purpose: DCP's "assuming ... single process"
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, checkpoint_id=str(path), no_dist=not is_distributed())
    state_dict.set_state_dict(
        module,
        optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
    )
