"""Rank-adaptive multi-objective training: task loss against model size (docs/method.md section 4).

Early stage (weighted sum):  ``loss = L + gamma * S_hat``.

Late stage (achievement scalarisation toward ``z = (L*, S*)``, handled by a switch as in the reference code):
``lambda = 1[(L_ema - L*) / L_ema < (S - S*) / S]`` and
``loss = rho_L * L + rho_S * S_hat + lambda * S_hat + (1 - lambda) * L``, where ``S`` is the exact size of the
active-rank model, ``S_hat`` the differentiable surrogate and ``L_ema`` a bias-corrected exponential moving
average of the task loss (it damps batch noise in the switch; the gradient still flows through ``L``). The
objective that is further from its target in relative terms gets unit weight.

:meth:`RankAdaptation.loss` uses tensors only (no ``.item()``, no ``.ranks``), so a compiled or
graph-captured training step can contain it; stage changes happen outside the step, so recompile/recapture
after :meth:`RankAdaptation.begin_late_stage`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from comera.nn.gated import check_tau
from comera.rank.size import gated_trains, total_size
from comera.rank.surrogate import SURROGATES, mean_gate_surrogate, size_surrogate

__all__ = ["RankAdaptation", "LOSS_TOLERANCE"]

LOSS_TOLERANCE = 0.05
_DEFAULT_EMA = 0.98
_STAGES = ("early", "late")


def _check_number(
    value: object, name: str, low: float, high: float, closed_low=True, closed_high=True
) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value >= low if closed_low else value > low) and (
            value <= high if closed_high else value < high
        )
    if not ok:
        interval = f"{'[' if closed_low else '('}{low}, {high}{']' if closed_high else ')'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return float(value)


class RankAdaptation:
    """The CoMERA objective for a model whose tensorized layers carry rank gates.

    Args:
        model: a model containing :class:`comera.GatedTrain` layers (``TTLinear``, ``TTMLinear``, ...).
        gamma: weight of the size surrogate in the early stage (>= 0).
        tau: gate threshold; written to every gated layer so that the forward mask and the size count agree.
        surrogate: ``"size"`` (size-weighted l1 of the masked gates over the initial size) or ``"mean_gate"``
            (the reference code's mean live gate value), see :mod:`comera.rank.surrogate`.

    Attributes:
        initial_size: exact active-rank size (core entries) when this object was made; normalises ``"size"``.
        target_size, target_loss: ``S*`` and ``L*`` of the late stage (None before it).
        switch: 0-dim tensor, 1.0 when the last late-stage step weighted the size term, else 0.0.
    """

    def __init__(self, model: nn.Module, *, gamma: float = 0.01, tau: float = 1e-2, surrogate: str = "size"):
        self.gamma = _check_number(gamma, "gamma", 0.0, math.inf, closed_high=False)
        tau = check_tau(tau)
        if surrogate not in SURROGATES:
            raise ValueError(f"surrogate must be one of {SURROGATES}, got {surrogate!r}")
        self.surrogate = surrogate
        self.model = model
        trains = self._trains()
        if not trains:
            raise ValueError(
                "model has no gated layers (TTLinear, TTMLinear, ...); call comera.tensorize_ first"
            )
        for train in trains:
            train.tau = tau
        self.tau = tau
        self.initial_size = int(total_size(model))
        if self.initial_size == 0:
            raise ValueError("model has size 0: every gated layer has a dead bond")
        gate = trains[0].gates[0]
        state_dtype = torch.promote_types(gate.dtype, torch.float32)
        self._ema_sum = torch.zeros((), dtype=state_dtype, device=gate.device)
        self._ema_weight = torch.zeros((), dtype=state_dtype, device=gate.device)
        self.switch = torch.zeros((), dtype=state_dtype, device=gate.device)
        self._ema = _DEFAULT_EMA
        self._stage = "early"
        self.target_size: float | None = None
        self.target_loss: float | None = None
        self.rho: tuple[float, float] = (0.1, 0.01)

    def _trains(self):
        return [train for _, train in gated_trains(self.model) if len(train.gates)]

    @property
    def stage(self) -> str:
        """``"early"`` (weighted sum) or ``"late"`` (achievement scalarisation)."""
        return self._stage

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
        """The scalarised objective of the current stage for a 0-dim ``task_loss`` (differentiable).

        A non-finite ``task_loss`` leaves the loss moving average untouched (and the returned objective
        non-finite, for the caller to skip the step).
        """
        if not isinstance(task_loss, torch.Tensor) or task_loss.dim() != 0:
            raise ValueError(f"task_loss must be a 0-dim tensor, got {task_loss!r}")
        observed = task_loss.detach().to(self._ema_sum.dtype)
        finite = torch.isfinite(observed)
        decay = torch.where(finite, self._ema, 1.0)
        self._ema_sum.mul_(decay).add_(torch.where(finite, observed, 0.0) * (1.0 - decay))
        self._ema_weight.mul_(decay).add_(1.0 - decay)
        surrogate = self.size_surrogate().to(task_loss.dtype)
        if self._stage == "early":
            return task_loss + self.gamma * surrogate
        smoothed = self._ema_sum / self._ema_weight
        size = total_size(self.model).to(smoothed.dtype)
        loss_gap = (smoothed - self.target_loss) / smoothed.abs().clamp_min(torch.finfo(smoothed.dtype).tiny)
        size_gap = (size - self.target_size) / size.clamp_min(1.0)
        switch = (loss_gap < size_gap).to(smoothed.dtype)
        self.switch.copy_(switch)
        switch = switch.to(task_loss.dtype)
        rho_loss, rho_size = self.rho
        return rho_loss * task_loss + rho_size * surrogate + switch * surrogate + (1.0 - switch) * task_loss

    def begin_late_stage(
        self,
        target_ratio: float,
        target_loss: float | None = None,
        rho: tuple[float, float] = (0.1, 0.01),
        ema: float = _DEFAULT_EMA,
    ) -> None:
        """Switch to the late stage with ``S* = target_ratio * size()`` and ``L*`` = ``target_loss`` or 1.05 x
        the smoothed loss now. May be called again to set a new target from the current size.

        Args:
            target_ratio: fraction of the current exact size to reach, in (0, 1].
            target_loss: ``L*`` (> 0); default the smoothed task loss times ``1 + LOSS_TOLERANCE``.
            rho: augmentation weights ``(rho_L, rho_S)`` on the loss and the size surrogate (each >= 0).
            ema: decay of the loss moving average used by the switch, in [0, 1).
        """
        target_ratio = _check_number(target_ratio, "target_ratio", 0.0, 1.0, closed_low=False)
        if target_loss is not None:
            target_loss = _check_number(target_loss, "target_loss", 0.0, math.inf, False, False)
        if not isinstance(rho, (tuple, list)) or len(rho) != 2:
            raise ValueError(f"rho must be a pair (rho_loss, rho_size) of numbers >= 0, got {rho!r}")
        rho = tuple(_check_number(value, "rho", 0.0, math.inf, closed_high=False) for value in rho)
        ema = _check_number(ema, "ema", 0.0, 1.0, closed_high=False)
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
        self._stage = "late"

    def state_dict(self) -> dict:
        """Everything needed to resume: stage, targets, constants and the loss average (Python numbers)."""
        return {
            "stage": self._stage,
            "gamma": self.gamma,
            "tau": self.tau,
            "surrogate": self.surrogate,
            "initial_size": self.initial_size,
            "target_size": self.target_size,
            "target_loss": self.target_loss,
            "rho": list(self.rho),
            "ema": self._ema,
            "ema_sum": float(self._ema_sum),
            "ema_weight": float(self._ema_weight),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = {
            "stage",
            "initial_size",
            "target_size",
            "target_loss",
            "rho",
            "ema",
            "ema_sum",
            "ema_weight",
        }
        missing -= set(state)
        if missing:
            raise KeyError(f"RankAdaptation state is missing keys {sorted(missing)}")
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
