"""``CoMERACallback``: CoMERA's host-side schedule inside a ``transformers.Trainer`` run (the controller after
every optimizer step, the late stage after ``early`` steps, the prune points), through the same
:class:`comera.methods.comera.CoMERAObjective` hooks as :class:`comera.train.Trainer`; the loss term and
the parameter groups are :class:`comera.integrations.hf_trainer.CoMERATrainer`'s, which adds this callback.
Details: docs/training.md, 'Training with Hugging Face's Trainer'.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from comera.methods.comera import CoMERAObjective

__all__ = ["CoMERACallback", "early_steps_of", "inner_optimizer"]


def early_steps_of(early: int | float, max_steps: int) -> int:
    """Steps of the early stage in a run of ``max_steps`` optimizer steps.

    Args:
        early: an int ``>= 0``: that many steps (capped at ``max_steps``); a float in ``[0, 1]``: that
            fraction of ``max_steps``, rounded to the nearest step.
        max_steps: the run's optimizer steps (``TrainerState.max_steps``), ``>= 0``.

    Raises:
        ValueError: ``early`` is not such a number (a bool, a negative int, a float outside ``[0, 1]``).
    """
    if (
        isinstance(early, bool)
        or not isinstance(early, (int, float))
        or not 0 <= early <= (1.0 if isinstance(early, float) else math.inf)
    ):
        raise ValueError(f"early must be an int >= 0 (steps) or a float in [0, 1] (fraction), got {early!r}")
    if isinstance(early, int):
        return min(early, max_steps)
    return round(early * max_steps)


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The ``torch.optim.Optimizer`` inside ``optimizer`` (``accelerate``'s ``AcceleratedOptimizer`` keeps it
    as ``.optimizer``), or None for None."""
    while optimizer is not None and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must wrap a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return optimizer


class CoMERACallback(TrainerCallback):
    """Runs CoMERA's controller step, late stage and prune points in a ``transformers.Trainer`` run.

    Args:
        objective: the run's :class:`CoMERAObjective`, built on the (unwrapped) model the Trainer trains.
        early: length of the early stage: an int (optimizer steps) or a float in ``[0, 1]`` (that fraction of
            the run's ``max_steps``); the late stage is the rest of the run. ``early >= max_steps`` (or
            ``1.0``) runs the early stage only.

    Attributes:
        objective: as given.
        early: as given.
        early_steps: the resolved early-stage length, set when training begins (None before).
        events: ``{"step", "event", ...}`` records of what happened between steps, in order:
            ``"late_stage"`` (with the target size and loss), ``"prune"`` (with ``point``, the stored core
            entries before and after, removed layers and new ranks) and ``"objective"`` (a controller event,
            e.g. the late stage's trim).
    """

    def __init__(self, objective: CoMERAObjective, early: int | float = 0.5) -> None:
        if not isinstance(objective, CoMERAObjective):
            raise TypeError(f"objective must be a CoMERAObjective, got {type(objective).__name__}")
        early_steps_of(early, 0)
        self.objective = objective
        self.early = early
        self.early_steps: int | None = None
        self._late_steps = 0
        self._epoch_end_step: int | None = None
        self.events: list[dict[str, Any]] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Resolve the stage lengths from ``state.max_steps`` and check them against the settings; a run
        with no early stage enters the late stage now (it needs ``CoMERASettings.target_loss``). A resumed
        run (``state.global_step > 0``, :meth:`load_state_dict` done) must resolve the early stage as the
        checkpointed run did."""
        early_steps = early_steps_of(self.early, state.max_steps)
        if state.global_step > 0 and early_steps != self.early_steps:
            raise ValueError(
                f"the checkpoint's run has an early stage of {self.early_steps} steps, this one of "
                f"{early_steps} (early={self.early!r}, max_steps={state.max_steps}); resume with the same "
                "early and max_steps"
            )
        self.early_steps = early_steps
        self._late_steps = state.max_steps - self.early_steps
        self.objective.check_stages(early=self.early_steps, late=self._late_steps)
        if state.global_step == 0 and self.early_steps == 0 and self._late_steps > 0:
            self._begin_late_stage(0)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After an optimizer step: the controller, then the ``early_end`` prune and the late stage when
        ``early_steps`` steps are done, the ``end`` prune after the last step, and the ``epoch_end`` prune
        when the step ends an epoch (``state.epoch`` a whole number). All of it happens before the step's
        checkpoint is written."""
        step = state.global_step
        event = self.objective.after_step(step)
        if event:
            self._record(step, "objective", **event)
        optimizer = inner_optimizer(kwargs.get("optimizer"))
        if self.objective.stage == "early" and self._late_steps > 0 and step == self.early_steps:
            self._prune(step, "early_end", optimizer)
            self._begin_late_stage(step)
        if step == state.max_steps:
            self._prune(step, "end", optimizer)
        if state.epoch is not None and state.epoch > 0 and float(state.epoch).is_integer():
            self._end_epoch(step, optimizer)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The ``epoch_end`` prune point of an epoch :meth:`on_step_end` did not see end: ``transformers``
        also ends the last epoch of a run stopped by ``max_steps`` mid-epoch (the ``end`` prune has run by
        then)."""
        self._end_epoch(state.global_step, inner_optimizer(kwargs.get("optimizer")))

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (plain values): the resolved early stage, the step of the last epoch end
        and the events so far."""
        return {
            "early_steps": self.early_steps,
            "epoch_end_step": self._epoch_end_step,
            "events": self.events,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before ``on_train_begin`` of the resumed run)."""
        self.early_steps = state["early_steps"]
        self._epoch_end_step = state["epoch_end_step"]
        self.events = list(state["events"])

    def _end_epoch(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        if self._epoch_end_step != step:
            self._epoch_end_step = step
            self._prune(step, "epoch_end", optimizer)

    def _begin_late_stage(self, step: int) -> None:
        details = self.objective.begin_late_stage(late_steps=self._late_steps)
        self._record(step, "late_stage", **details)

    def _prune(self, step: int, point: str, optimizer: torch.optim.Optimizer | None) -> None:
        if not self.objective.prunes_at(point):
            return
        details = self.objective.prune(optimizer)
        if details is not None:
            self._record(step, "prune", point=point, **details)

    def _record(self, step: int, name: str, **details: Any) -> None:
        self.events.append({"step": step, "event": name, **details})
