"""``CoMERAObjective``: CoMERA's rank-adaptive objective (docs/method.md section 4) behind the hooks of
:class:`comera.train.objective.Objective`: the early and late stages of :class:`comera.RankAdaptation`, the
prune points of :attr:`CoMERASettings.prune_at`, the pruned structure a checkpoint records, the cores and
gates learning rates, and the FP8 switch of ``TTLinear``. (The layers' inference caches are dropped before
every evaluation by the hook :mod:`comera.methods` registers for every objective.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from comera.methods.comera.settings import CoMERASettings
from comera.methods.comera.structure import apply_structure, model_structure
from comera.nn.linear import TTLinear
from comera.rank.adaptation import RankAdaptation
from comera.rank.groups import param_groups
from comera.rank.prune import prune_
from comera.rank.size import gated_trains
from comera.train.objective import Objective

__all__ = ["CoMERAObjective", "gated_model_objective"]


class CoMERAObjective(Objective):
    """CoMERA's rank-adaptive objective: :class:`comera.RankAdaptation` wrapped.

    Args:
        model: a model with gated layers (``TTLinear``, ``TTMLinear``, TTM embeddings).
        settings: CoMERA's settings (default :class:`CoMERASettings`).
        **overrides: fields of :class:`CoMERASettings` replaced in ``settings``
            (``CoMERAObjective(model, gamma=0.1)``).

    Attributes:
        settings: the resolved :class:`CoMERASettings`.
        adaptation: the wrapped :class:`comera.RankAdaptation`; the Trainer runs its late-stage controller
            through :meth:`after_step` after every applied step, outside the compiled or graph-captured step.
    """

    name = "comera"
    has_stages = True
    prunes = True

    def __init__(self, model: nn.Module, settings: CoMERASettings | None = None, **overrides: Any) -> None:
        if settings is None:
            settings = CoMERASettings()
        if not isinstance(settings, CoMERASettings):
            raise TypeError(f"settings must be a CoMERASettings or None, got {type(settings).__name__}")
        unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(CoMERASettings)})
        if unknown:
            raise TypeError(
                f"unknown CoMERAObjective arguments {unknown}; CoMERASettings fields: "
                f"{[field.name for field in dataclasses.fields(CoMERASettings)]}"
            )
        self.settings = dataclasses.replace(settings, **overrides) if overrides else settings
        self.adaptation = RankAdaptation(model, gamma=self.settings.gamma, surrogate=self.settings.surrogate)
        super().__init__(model)
        self.initial_size = self.adaptation.initial_size

    @property
    def stage(self) -> str:
        return self.adaptation.stage

    def check_stages(self, *, early: int, late: int) -> None:
        """A late stage without an early one needs ``settings.target_loss`` (no loss to derive it from)."""
        if late > 0 and early == 0 and self.settings.target_loss is None:
            raise ValueError(
                "method.target_loss (CoMERASettings.target_loss) is required when train.early == 0 and "
                "train.late > 0 (no loss to derive it from)"
            )

    def set_precision(self, precision: str) -> None:
        """``"fp8"``: every ``TTLinear`` runs the batch-sized GEMMs of its merge order in FP8
        (``gemm="fp8"``: E4M3 operands, E5M2 gradients, per-tensor scales)."""
        if precision == "fp8":
            for layer in self.model.modules():
                if isinstance(layer, TTLinear):
                    layer.gemm = "fp8"

    def loss(self, task_loss: torch.Tensor) -> torch.Tensor:
        return self.adaptation.loss(task_loss)

    def size(self) -> int:
        """Exact core entries of the active-rank model (syncs with the device)."""
        return self.adaptation.size()

    def device_state(self) -> list[torch.Tensor]:
        return self.adaptation.device_state()

    def param_groups(self, *, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """CoMERA's groups (:func:`comera.param_groups`): cores at ``settings.lr_cores`` (per core under
        ``settings.core_rule="spectral"``), gates at ``settings.lr_gates`` (never decayed), everything else at
        ``lr``."""
        return param_groups(
            self.model,
            lr_cores=self.settings.lr_cores,
            lr_gates=self.settings.lr_gates,
            lr_other=lr,
            weight_decay=weight_decay,
            core_rule=self.settings.core_rule,
        )

    def begin_late_stage(self, *, late_steps: int | None = None) -> dict[str, Any]:
        """:meth:`comera.RankAdaptation.begin_late_stage` with the settings' ``target_ratio``,
        ``target_loss``, ``rho``, ``ema``, ``recovery`` and ``trims`` (with ``late_steps``, the deadline of
        the trim and the gradual trims' schedule)."""
        settings = self.settings
        self.adaptation.begin_late_stage(
            target_ratio=settings.target_ratio,
            target_loss=settings.target_loss,
            rho=settings.rho,
            ema=settings.ema,
            late_steps=late_steps,
            recovery=settings.recovery,
            trims=settings.trims,
        )
        return {"target_size": self.adaptation.target_size, "target_loss": self.adaptation.target_loss}

    def after_step(self, step: int) -> dict[str, Any] | None:
        hook = getattr(self.adaptation, "after_step", None)
        return None if hook is None else hook(step)

    def prunes_at(self, point: str) -> bool:
        """``"epoch_end"``: with ``"epoch"`` in ``prune_at``, or ``"late_epoch"`` in the late stage;
        ``"early_end"`` and ``"end"``: when named in ``prune_at``."""
        prune_at = self.settings.prune_at
        if point == "epoch_end":
            return "epoch" in prune_at or (self.stage == "late" and "late_epoch" in prune_at)
        return point in prune_at

    def prune(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """:func:`comera.prune_`; the event's sizes, removed layers and new ranks when shapes changed."""
        result = prune_(self.model, optimizer)
        if not result.changed:
            return None
        return {
            "stored_before": result.stored_before,
            "stored_after": result.stored_after,
            "removed": list(result.removed),
            "layers": {layer.name: list(layer.ranks_after) for layer in result.layers},
        }

    def structure(self) -> dict[str, Any]:
        """:func:`comera.methods.comera.structure.model_structure`: gated layers' ranks, removed layers."""
        return model_structure(self.model)

    def apply_structure(self, structure: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> None:
        apply_structure(self.model, structure, optimizer)

    def leaves_parameters_unused(self) -> bool:
        """True once a prune removed a layer (its weight is zero: what fed only it, or only scaled it, gets no
        gradient)."""
        return any(spec["removed"] for spec in self.structure().values())

    def whole_parameters(self) -> list[torch.Tensor]:
        """Every gate: the rank loss, the late-stage controller and the prune read them between steps."""
        return [gate for _, layer_train in gated_trains(self.model) for gate in layer_train.gates]

    def rebind(self, model: nn.Module) -> None:
        super().rebind(model)
        self.adaptation.model = model

    def check_structure(self, structure: object) -> None:
        """A mapping of layer name -> ``{"removed": bool, "ranks": list of ints}`` (:meth:`structure`),
        every rank at least 1 unless the layer is removed."""
        super().check_structure(structure)
        for name, spec in structure.items():
            ranks = spec.get("ranks") if isinstance(spec, dict) else None
            if (
                not isinstance(spec, dict)
                or not isinstance(spec.get("removed"), bool)
                or not isinstance(ranks, list)
                or not all(isinstance(rank, int) and not isinstance(rank, bool) for rank in ranks)
            ):
                raise ValueError(f"its structure record of layer {name!r} is malformed: {spec!r}")
            if not spec["removed"] and any(rank < 1 for rank in ranks):
                raise ValueError(
                    f"its structure record of layer {name!r} holds ranks {ranks}: a layer that is not "
                    "removed has every rank at least 1"
                )

    def structure_shapes(self, structure: dict[str, Any]) -> dict[int, tuple[int, ...] | None]:
        """Core ``k`` of a recorded layer keeps its mode sizes between bonds ``k`` and ``k + 1`` of the
        recorded ranks (1 at the ends); gate ``k`` has rank ``k`` entries; a removed layer has neither (None).
        Layers not recorded, or whose record is malformed, give none (:meth:`apply_structure` refuses
        those)."""
        shapes: dict[int, tuple[int, ...] | None] = {}
        for name, layer_train in gated_trains(self.model):
            spec = structure.get(name)
            if not isinstance(spec, dict):
                continue
            if spec.get("removed"):  # its cores and gates are gone
                shapes.update(
                    (id(param), None) for param in (*layer_train.core_list(), *layer_train.gate_list())
                )
                continue
            ranks = list(spec.get("ranks", ()))
            cores, gates = layer_train.core_list(), layer_train.gate_list()
            if len(ranks) != len(gates) or not all(isinstance(rank, int) for rank in ranks):
                continue
            bonds = [1, *ranks, 1]
            for index, core in enumerate(cores):
                shapes[id(core)] = (bonds[index], *core.shape[1:-1], bonds[index + 1])
            for gate, rank in zip(gates, ranks, strict=True):
                shapes[id(gate)] = (rank,)
        return shapes

    def record(self) -> dict[str, Any]:
        record = {"ranks": {name: list(layer_train.ranks) for name, layer_train in gated_trains(self.model)}}
        if self.stage == "late":
            record["target_reached"] = self.adaptation.target_reached
            record["reached_at_step"] = self.adaptation.reached_at_step
        return record

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rank_adaptation": self.adaptation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.adaptation.load_state_dict(state["rank_adaptation"])
        self.initial_size = self.adaptation.initial_size


def gated_model_objective(model: nn.Module) -> CoMERAObjective | None:
    """The default objective of a Trainer built without one (registered by :mod:`comera.methods` with
    :func:`comera.train.objective.register_default_objective`): :class:`CoMERAObjective` with default
    settings for a model with gated layers, else None."""
    if any(len(layer_train.gates) for _, layer_train in gated_trains(model)):
        return CoMERAObjective(model)
    return None
