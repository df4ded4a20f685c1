"""``--method galore``: GaLore (Zhao et al., ICML 2024) through ``galore_torch.GaLoreAdamW`` on the dense
model; this module only builds the parameter groups. Details (settings and their sources):
docs/reference/training.md, "The baseline methods"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from comera.checks import check_choice, check_number
from comera.methods.base import MethodContext, register_method
from comera.methods.projected import (
    ProjectedMethod,
    check_projection,
    portable_projectors,
    require_package,
)

__all__ = ["GaLoreMethod", "GaLoreSettings", "PROJ_TYPES"]

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


@dataclass(frozen=True)
class GaLoreSettings:
    """GaLore's settings (where the defaults come from: docs/reference/training.md, "The baseline methods");
    checked on construction: ``scale`` > 0, ``proj_type`` one of :data:`PROJ_TYPES`, the rest by
    :func:`comera.methods.projected.check_projection`."""

    rank: int = 128
    rank_fraction: float = 0.25
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"

    def __post_init__(self) -> None:
        check_projection(self)
        check_number(self.scale, "method.scale", 0.0, open_low=True)
        check_choice(self.proj_type, "method.proj_type", PROJ_TYPES)


@register_method(GaLoreSettings)
class GaLoreMethod(ProjectedMethod):
    """GaLore: dense model, ``galore_torch.GaLoreAdamW`` with GaLore groups for the targeted 2-D weights;
    ``prepare`` only checks the settings and the package, the objective is the task loss."""

    name = "galore"
    projection_keys = ("update_proj_gap", "scale", "proj_type")

    def package(self):
        return require_package("galore_torch", "galore-torch", "galore")

    def optimizer(self, model: nn.Module, context: MethodContext) -> torch.optim.Optimizer:
        """``GaLoreAdamW`` on :func:`comera.methods.projected.low_rank_groups`, checkpoint-safe."""
        galore = self.package()
        groups = self.groups(model, context, self.settings(context))
        optimizer = galore.GaLoreAdamW(groups, lr=context.train.lr_other, no_deprecation_warning=True)
        projector = galore.galore_projector.GaLoreProjector

        def build(group: dict[str, Any], _state: dict[str, Any]):
            options = {key: group[key] for key in self.projection_keys}
            return projector(group["rank"], **options)

        return portable_projectors(optimizer, build)
