"""What the training loop optimises on top of the task loss, and the hooks through which a method steers the
loop: :class:`Objective` (the protocol, also the plain task loss) and the registries of the default
objective and of evaluation hooks. Details: docs/training.md, 'Objectives: what the Trainer asks, and
CoMERA's answers'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from comera.modules import trainable_parameters

__all__ = [
    "Objective",
    "TaskObjective",
    "default_objective",
    "register_default_objective",
    "register_evaluation_hook",
    "STAGE_POINTS",
]

STAGE_POINTS = ("epoch_end", "early_end", "end")
"""The points where the Trainer offers its objective a prune (:meth:`Objective.prunes_at`)."""

DefaultObjectiveFactory = Callable[[nn.Module], "Objective | None"]
_DEFAULT_FACTORIES: list[DefaultObjectiveFactory] = []
_EVALUATION_HOOKS: list[Callable[[], None]] = []


class Objective:
    """The base protocol; as it stands, the task loss alone (:class:`TaskObjective`).

    Args:
        model: the (unwrapped) model the Trainer trains.

    Attributes:
        name: short name written into the run's records and checkpoints (``"task"``, ``"comera"``).
        has_stages: whether the objective has an early and a late stage (then ``config.late`` steps run the
            late stage; without stages the run is ``early + late`` steps of the same objective).
        prunes: whether the objective ever changes the model's shapes (:meth:`prune`).
        initial_size: :meth:`size` when the objective was built (at least 1).
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

    def check_stages(self, *, early: int, late: int) -> None:
        """Check the run's stage lengths (``config.early``, ``config.late``) against the objective's settings;
        ``ValueError`` naming the setting. Nothing to check here."""

    def set_precision(self, precision: str) -> None:
        """Adapt the model to the run's ``config.precision`` (``"fp32"``, ``"bf16"``, ``"fp8"``); here
        nothing (autocast is the Trainer's)."""

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The optimised 0-dim scalar for a 0-dim ``task_loss`` (differentiable, no host sync)."""
        if not isinstance(task_loss, torch.Tensor) or task_loss.dim() != 0:
            raise ValueError(f"task_loss must be a 0-dim tensor, got {task_loss!r}")
        return task_loss

    def size(self) -> int:
        """The model size the records report: trainable parameter entries (shared ones once)."""
        return sum(param.numel() for param in trainable_parameters(self.model.parameters()))

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

    def param_groups(self, *, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """Parameter groups of the Trainer's default AdamW (``lr``: ``config.lr_other``): here one group
        ``"other"`` with every trainable parameter (shared ones once)."""
        params = trainable_parameters(self.model.parameters())
        return [{"name": "other", "params": params, "lr": lr, "weight_decay": weight_decay}] if params else []

    def begin_late_stage(self, *, late_steps: int | None = None) -> dict[str, Any]:
        """Enter the late stage, which lasts ``late_steps`` steps (None: open-ended); returns the details
        logged with the event. Only for staged objectives."""
        raise RuntimeError(f"the {self.name!r} objective has no late stage")

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Host-side work after an applied optimizer step; an event dict to log (its ``"changed"`` entry says
        whether parameters or structure changed, so a captured graph must be dropped), or None."""
        return None

    def prunes_at(self, point: str) -> bool:
        """Whether to prune at ``point``, one of :data:`STAGE_POINTS` (never, here)."""
        return False

    def prune(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """Physically shrink the model (and ``optimizer``'s state) now; the details of the ``"prune"`` event
        when shapes changed, else None (nothing to prune, here)."""
        return None

    def structure(self) -> dict[str, Any]:
        """What a checkpoint records about the model's shapes beyond its constructor's (none here)."""
        return {}

    def apply_structure(self, structure: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> None:
        """Bring a freshly built model to the shapes :meth:`structure` recorded, before its state dict is
        loaded. Nothing to do here: an objective that never changes shapes records none."""

    def whole_parameters(self) -> list[torch.Tensor]:
        """The parameters this objective reads between steps (none here); a sharded run keeps them whole on
        every rank (``TrainConfig.shard_cores``)."""
        return []

    def leaves_parameters_unused(self) -> bool:
        """Whether the model, as it stands, may hold parameters that the loss does not reach (what fed only a
        layer a prune removed gets no gradient); a DDP run then looks for them at each step. False here:
        the model keeps the shapes it was built with."""
        return False

    def rebind(self, model: nn.Module) -> None:
        """Train ``model`` from now on: a copy of the model with other shapes, built by the Trainer when it
        cannot prune a sharded model in place. The objective's own state carries over."""
        self.model = model

    def check_structure(self, structure: object) -> None:
        """``ValueError`` unless ``structure`` has the form :meth:`structure` records (an edited or foreign
        checkpoint may hold anything): here a mapping."""
        if not isinstance(structure, Mapping):
            raise ValueError(
                f"its structure record is not a mapping of layers (got {type(structure).__name__})"
            )

    def structure_shapes(self, structure: dict[str, Any]) -> dict[int, tuple[int, ...] | None]:
        """The shape each parameter would have after :meth:`apply_structure` of ``structure`` (None: it would
        be gone), keyed by the ``id`` of the parameter (none here: nothing changes shape). Lets a checkpoint
        be checked against its structure before anything is changed."""
        return {}

    def before_evaluation(self) -> None:
        """Run before every evaluation: here every hook of :func:`register_evaluation_hook`."""
        for hook in _EVALUATION_HOOKS:
            hook()

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
    """The task loss alone: the objective of every baseline (dense, GaLore, LTE, APOLLO, CoLA); its
    ``size()`` counts trainable parameter entries, with no stages, no pruning and one parameter group.
    """


def register_default_objective(factory: DefaultObjectiveFactory) -> DefaultObjectiveFactory:
    """Let ``factory(model) -> Objective | None`` pick the objective of a Trainer built without one (newest
    factory first; registering the same function again does nothing).
    """
    if not callable(factory):
        raise TypeError(f"factory must be callable as factory(model), got {type(factory).__name__}")
    if factory not in _DEFAULT_FACTORIES:
        _DEFAULT_FACTORIES.append(factory)
    return factory


def register_evaluation_hook(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook()`` before every evaluation of every Trainer (:meth:`Objective.before_evaluation`);
    registering the same function again does nothing."""
    if not callable(hook):
        raise TypeError(f"hook must be callable as hook(), got {type(hook).__name__}")
    if hook not in _EVALUATION_HOOKS:
        _EVALUATION_HOOKS.append(hook)
    return hook


def default_objective(model: nn.Module) -> Objective:
    """The objective of a Trainer built without one: the newest registered factory's that returns one (see
    :func:`register_default_objective`), else :class:`TaskObjective`."""
    for factory in reversed(_DEFAULT_FACTORIES):
        objective = factory(model)
        if objective is not None:
            return objective
    return TaskObjective(model)
