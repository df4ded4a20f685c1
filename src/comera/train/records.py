"""What a training run writes to ``metrics.jsonl`` between logs: the window of steps since the last record
(mean task loss and objective of the applied steps, size, ratio, ranks, rates, step time, peak memory).
Details: docs/recipes.md, 'The run folder'.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from comera.train.metrics import peak_memory_mib
from comera.train.objective import Objective

__all__ = ["StepWindow", "bar_postfix", "train_record"]


class StepWindow:
    """Task loss, objective and wall time summed over the steps since the last record.

    Attributes:
        loss, objective: sums over the applied (finite) steps.
        applied: number of applied steps; steps: number of steps (applied or skipped).
        seconds: wall time of all steps.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Start a new window."""
        self.loss = 0.0
        self.objective = 0.0
        self.applied = 0
        self.steps = 0
        self.seconds = 0.0

    def add(self, task: float, objective: float, applied: bool, started: float) -> None:
        """Count one step that began at ``time.perf_counter() == started``."""
        if applied:
            self.loss += task
            self.objective += objective
            self.applied += 1
        self.seconds += time.perf_counter() - started
        self.steps += 1

    def state_dict(self) -> dict[str, float | int]:
        """The window's sums, for a checkpoint: a run resumed there logs the record it would have logged."""
        return {
            "loss": self.loss,
            "objective": self.objective,
            "applied": self.applied,
            "steps": self.steps,
            "seconds": self.seconds,
        }

    def load_state_dict(self, state: dict[str, float | int] | None) -> None:
        """Continue the window of :meth:`state_dict`; None (a checkpoint written before windows were saved)
        starts a new one."""
        self.clear()
        if state is None:
            return
        self.loss, self.objective = float(state["loss"]), float(state["objective"])
        self.applied, self.steps = int(state["applied"]), int(state["steps"])
        self.seconds = float(state["seconds"])

    @property
    def step_time(self) -> float:
        """Mean seconds per step in the window (0.0 for an empty window)."""
        return self.seconds / max(self.steps, 1)


def train_record(
    window: StepWindow,
    *,
    step: int,
    epoch: int,
    objective: Objective,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    nonfinite: int,
) -> dict[str, Any]:
    """The ``"train"`` record for ``window`` (means are NaN when no step of the window was applied)."""
    size = objective.size()
    step_time = window.step_time
    applied = window.applied
    return {
        "kind": "train",
        "step": step,
        "epoch": epoch,
        "stage": objective.stage,
        "objective_name": objective.name,
        "loss": window.loss / applied if applied else float("nan"),
        "objective": window.objective / applied if applied else float("nan"),
        "size": size,
        "ratio": size / objective.initial_size,
        **objective.record(),
        "lr": {
            str(group.get("name", i)): float(group["lr"]) for i, group in enumerate(optimizer.param_groups)
        },
        "step_time": step_time,
        "steps_per_second": 1.0 / step_time if step_time > 0 else float("nan"),
        "peak_memory_mib": peak_memory_mib(device),
        "nonfinite": nonfinite,
    }


def bar_postfix(record: dict[str, Any], skipped: int) -> dict[str, Any]:
    """What the progress bar shows after a train ``record``: loss, size ratio, stage, and the number of
    ``skipped`` (non-finite) steps when there are any."""
    shown: dict[str, Any] = {
        "loss": f"{record['loss']:.4g}",
        "ratio": f"{record['ratio']:.3f}",
        "stage": record["stage"],
    }
    if skipped:
        shown["skipped"] = skipped
    return shown
