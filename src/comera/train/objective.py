"""What the training loop optimises on top of the task loss: CoMERA's two-stage rank objective, or the task
loss alone (every baseline: dense, GaLore, LTE, APOLLO, CoLA).

The :class:`comera.train.Trainer` asks its objective, and nothing else, about stages, sizes and pruning:

- :meth:`Objective.loss` turns the task loss into the optimised scalar inside the (compiled or graph-captured)
  step: tensors only, no host sync;
- :meth:`Objective.device_state` lists the device tensors ``loss`` mutates, so a skipped step or a CUDA-graph
  warm-up can be undone (:meth:`Objective.snapshot` / :meth:`Objective.restore`);
- :meth:`Objective.begin_late_stage`, :meth:`Objective.after_step` and :meth:`Objective.prune` are the
  host-side decisions between steps;
- :meth:`Objective.size` / :attr:`Objective.initial_size` give the logged model size, and
  :meth:`Objective.state_dict` what a checkpoint stores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from comera.rank.adaptation import RankAdaptation
from comera.rank.groups import param_groups
from comera.rank.prune import PruneResult, prune_
from comera.rank.size import gated_trains

__all__ = ["Objective", "TaskObjective", "CoMERAObjective", "default_objective"]


def _trainable_parameters(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


class Objective:
    """The base protocol; :class:`TaskObjective` is its plain implementation.

    Attributes:
        name: short name written into the run's records (``"task"``, ``"comera"``).
        has_stages: whether the objective has an early and a late stage (then ``config.late`` steps run the
            late stage; without stages the run is ``early + late`` steps of the same objective).
        prunes: whether the Trainer's prune points (``config.prune_at``) apply.
    """

    name = "task"
    has_stages = False
    prunes = False

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.initial_size = max(self.size(), 1)

    @property
    def stage(self) -> str:
        """The current stage: ``"train"`` for an objective without stages, else ``"early"`` / ``"late"``."""
        return "train"

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The optimised 0-dim scalar for a 0-dim ``task_loss`` (differentiable, no host sync)."""
        if not isinstance(task_loss, torch.Tensor) or task_loss.dim() != 0:
            raise ValueError(f"task_loss must be a 0-dim tensor, got {task_loss!r}")
        return task_loss

    def size(self) -> int:
        """The model size the records report: trainable parameter entries (shared ones once)."""
        return _trainable_parameters(self.model)

    def ratio(self) -> float:
        """:meth:`size` over :attr:`initial_size`."""
        return self.size() / self.initial_size

    def device_state(self) -> list[torch.Tensor]:
        """Device tensors that :meth:`loss` updates in place (none here)."""
        return []

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of :meth:`device_state` (no host sync), for :meth:`restore`."""
        return [tensor.clone() for tensor in self.device_state()]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        """Put back what :meth:`snapshot` copied, e.g. after a skipped step."""
        with torch.no_grad():
            for tensor, saved in zip(self.device_state(), snapshot, strict=True):
                tensor.copy_(saved)

    def param_groups(self, *, lr_cores: float, lr_gates: float, lr_other: float, weight_decay: float):
        """Parameter groups of the default AdamW: every trainable parameter at ``lr_other``."""
        return param_groups(
            self.model, lr_cores=lr_cores, lr_gates=lr_gates, lr_other=lr_other, weight_decay=weight_decay
        )

    def begin_late_stage(self, **settings: Any) -> dict[str, Any]:
        """Enter the late stage; returns the details logged with the event. Only for staged objectives."""
        raise RuntimeError(f"the {self.name!r} objective has no late stage")

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Host-side work after an applied optimizer step; an event dict to log (its ``"changed"`` entry says
        whether parameters or structure changed, so a captured graph must be dropped), or None."""
        return None

    def prune(self, optimizer: torch.optim.Optimizer | None) -> PruneResult | None:
        """Physically shrink the model at a prune point (None: nothing to prune)."""
        return None

    def record(self) -> dict[str, Any]:
        """Extra entries for each metrics record (e.g. the ranks of every gated layer)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores to resume this objective (plain values)."""
        return {"name": self.name, "initial_size": self.initial_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another objective raises ``ValueError``."""
        if state.get("name", self.name) != self.name:
            raise ValueError(
                f"the checkpoint was written with the {state.get('name')!r} objective, this run uses "
                f"{self.name!r}"
            )
        self.initial_size = int(state.get("initial_size", self.initial_size))


class TaskObjective(Objective):
    """The task loss alone: the objective of every baseline (dense, GaLore, LTE, APOLLO, CoLA).

    ``size()`` counts trainable parameter entries; no stages, no pruning.
    """


class CoMERAObjective(Objective):
    """CoMERA's rank-adaptive objective (docs/method.md section 4): :class:`comera.RankAdaptation` wrapped.

    Args:
        model: a model with gated layers (``TTLinear``, ``TTMLinear``, TTM embeddings).
        gamma, surrogate: as :class:`comera.RankAdaptation`.
        tau: gate threshold; None keeps the threshold the layers were built with (``TensorizeConfig.tau``,
            one value for every layer), a number overrides every layer's.

    Attributes:
        adaptation: the wrapped :class:`comera.RankAdaptation`, built with ``step_hook=False``: the Trainer
            runs the late-stage controller through :meth:`after_step` after every applied step, outside the
            compiled or graph-captured step (a hook would run inside them, and skipped steps must not count).
    """

    name = "comera"
    has_stages = True
    prunes = True

    def __init__(
        self, model: nn.Module, *, gamma: float = 0.01, tau: float | None = None, surrogate: str = "size"
    ) -> None:
        if tau is None:
            tau = _layers_tau(model)
        self.adaptation = RankAdaptation(model, gamma=gamma, tau=tau, surrogate=surrogate, step_hook=False)
        super().__init__(model)
        self.initial_size = self.adaptation.initial_size

    @property
    def stage(self) -> str:
        return self.adaptation.stage

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        return self.adaptation.loss(task_loss)

    def size(self) -> int:
        """Exact core entries of the active-rank model (syncs with the device)."""
        return self.adaptation.size()

    def device_state(self) -> list[torch.Tensor]:
        return self.adaptation.device_state()

    def param_groups(self, *, lr_cores: float, lr_gates: float, lr_other: float, weight_decay: float):
        """CoMERA's three groups: cores, gates (never decayed), everything else."""
        return super().param_groups(
            lr_cores=lr_cores, lr_gates=lr_gates, lr_other=lr_other, weight_decay=weight_decay
        )

    def begin_late_stage(self, **settings: Any) -> dict[str, Any]:
        """``settings``: ``target_ratio``, ``target_loss``, ``rho``, ``ema``, ``late_steps``, ``recovery`` of
        :meth:`comera.RankAdaptation.begin_late_stage` (``late_steps`` and ``recovery`` set the deadline of
        the trim)."""
        self.adaptation.begin_late_stage(**settings)
        return {"target_size": self.adaptation.target_size, "target_loss": self.adaptation.target_loss}

    def after_step(self, step: int) -> dict[str, Any] | None:
        hook = getattr(self.adaptation, "after_step", None)
        return None if hook is None else hook(step)

    def prune(self, optimizer: torch.optim.Optimizer | None) -> PruneResult | None:
        return prune_(self.model, optimizer)

    def record(self) -> dict[str, Any]:
        record = {"ranks": {name: list(train.ranks) for name, train in gated_trains(self.model)}}
        if self.stage == "late":
            record["target_reached"] = self.adaptation.target_reached
            record["reached_at_step"] = self.adaptation.reached_at_step
        return record

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rank_adaptation": self.adaptation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.adaptation.load_state_dict(state.get("rank_adaptation", state))
        self.initial_size = self.adaptation.initial_size


def _layers_tau(model: nn.Module) -> float:
    taus = {float(train.tau) for _, train in gated_trains(model)}
    if len(taus) > 1:
        raise ValueError(
            f"the model's gated layers use different gate thresholds {sorted(taus)}; pass tau= to set one "
            "for all (TrainConfig.tau)"
        )
    if not taus:
        raise ValueError(
            "model has no gated layers (TTLinear, TTMLinear, ...); call comera.tensorize_ first, or train "
            "with TaskObjective"
        )
    return taus.pop()


def default_objective(model: nn.Module, *, gamma: float, tau: float | None, surrogate: str) -> Objective:
    """:class:`CoMERAObjective` for a model with gated layers, else :class:`TaskObjective`."""
    if any(len(train.gates) for _, train in gated_trains(model)):
        return CoMERAObjective(model, gamma=gamma, tau=tau, surrogate=surrogate)
    return TaskObjective(model)
