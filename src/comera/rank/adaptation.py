"""``RankAdaptation``: CoMERA's objective for a model with gated layers: task loss plus ``gamma`` times a size
surrogate in the early stage, then a late-stage controller that lands the size on a target (descend by dual
ascent, exact trim, recover); :meth:`RankAdaptation.loss` is tensors only (it may sit inside a compiled or
graph-captured step) and :meth:`RankAdaptation.after_step`, the controller, runs on the host after every
optimizer step (docs/method.md section 4; docs/training.md, "Late stage")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from comera.checks import check_number
from comera.nn.gated import GatedTrain
from comera.rank.size import gated_trains, total_size
from comera.rank.surrogate import SURROGATES, mean_gate_surrogate, size_surrogate
from comera.rank.trim import TrimChoice, choose_entries, hold_entries

__all__ = [
    "RankAdaptation",
    "LateStageEvent",
    "LOSS_TOLERANCE",
    "DUAL_RATE",
    "MAX_SIZE_WEIGHT",
    "TRIM_MARGIN",
    "TARGET_TOLERANCE",
    "DEFAULT_RECOVERY",
    "DEFAULT_TRIMS",
]

LOSS_TOLERANCE = 0.05
DUAL_RATE = 0.01
MAX_SIZE_WEIGHT = 100.0
TRIM_MARGIN = 0.1
TARGET_TOLERANCE = 0.05
DEFAULT_RECOVERY = 0.3
DEFAULT_TRIMS = 8
_MIN_HOLD_FLOOR = 1e-3
_DEFAULT_EMA = 0.98
_STAGES = ("early", "late")
_PHASES = ("early", "descend", "recover")


@dataclass(frozen=True)
class LateStageEvent(Mapping):
    """What :meth:`RankAdaptation.after_step` did at ``step`` when it changed the gates: ``action="trim"``
    (the cut to the target ``target_size``, then recovery) or ``"partial_trim"`` (a gradual trim to its part's
    budget), the exact sizes around it, the live entries ``removed`` and the dead ones ``revived``. It also
    reads as a mapping for event logs (those keys, ``changed=True`` and ``target_reached``; no ``step``)."""

    action: str
    step: int
    size_before: int
    size_after: int
    target_size: float
    removed: int
    revived: int

    def _entries(self) -> dict:
        return {
            "action": self.action,
            "changed": True,
            "size_before": self.size_before,
            "size_after": self.size_after,
            "target_size": self.target_size,
            "removed": self.removed,
            "revived": self.revived,
            "target_reached": self.size_after <= (1.0 + TARGET_TOLERANCE) * self.target_size,
        }

    def __getitem__(self, key: str):
        return self._entries()[key]

    def __iter__(self):
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


def _masks_on_gates(named: list[tuple[str, GatedTrain]], choice: TrimChoice) -> dict[str, list[torch.Tensor]]:
    """``{layer name: keep masks}`` of a :class:`~comera.rank.trim.TrimChoice` over the ``(name, train)``
    pairs it was chosen for, each mask on its gate's device."""
    return {
        name: [mask.to(gate.device) for mask, gate in zip(masks, train.gate_list())]
        for (name, train), masks in zip(named, choice.keep)
    }


def _common_tau(trains: list[GatedTrain]) -> float:
    """The gate threshold of the gated layers, which own it (``TensorizeConfig.tau``, a layer's ``tau``)."""
    taus = sorted({float(train.tau) for train in trains})
    if len(taus) > 1:
        raise ValueError(
            f"the model's gated layers use different gate thresholds {taus}; build them with one "
            "(TensorizeConfig.tau, tensorize.tau) or set every layer's tau to one value"
        )
    return taus[0]


