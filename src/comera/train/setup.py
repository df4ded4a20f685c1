"""Setting up a :class:`comera.train.Trainer`: argument checks, batching, default optimizer, CUDA graph."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from comera.train.config import TrainConfig
from comera.train.cuda_graph import CudaGraphStep, capturable_adam
from comera.train.data import EpochData
from comera.train.evaluation import Evaluator
from comera.train.objective import Objective
from comera.train.parallel import training_device

__all__ = [
    "check_world",
    "check_arguments",
    "place_model",
    "batches_for",
    "default_optimizer",
    "fusable",
    "graph_step_for",
]


def check_arguments(model, loss_fn, config, optimizer, objective, eval_fn, evaluator) -> TrainConfig:
    """The Trainer's arguments checked (``TypeError`` / ``ValueError`` naming the argument); the config."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise TypeError(
            "model must not be wrapped in DistributedDataParallel: pass the plain model; the Trainer "
            "wraps it itself because it must rebuild the wrapper after pruning"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}")
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(f"eval_fn must be callable or None, got {type(eval_fn).__name__}")
    if evaluator is not None and not isinstance(evaluator, Evaluator):
        raise TypeError(
            f"evaluator must be a comera.train.evaluation.Evaluator or None, got {type(evaluator).__name__}"
        )
    if eval_fn is not None and evaluator is not None:
        raise ValueError("give eval_fn or evaluator, not both")
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    if objective is not None and not isinstance(objective, Objective):
        raise TypeError(
            f"objective must be a comera.train.objective.Objective or None, got {type(objective).__name__}"
        )
    return config


def place_model(module: nn.Module, device_name: str | None, optimizer: torch.optim.Optimizer | None) -> None:
    """Move ``module`` in place to the device ``device_name`` names (:attr:`TrainConfig.device`); nothing for
    None or a module already there; parameters keep their identity.

    Raises:
        ValueError: ``optimizer`` already holds state, or the move replaced the parameters it holds.
    """
    if device_name is None:
        return
    device = training_device(device_name)
    tensors = itertools.chain(module.parameters(), module.buffers())
    if all(tensor.device == device for tensor in tensors):
        return
    advice = f"build it after moving the model (model.to({str(device)!r})), or leave train.device unset"
    if optimizer is not None and optimizer.state:
        raise ValueError(
            f"train.device={device_name!r}: the optimizer passed in already holds state on the model's "
            f"current device; {advice}"
        )
    before = list(module.parameters())
    module.to(device)
    if optimizer is not None and any(old is not new for old, new in zip(before, module.parameters())):
        raise ValueError(
            f"train.device={device_name!r}: moving the model to {device} replaced its parameters, so the "
            f"optimizer passed in holds the old ones; {advice}"
        )


def batches_for(
    train_data: Any,
    eval_data: Any,
    config: TrainConfig,
    collate_fn: Callable[[list], Any] | None,
    process_rank: int,
    world_size: int,
) -> tuple[EpochData, EpochData | None]:
    """The training and evaluation batches of a run (this process's shard), checked against the config."""
    batching = {
        "batch_size": config.batch_size,
        "seed": config.seed,
        "collate_fn": collate_fn,
        "rank": process_rank,
        "world_size": world_size,
    }
    train = EpochData(train_data, shuffle=config.shuffle, drop_last=config.drop_last, **batching)
    if not train.has_length():
        if config.unit == "epoch":
            raise ValueError(
                "train_data must have a len() (batches per epoch) to count stages in epochs; "
                "use unit='step' for data without one"
            )
    elif len(train) == 0:
        raise ValueError(
            "train_data yields no batches (empty, or fewer samples than batch_size with drop_last)"
        )
    if config.cuda_graph and config.graph_buckets is None and train.is_dataset:
        samples = train.shard_size()
        if not config.drop_last and samples % config.batch_size:
            raise ValueError(
                f"cuda_graph=True without graph_buckets needs batches of one shape, but train_data's "
                f"{samples} samples leave a last batch of {samples % config.batch_size} (batch_size="
                f"{config.batch_size}): set drop_last=True, or graph_buckets and graph_pad"
            )
    evaluation = (
        None
        if eval_data is None
        else EpochData(eval_data, shuffle=False, drop_last=False, equal_shards=False, **batching)
    )

    return train, evaluation


def fusable(params) -> bool:
    """Whether PyTorch's fused AdamW kernel takes ``params``: floating point, on CPU or CUDA."""
    return all(param.is_floating_point() and param.device.type in ("cpu", "cuda") for param in params)


def default_optimizer(objective: Objective, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW on the objective's parameter groups (``config.lr_other`` for what has no rate of its own):
    capturable for a CUDA graph, else PyTorch's fused kernel where the parameters allow it (one kernel per
    tensor instead of a dozen element-wise ops: on a CPU, 2.8 instead of 12.4 ms for the 481 tensors of the
    paper's compressed transformer)."""
    groups = objective.param_groups(lr=config.lr_other, weight_decay=config.weight_decay)
    if config.cuda_graph:
        return torch.optim.AdamW(groups, capturable=True)
    fused = fusable(param for group in groups for param in group["params"])
    return torch.optim.AdamW(groups, fused=fused or None)


def _graph_device(device: torch.device) -> bool:
    """Whether a model on ``device`` can run its step as a CUDA graph."""
    return device.type == "cuda"


def graph_step_for(
    module: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    config: TrainConfig,
    device: torch.device,
) -> CudaGraphStep:
    """The :class:`comera.train.cuda_graph.CudaGraphStep` of a run with ``config.cuda_graph``."""
    if not _graph_device(device):
        raise ValueError(f"cuda_graph needs a CUDA model; on CPU use compile (the model is on {device})")
    if not capturable_adam(optimizer):
        raise ValueError(
            "optimizer must be torch.optim.AdamW or torch.optim.Adam built with capturable=True in every "
            f"param group when cuda_graph=True, got {type(optimizer).__name__}"
        )
    return CudaGraphStep(
        module,
        loss_fn,
        optimizer,
        objective,
        buckets=config.graph_buckets,
        pad=config.graph_pad,
        length_dim=config.graph_length_dim,
        grad_clip=config.grad_clip,
        warmup=config.graph_warmup,
        autocast_dtype=torch.bfloat16 if config.precision == "bf16" else None,
    )


def check_world(config: TrainConfig, world_size: int) -> None:
    """Refuse ``config.cuda_graph`` in a process group of ``world_size > 1`` ranks (the captured step has no
    gradient all-reduce)."""
    if config.cuda_graph and world_size > 1:
        raise ValueError(
            "cuda_graph=True supports single-process runs only, got a process group of "
            f"{world_size} ranks (DDP): the captured step has no gradient all-reduce; set cuda_graph=False"
        )
