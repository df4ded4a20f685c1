"""``--method apollo``: APOLLO (Zhu et al., MLSys 2025) through ``apollo_torch.APOLLOAdamW`` on the dense
model, with the targets and groups of :mod:`comera.methods.projected`; nothing of APOLLO is re-implemented.
Details (settings and their sources): docs/reference/training.md, "The baseline methods"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from comera.checks import check_bool, check_choice, check_number
from comera.methods.base import MethodContext, register_method
from comera.methods.projected import (
    ProjectedMethod,
    check_projection,
    portable_projectors,
    require_package,
)

__all__ = ["APOLLOMethod", "APOLLOSettings", "SCALE_TYPES", "PROJECTIONS", "PROJ_TYPES"]

SCALE_TYPES = ("channel", "tensor")
PROJECTIONS = ("random", "svd")
PROJ_TYPES = ("std", "reverse_std", "left", "right")


@dataclass(frozen=True)
class APOLLOSettings:
    """APOLLO's settings (where the defaults come from: docs/reference/training.md, "The baseline methods");
    checked on construction: ``scale_type``, ``proj`` and ``proj_type`` among their choices, ``scale`` > 0,
    ``scale_front`` a bool, the rest by :func:`comera.methods.projected.check_projection`."""

    rank: int = 256
    rank_fraction: float = 0.25
    scale_type: str = "channel"
    scale: float = 1.0
    proj: str = "random"
    proj_type: str = "std"
    update_proj_gap: int = 200
    scale_front: bool = False

    def __post_init__(self) -> None:
        check_projection(self)
        check_choice(self.scale_type, "method.scale_type", SCALE_TYPES)
        check_number(self.scale, "method.scale", 0.0, open_low=True)
        check_choice(self.proj, "method.proj", PROJECTIONS)
        check_choice(self.proj_type, "method.proj_type", PROJ_TYPES)
        check_bool(self.scale_front, "method.scale_front")


@register_method(APOLLOSettings)
class APOLLOMethod(ProjectedMethod):
    """APOLLO: dense model, ``apollo_torch.APOLLOAdamW`` with APOLLO groups for the targeted 2-D weights."""

    name = "apollo"
    projection_keys = ("scale_type", "scale", "proj", "proj_type", "update_proj_gap")

    def package(self):
        return require_package("apollo_torch", "apollo-torch", "apollo")

    def optimizer(self, model: nn.Module, context: MethodContext) -> torch.optim.Optimizer:
        """``APOLLOAdamW`` on :func:`comera.methods.projected.low_rank_groups`, checkpoint-safe."""
        apollo = self.package()
        settings = self.settings(context)
        groups = self.groups(model, context, settings)
        optimizer = apollo.APOLLOAdamW(groups, lr=context.train.lr_other, scale_front=settings.scale_front)

        def build(group: dict[str, Any], state: dict[str, Any]):
            options = {key: group[key] for key in ("update_proj_gap", "scale", "proj_type")}
            if group["proj"] == "random":
                return apollo.random_projector.GradientProjector(group["rank"], seed=state["seed"], **options)
            return apollo.svd_projector.GaLoreProjector(group["rank"], **options)

        return portable_projectors(optimizer, build)
