"""A tiny classification task and model built from comera layers, shared by the training tests."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils.data import TensorDataset

from comera import TTLinear, TTMLinear
from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.train.config import TrainConfig
from comera.train.setup import default_optimizer

FEATURES = 12
CLASSES = 3


def make_model(seed: int = 0, dropout: float = 0.1, dead_gate: bool = False) -> nn.Module:
    """TT layer -> GELU -> dropout -> TTM layer -> dense head; deterministic for a given seed.

    ``dead_gate`` zeroes one gate entry of the TT layer, so the first prune always shrinks it.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        TTLinear(FEATURES, 16, rank=4, in_shape=(3, 4), out_shape=(4, 4)),
        nn.GELU(),
        nn.Dropout(dropout),
        TTMLinear(16, 8, rank=3, in_shape=(4, 4), out_shape=(2, 4)),
        nn.Tanh(),
        nn.Linear(8, CLASSES),
    )
    if dead_gate:
        with torch.no_grad():
            model[0].gates[1][-1] = 0.0
    return model


def make_data(samples: int = 48, seed: int = 1) -> TensorDataset:
    """Labels from a fixed random linear rule, so the task is learnable."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    rule = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(inputs, (inputs @ rule).argmax(dim=1))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Cross-entropy of the model on ``(inputs, labels)``."""
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs), labels)


def accuracy_fn(model: nn.Module, batch) -> dict[str, float]:
    """Loss and accuracy on one batch."""
    inputs, labels = batch
    logits = model(inputs)
    return {
        "loss": float(nn.functional.cross_entropy(logits, labels)),
        "accuracy": float((logits.argmax(dim=1) == labels).float().mean()),
    }


IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable")
"""The ``torch.optim`` options that pick which kernels an optimizer step runs."""


def quiet_config(tmp_path=None, **values) -> TrainConfig:
    """A small, eager, quiet run in order (batches of 8: 6 steps per epoch of :func:`make_data`), writing
    into ``tmp_path`` when given; ``values`` override."""
    base = {"batch_size": 8, "shuffle": False, "compile": False, "progress": False, "plot": False}
    if tmp_path is not None:
        base["run_dir"] = str(tmp_path)
    return TrainConfig(**{**base, **values})


def run_settings(**values) -> tuple[TrainConfig, CoMERASettings]:
    """``values`` split into a :class:`TrainConfig` (the generic keys) and :class:`CoMERASettings` (CoMERA's
    keys)."""
    comera_keys = {field.name for field in dataclasses.fields(CoMERASettings)}
    config = TrainConfig(**{key: value for key, value in values.items() if key not in comera_keys})
    return config, CoMERASettings(**{key: value for key, value in values.items() if key in comera_keys})


def trainer_optimizer(
    model: nn.Module, config: TrainConfig, settings: CoMERASettings | None = None
) -> torch.optim.Optimizer:
    """The optimizer a ``Trainer`` with ``config`` builds by default for ``model``: same class, groups, rates
    and implementation (:func:`comera.train.setup.default_optimizer`). A hand-written reference loop that
    compares parameters bit for bit with a Trainer run steps with it: PyTorch's AdamW implementations
    (fused, foreach, single-tensor) agree only to rounding, and by how much depends on the CPU."""
    return default_optimizer(CoMERAObjective(model, settings), config)


def implementation(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every param group's :data:`IMPLEMENTATION_FLAGS`."""
    return [{flag: group[flag] for flag in IMPLEMENTATION_FLAGS} for group in optimizer.param_groups]


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter and buffer."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
