"""Learning-rate schedules of the Trainer (``TrainConfig.lr_schedule``): a factor of the step alone.

Every param group keeps its own peak rate (``group["initial_lr"]``, recorded the first time the schedule
runs; it travels in the optimizer's state dict, so a resumed run scales the same peaks). Before optimizer step
``s`` (0-based: the step that brings the count from ``s`` to ``s + 1``) of a run of ``total`` steps, every
group's rate is ``initial_lr * lr_factor(s, ...)``:

- ``"constant"``: 1 (the default; the Trainer then touches no rate at all);
- ``"cosine"``: with ``w = floor(warmup * total)`` warm-up steps, ``(s + 1) / w`` for ``s < w`` (a linear
  ramp whose first step is not wasted at rate 0, reaching the peak at step ``w - 1``), then a half cosine
  from the peak down to ``min_lr_ratio`` of it: ``m + (1 - m) * (1 + cos(pi * p)) / 2`` with
  ``p = (s - w) / (total - w)``, so the last step (``s = total - 1``) is just above ``m`` and the rate
  would be exactly ``m`` at ``s = total``.

This is the schedule of GaLore, APOLLO, Fira and CoLA's LLaMA runs (10% warm-up, cosine to 10% of the peak).
``total`` counts the whole run, both CoMERA stages (early + late steps). The factor depends on nothing but
``s`` and the settings, so a resumed run sets the rates an uninterrupted run set. Under ``cuda_graph=True``
the rates are device tensors (:func:`rates_as_tensors`) written in place each step, so one captured graph
follows the schedule.
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