class RankAdaptation:
    """The CoMERA objective for a model whose tensorized layers carry rank gates.

    Args:
        model: a model containing :class:`comera.GatedTrain` layers (``TTLinear``, ``TTMLinear``, ...).
        gamma: weight of the size surrogate in the early stage (>= 0).
        surrogate: ``"size"`` (size-weighted l1 of the masked gates over the initial size) or ``"mean_gate"``
            (the reference code's mean live gate value), see :mod:`comera.rank.surrogate`.

    Attributes:
        tau: the gate threshold, read from the gated layers (which own it; all must use one).
        initial_size: exact active-rank size (core entries) when this object was made; normalises ``"size"``.
        target_size, target_loss: ``S*`` and ``L*`` of the late stage (None before it).
        start_size: ``S_0``, the exact size when the late stage began (None before it).
        aim_size: 0-dim tensor, the size the late-stage switch compares with: ``S*``, or with gradual trims
            the next part's budget (updated in place by the controller step).
        trims: the number of gradual-trim parts of the descend window (1: one trim, to the target).
        switch: 0-dim tensor, 1.0 when the last late-stage step weighted the size term, else 0.0.
        size_weight: 0-dim tensor, the dual weight ``w`` of the size term in the descend phase (1.0 at the
            start of the late stage; updated in place by the controller step).
        reached_at_step: the step at which the size first was at most ``(1 + TARGET_TOLERANCE) * target_size``
            in the current late stage (the ``step`` given to :meth:`after_step`), else None.
        events: every :class:`LateStageEvent` of the controller, oldest first. Not in :meth:`state_dict`.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 4))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> adaptation = comera.RankAdaptation(model, gamma=0.01)  # loss = task loss + gamma * size surrogate
        >>> groups = comera.param_groups(model, lr_cores=1e-3, lr_gates=1e-2, lr_other=1e-3)
        >>> optimizer = torch.optim.AdamW(groups)
        >>> x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
        >>> def train(steps):
        ...     for step in range(steps):
        ...         loss = adaptation.loss(nn.functional.cross_entropy(model(x), y))
        ...         optimizer.zero_grad()
        ...         loss.backward()
        ...         optimizer.step()
        ...         _ = adaptation.after_step(step)  # the late-stage controller (nothing in the early stage)
        >>> train(3)  # the early stage
        >>> adaptation.begin_late_stage(target_ratio=0.5, late_steps=20)  # land on half the size
        >>> train(20)
        >>> adaptation.phase, adaptation.size() <= 1.05 * adaptation.target_size
        ('recover', True)
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        gamma: float = 0.01,
        surrogate: str = "size",
    ):
        self.gamma = check_number(gamma, "gamma", 0.0, math.inf, open_high=True)
        if surrogate not in SURROGATES:
            raise ValueError(f"surrogate must be one of {SURROGATES}, got {surrogate!r}")
        self.surrogate = surrogate
        self.model = model
        trains = self._trains()
        if not trains:
            raise ValueError(
                "model has no gated layers (TTLinear, TTMLinear, ...); call comera.tensorize_ first"
            )
        self.tau = _common_tau(trains)
        self.initial_size = int(total_size(model))
        if self.initial_size == 0:
            raise ValueError("model has size 0: every gated layer has a dead bond")
        gate = trains[0].gates[0]
        state_dtype = torch.promote_types(gate.dtype, torch.float32)
        self._ema_sum = torch.zeros((), dtype=state_dtype, device=gate.device)
        self._ema_weight = torch.zeros((), dtype=state_dtype, device=gate.device)
        self.switch = torch.zeros((), dtype=state_dtype, device=gate.device)
        self.size_weight = torch.ones((), dtype=state_dtype, device=gate.device)
        self.aim_size = torch.zeros((), dtype=state_dtype, device=gate.device)
        self._ema = _DEFAULT_EMA
        self._stage = "early"
        self._phase = "early"
        self.target_size: float | None = None
        self.target_loss: float | None = None
        self.rho: tuple[float, float] = (0.1, 0.01)
        self.late_steps: int | None = None
        self.recovery = DEFAULT_RECOVERY
        self.trims = DEFAULT_TRIMS
        self.start_size: int | None = None
        self._trim_part = 0
        self.reached_at_step: int | None = None
        self._late_count = 0
        self._keep: dict[str, list[torch.Tensor]] | None = None
        self.events: list[LateStageEvent] = []

    def _named_trains(self):
        return [(name, train) for name, train in gated_trains(self.model) if len(train.gates)]

    def _trains(self):
        return [train for _, train in self._named_trains()]

    def _live_named_trains(self):
        """The gated layers whose every bond has a live entry: a layer with a dead bond has size 0 already
        (it is removed at the next prune), so the trim neither counts nor holds it."""
        return [
            (name, train)
            for name, train in self._named_trains()
            if all(bool((gate.detach().abs() > train.tau).any()) for gate in train.gate_list())
        ]

    @property
    def stage(self) -> str:
        """``"early"`` (weighted sum) or ``"late"`` (achievement scalarisation)."""
        return self._stage

    @property
    def phase(self) -> str:
        """``"early"``, or in the late stage ``"descend"`` (before the trim) or ``"recover"`` (after it)."""
        return self._phase

    @property
    def target_reached(self) -> bool:
        """Whether the size has been at most ``(1 + TARGET_TOLERANCE) * target_size`` at an
        :meth:`after_step` of the current late stage (no host sync)."""
        return self.reached_at_step is not None

    def size(self) -> int:
        """Exact core entries of the active-rank model now (syncs with the device)."""
        return int(total_size(self.model))

    def ratio(self) -> float:
        """Current size over :attr:`initial_size` (1.0 at the start; 0.2 means five times smaller)."""
        return self.size() / self.initial_size

    def smoothed_loss(self) -> float | None:
        """The bias-corrected moving average of the task losses seen by :meth:`loss`, or None (syncs)."""
        weight = float(self._ema_weight)
        return None if weight == 0 else float(self._ema_sum) / weight

    def loss_average_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the loss moving average's state, for :meth:`restore_loss_average` (no host sync)."""
        return self._ema_sum.clone(), self._ema_weight.clone()

    def restore_loss_average(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Put back a state from :meth:`loss_average_state`, e.g. after a step that was skipped."""
        self._ema_sum.copy_(state[0])
        self._ema_weight.copy_(state[1])

    def device_state(self) -> list[torch.Tensor]:
        """The device tensors :meth:`loss` updates in place (loss average and switch), for callers that must
        undo a step, e.g. a CUDA-graph warm-up."""
        return [self._ema_sum, self._ema_weight, self.switch]

    def size_surrogate(self) -> torch.Tensor:
        """The differentiable size term ``S_hat`` (0-dim tensor)."""
        trains = self._trains()
        if self.surrogate == "size":
            return size_surrogate(trains, self.initial_size)
        return mean_gate_surrogate(trains)

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        """The scalarised objective of the current stage for a 0-dim ``task_loss`` (differentiable); a
        non-finite ``task_loss`` leaves the loss average untouched and gives a non-finite objective."""
        if not isinstance(task_loss, torch.Tensor) or task_loss.dim() != 0:
            raise ValueError(f"task_loss must be a 0-dim tensor, got {task_loss!r}")
        observed = task_loss.detach().to(self._ema_sum.dtype)
        finite = torch.isfinite(observed)
        decay = torch.where(finite, self._ema, 1.0)
        self._ema_sum.mul_(decay).add_(torch.where(finite, observed, 0.0) * (1.0 - decay))
        self._ema_weight.mul_(decay).add_(1.0 - decay)
        if self._phase == "recover":
            self.switch.zero_()
            return task_loss
        surrogate = self.size_surrogate().to(task_loss.dtype)
        if self._stage == "early":
            return task_loss + self.gamma * surrogate
        smoothed = self._ema_sum / self._ema_weight
        size = total_size(self.model).to(smoothed.dtype)
        tiny = torch.finfo(smoothed.dtype).tiny
        loss_gap = (smoothed - self._late_target_loss) / smoothed.abs().clamp_min(tiny)
        size_gap = (size - self.aim_size) / size.clamp_min(1.0)
        switch = (loss_gap < size_gap).to(smoothed.dtype)
        self.switch.copy_(switch)
        switch = switch.to(task_loss.dtype)
        rho_loss, rho_size = self.rho
        weighted = self.size_weight.to(task_loss.dtype) * surrogate
        return rho_loss * task_loss + (rho_size + switch) * weighted + (1.0 - switch) * task_loss

    # The late stage's settings, set by begin_late_stage (None before it) and read only while it runs.
    @property
    def _late_target_size(self) -> float:
        return cast(float, self.target_size)

    @property
    def _late_target_loss(self) -> float:
        return cast(float, self.target_loss)

    def _reach_size(self) -> float:
        return (1.0 + TARGET_TOLERANCE) * self._late_target_size

    def _hold_floor(self) -> float:
        return max(2.0 * self.tau, _MIN_HOLD_FLOOR)

    def _deadline_passed(self) -> bool:
        if self.late_steps is None:
            return False
        return self._late_count >= math.ceil((1.0 - self.recovery) * self.late_steps)

    def _hold(self) -> None:
        named = self._live_named_trains()
        masks = self._keep or {}
        for name, train in named:
            kept = masks.get(name)
            if kept is None or [m.shape for m in kept] != [g.shape for g in train.gate_list()]:
                kept = [(gate.detach().abs() > train.tau) for gate in train.gate_list()]
                masks[name] = kept
        self._keep = {name: masks[name] for name, _ in named}
        hold_entries([train for _, train in named], list(self._keep.values()), self._hold_floor())

    def after_step(self, step: int) -> LateStageEvent | None:
        """The late-stage controller's step, once after every optimizer step, outside any compiled or
        graph-captured step: nothing in the early stage; in the descend phase one host sync, the dual weight
        raised or a trim; in the recover phase the held structure written back into the gates. A returned
        :class:`LateStageEvent` (also in :attr:`events`) means gate values and the objective changed:
        recapture a graph-captured step, prune to make the cut real. ``step``: the caller's step counter (any
        int, recorded in :attr:`reached_at_step` and the event); docs/training.md, "Late stage"."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an int, got {step!r}")
        return self._control(step)

    def _descend_length(self) -> int:
        return math.ceil((1.0 - self.recovery) * cast(int, self.late_steps))

    def _part(self) -> int:
        """The gradual-trim part the descend phase is in (0 before the first budget or without a schedule)."""
        if self.late_steps is None or self.start_size is None or self.trims <= 1:
            return 0
        return min(self.trims - 1, self._late_count * self.trims // max(1, self._descend_length()))

    def _part_budget(self, part: int) -> float:
        start = cast(int, self.start_size)
        return start * (self._late_target_size / start) ** (part / self.trims)

    def _aim(self) -> float:
        """The size the switch and the dual weight aim at now: the next part's budget, else ``S*``."""
        part = self._part()
        if self.late_steps is None or self.start_size is None or self.trims <= 1 or part + 1 >= self.trims:
            return self._late_target_size
        return self._part_budget(part + 1)

    @torch.no_grad()
    def _zero_dropped(self) -> None:
        """Hold the entries an earlier gradual trim dropped at 0 (Adam's momentum would move them)."""
        if self._keep is None:
            return
        for name, train in self._named_trains():
            kept = self._keep.get(name)
            if kept is None or [m.shape for m in kept] != [g.shape for g in train.gate_list()]:
                continue
            for gate, mask in zip(train.gate_list(), kept):
                gate.masked_fill_(~mask.to(gate.device), 0.0)

    def _gradual_trim(self, step: int, size: int) -> LateStageEvent | None:
        """Cut to the current part's budget at the first step of a part whose budget ``size`` exceeds;
        otherwise hold the entries earlier cuts dropped at 0."""
        event = None
        part = self._part()
        if part > self._trim_part:
            self._trim_part = part
            event = self._cut_to(step, size, self._part_budget(part))
        if event is None:
            self._zero_dropped()
        return event

    def _cut_to(self, step: int, size: int, budget: float) -> LateStageEvent | None:
        """A ``"partial_trim"`` of the live layers to ``budget`` (kept entries lifted to the hold floor), or
        None when the size is within it or the search finds nothing smaller."""
        named = self._live_named_trains()
        if size <= budget or not named:
            return None
        choice = choose_entries([train for _, train in named], budget)
        if choice.size >= size:
            return None
        self._keep = {**(self._keep or {}), **_masks_on_gates(named, choice)}
        hold_entries(
            [train for _, train in named], [self._keep[name] for name, _ in named], self._hold_floor()
        )
        event = LateStageEvent(
            "partial_trim", step, size, choice.size, budget, choice.removed, choice.revived
        )
        self.events.append(event)
        return event

    def _control(self, step: int) -> LateStageEvent | None:
        if self._stage == "early":
            return None
        if self._phase == "recover":
            self._hold()
            return None
        self._late_count += 1
        size = self.size()
        if size <= self._reach_size() and self.reached_at_step is None:
            self.reached_at_step = step
        if size > (1.0 + TRIM_MARGIN) * self._late_target_size and not self._deadline_passed():
            aim = self._aim()
            self.aim_size.fill_(aim)
            if size > aim:
                gap = min(1.0, size / aim - 1.0)
                weight = min(MAX_SIZE_WEIGHT, float(self.size_weight) * math.exp(DUAL_RATE * gap))
                self.size_weight.fill_(weight)
            return self._gradual_trim(step, size)
        named = self._live_named_trains()
        trains = [train for _, train in named]
        if not trains:
            return None
        target = self._late_target_size
        choice = choose_entries(trains, target)
        if choice.size < (1.0 - TARGET_TOLERANCE) * target:
            above = choose_entries(trains, (1.0 + TARGET_TOLERANCE) * target)
            if abs(above.size - target) < abs(choice.size - target):
                choice = above
        self._keep = _masks_on_gates(named, choice)
        self._hold()
        self._phase = "recover"
        if choice.size <= self._reach_size() and self.reached_at_step is None:
            self.reached_at_step = step
        event = LateStageEvent("trim", step, size, choice.size, target, choice.removed, choice.revived)
        self.events.append(event)
        return event

    def begin_late_stage(
        self,
        target_ratio: float,
        target_loss: float | None = None,
        rho: tuple[float, float] = (0.1, 0.01),
        ema: float = _DEFAULT_EMA,
        *,
        late_steps: int | None = None,
        recovery: float = DEFAULT_RECOVERY,
        trims: int = DEFAULT_TRIMS,
    ) -> None:
        """Switch to the late stage with ``S* = target_ratio * size()`` and ``L*`` = ``target_loss`` or 1.05 x
        the smoothed loss now; may be called again for a new target from the current size (docs/training.md,
        "Late stage").

        Args:
            target_ratio: fraction of the current exact size to reach, in (0, 1].
            target_loss: ``L*`` (> 0); default the smoothed task loss times ``1 + LOSS_TOLERANCE``.
            rho: augmentation weights ``(rho_L, rho_S)`` on the loss and the size surrogate (each >= 0).
            ema: decay of the loss moving average used by the switch, in [0, 1).
            late_steps: controller steps of the late stage; the trim comes at the latest after
                ``ceil((1 - recovery) * late_steps)`` of them. None: no deadline.
            recovery: fraction of ``late_steps`` kept for recovery after the latest trim, in [0, 1).
            trims: equal parts of the descend window, each with its own size budget (needs ``late_steps``),
                an int >= 1; 1 trims once, to the target.
        """
        target_ratio = check_number(target_ratio, "target_ratio", 0.0, 1.0, open_low=True)
        if target_loss is not None:
            target_loss = check_number(
                target_loss, "target_loss", 0.0, math.inf, open_low=True, open_high=True
            )
        if not isinstance(rho, (tuple, list)) or len(rho) != 2:
            raise ValueError(f"rho must be a pair (rho_loss, rho_size) of numbers >= 0, got {rho!r}")
        rho = (
            check_number(rho[0], "rho", 0.0, math.inf, open_high=True),
            check_number(rho[1], "rho", 0.0, math.inf, open_high=True),
        )
        ema = check_number(ema, "ema", 0.0, 1.0, open_high=True)
        if late_steps is not None and (
            isinstance(late_steps, bool) or not isinstance(late_steps, int) or late_steps < 1
        ):
            raise ValueError(f"late_steps must be an int >= 1 or None, got {late_steps!r}")
        recovery = check_number(recovery, "recovery", 0.0, 1.0, open_high=True)
        if isinstance(trims, bool) or not isinstance(trims, int) or trims < 1:
            raise ValueError(f"trims must be an int >= 1, got {trims!r}")
        size = self.size()
        if size == 0:
            raise ValueError(
                "cannot begin the late stage: the model has size 0 (every layer has a dead bond)"
            )
        if target_loss is None:
            smoothed = self.smoothed_loss()
            if smoothed is None:
                raise ValueError("target_loss is required when loss() has not been called yet")
            target_loss = smoothed * (1.0 + LOSS_TOLERANCE)
        self.target_size = target_ratio * size
        self.target_loss = target_loss
        self.rho = rho
        self._ema = ema
        self.late_steps = late_steps
        self.recovery = recovery
        self.trims = trims
        self.start_size = size
        self._trim_part = 0
        self._late_count = 0
        self.aim_size.fill_(self._aim())
        self._stage = "late"
        self._phase = "descend"
        self._keep = None
        self.reached_at_step = None
        self.size_weight.fill_(1.0)

    def state_dict(self) -> dict:
        """Everything needed to resume: stage, targets, constants and the loss average (Python numbers)."""
        return {
            "stage": self._stage,
            "gamma": self.gamma,
            "surrogate": self.surrogate,
            "initial_size": self.initial_size,
            "target_size": self.target_size,
            "target_loss": self.target_loss,
            "rho": list(self.rho),
            "ema": self._ema,
            "ema_sum": float(self._ema_sum),
            "ema_weight": float(self._ema_weight),
            "phase": self._phase,
            "size_weight": float(self.size_weight),
            "late_steps": self.late_steps,
            "recovery": self.recovery,
            "late_count": self._late_count,
            "trims": self.trims,
            "start_size": self.start_size,
            "trim_part": self._trim_part,
            "reached_at_step": self.reached_at_step,
            "keep": None
            if self._keep is None
            else {name: [mask.tolist() for mask in masks] for name, masks in self._keep.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; a state without one of its keys (written by an earlier
        comera) raises ``KeyError`` naming the missing keys."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise KeyError(f"RankAdaptation state is missing keys {missing} (a state of an earlier comera?)")
        if state["stage"] not in _STAGES:
            raise ValueError(f"state['stage'] must be one of {_STAGES}, got {state['stage']!r}")
        self._stage = state["stage"]
        self.initial_size = int(state["initial_size"])
        self.target_size = state["target_size"]
        self.target_loss = state["target_loss"]
        self.rho = tuple(state["rho"])
        self._ema = float(state["ema"])
        self._ema_sum.fill_(state["ema_sum"])
        self._ema_weight.fill_(state["ema_weight"])
        phase = state["phase"]
        if phase not in _PHASES or (phase == "early") != (self._stage == "early"):
            raise ValueError(f"state['phase'] must be one of {_PHASES} matching the stage, got {phase!r}")
        self._phase = phase
        self.size_weight.fill_(state["size_weight"])
        self.late_steps = state["late_steps"]
        self.recovery = float(state["recovery"])
        self._late_count = int(state["late_count"])
        self.trims = int(state["trims"])
        self.start_size = state["start_size"]
        self._trim_part = int(state["trim_part"])
        if self.target_size is not None:
            self.aim_size.fill_(self._aim())
        self.reached_at_step = state["reached_at_step"]
        keep = state["keep"]
        devices = {name: train.gate_list()[0].device for name, train in self._named_trains()}
        self._keep = (
            None
            if keep is None
            else {
                name: [torch.tensor(mask, dtype=torch.bool, device=devices.get(name)) for mask in masks]
                for name, masks in keep.items()
            }
        )
