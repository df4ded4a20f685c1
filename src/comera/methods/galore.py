"""``--method galore``: GaLore (Zhao et al., ICML 2024) through the ``galore-torch`` package.

The model stays dense; ``galore_torch.GaLoreAdamW`` projects the gradient of each targeted linear's 2-D
weight onto a rank-``R`` subspace (refreshed by SVD every ``update_proj_gap`` steps), keeps the Adam moments
there and projects the update back, scaled by ``scale``. The targeted linears are those of the recipe's
tensorization (:func:`comera.methods.targets.target_linears`: attention and feed-forward linears;
embeddings never, an output head only when named); every other parameter is in a plain AdamW group of the
same optimizer. Nothing of GaLore is re-implemented here: this module only builds the parameter groups.

Settings (``method.KEY``) and where their defaults come from:

- ``rank`` = 128: the GaLore paper's rank for its smallest pre-training model (LLaMA 60M, hidden size 512);
- ``rank_fraction`` = 0.25: our cap, ``R = min(rank, floor(rank_fraction * min(out, in)))`` (at least 1), so
  that small layers are projected to a quarter of their size as in the paper's 60M model (128 = 512 / 4)
  rather than to a rank at or above their full rank;
- ``update_proj_gap`` = 200 and ``scale`` = 0.25: the paper's pre-training values (``T`` and ``alpha``);
- ``proj_type`` = ``"std"``: the package's default (project the smaller side).

The learning rate and weight decay are the run's ``train.lr_other`` and ``train.weight_decay`` (a recipe sets
GaLore's own through its preset's ``method`` section, ``{"galore": {"train": {"lr_other": ...}}}``); the
optimizer's other constants (``betas``, ``eps`` = 1e-6) are the package's.
"""

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
    """GaLore's settings (the module's notes give where the defaults come from); checked on construction:
    ``scale`` > 0, ``proj_type`` one of :data:`PROJ_TYPES`, the rest by
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
    """GaLore: dense model, ``galore_torch.GaLoreAdamW`` with GaLore groups for the targeted 2-D weights.

    ``prepare`` leaves the model as built (it checks the settings and that ``galore-torch`` is installed);
    the objective is the task loss.
    """

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
