"""Learning-rate schedules of the Trainer (``TrainConfig.lr_schedule``): every group's rate is its peak
``initial_lr`` times a factor of the step alone (``"constant"``, or ``"cosine"`` with linear warm-up), so a
resumed run sets the rates an uninterrupted run set. Details: docs/training.md, 'Learning-rate schedule'.
"""

from __future__ import annotations

import math

import torch

from comera.checks import check_int, check_number

__all__ = ["LR_SCHEDULES", "apply_lr_schedule", "check_schedule", "lr_factor", "rates_as_tensors"]

LR_SCHEDULES = ("constant", "cosine")
"""The schedules ``TrainConfig.lr_schedule`` accepts."""


def check_schedule(schedule: object, warmup: object, min_lr_ratio: object) -> None:
    """``ValueError`` naming the setting when ``schedule`` is not one of :data:`LR_SCHEDULES`, ``warmup``
    not in ``[0, 1)`` or ``min_lr_ratio`` not in ``[0, 1]``."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    check_number(warmup, "warmup", 0.0, 1.0, open_high=True)
    check_number(min_lr_ratio, "min_lr_ratio", 0.0, 1.0)


def lr_factor(step: int, total: int, schedule: str, warmup: float, min_lr_ratio: float) -> float:
    """The factor of every group's peak rate before optimizer step ``step`` (0-based) of ``total`` (module
    docstring). ``step`` may reach ``total`` (the factor there is the schedule's end value)."""
    check_int(total, "total", 1)
    check_int(step, "step", 0, total)
    check_schedule(schedule, warmup, min_lr_ratio)
    if schedule == "constant":
        return 1.0
    warm = math.floor(warmup * total)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / (total - warm)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_lr_schedule(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Set every param group's ``lr`` to ``factor`` times its peak ``initial_lr`` (recorded from ``lr``, as a
    float, the first time a group is seen). A rate held as a tensor (:func:`rates_as_tensors`) is written in
    place, so a captured CUDA graph's optimizer step replays the new rate."""
    for group in optimizer.param_groups:
        if "initial_lr" not in group:
            group["initial_lr"] = float(group["lr"])
        rate = group["initial_lr"] * factor
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate


def rates_as_tensors(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Hold every param group's ``lr`` as a 0-dim float32 tensor on ``device`` (a group already holding one
    there keeps it): ``AdamW``/``Adam`` with ``capturable=True`` read such a rate on the device, so a CUDA
    graph captured once replays whatever :func:`apply_lr_schedule` writes into it later."""
    for group in optimizer.param_groups:
        rate = group["lr"]
        if not (isinstance(rate, torch.Tensor) and rate.device == device and rate.dtype == torch.float32):
            group["lr"] = torch.tensor(float(rate), dtype=torch.float32, device=device)
