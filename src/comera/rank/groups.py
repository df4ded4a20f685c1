"""The optimizer parameter groups of CoMERA: cores, gates, everything else (docs/method.md §4); under the
spectral rule (:mod:`comera.rank.spectral`) the cores split by their learning rate."""

from __future__ import annotations

from torch import nn

from comera.checks import check_number
from comera.modules import trainable_parameters
from comera.rank.size import gated_trains
from comera.rank.spectral import CORE_RULES, spectral_lr_scales

__all__ = ["param_groups"]


def param_groups(
    model: nn.Module,
    *,
    lr_cores: float,
    lr_gates: float,
    lr_other: float,
    weight_decay: float = 0.0,
    core_rule: str = "uniform",
) -> list[dict]:
    """Parameter groups ``[cores, gates, other]`` for ``torch.optim.AdamW``, each dict with a ``"name"``,
    empty groups left out, shared parameters once, ``weight_decay`` never on gates; under
    ``core_rule="spectral"`` the cores split into one group per distinct rate (``"cores"``,
    ``"cores x{multiplier}"``). Details: docs/method.md section 4.5.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> import comera
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        >>> _ = comera.tensorize_(model, target_modules=["0"], rank=8)
        >>> groups = comera.param_groups(model, lr_cores=1e-3, lr_gates=1e-2, lr_other=1e-3)
        >>> [(group["name"], group["lr"], len(group["params"])) for group in groups]
        [('cores', 0.001, 4), ('gates', 0.01, 3), ('other', 0.001, 3)]
        >>> optimizer = torch.optim.AdamW(groups)
    """
    rates = {
        "cores": check_number(lr_cores, "lr_cores", 0.0),
        "gates": check_number(lr_gates, "lr_gates", 0.0),
        "other": check_number(lr_other, "lr_other", 0.0),
    }
    decay = check_number(weight_decay, "weight_decay", 0.0)
    if core_rule not in CORE_RULES:
        raise ValueError(f"core_rule must be one of {CORE_RULES}, got {core_rule!r}")
    scales = spectral_lr_scales(model) if core_rule == "spectral" else {}
    seen: set[int] = set()
    cores: dict[float, list[nn.Parameter]] = {}
    members: dict[str, list[nn.Parameter]] = {"gates": [], "other": []}
    for _, layer_train in gated_trains(model):
        for core in trainable_parameters(layer_train.cores, seen):
            cores.setdefault(scales.get(id(core), 1.0), []).append(core)
        members["gates"] += trainable_parameters(layer_train.gates, seen)
    members["other"] += trainable_parameters(model.parameters(), seen)
    groups = [
        {
            "name": "cores" if scale == 1.0 else f"cores x{scale:.4g}",
            "params": params,
            "lr": rates["cores"] * scale,
            "weight_decay": decay,
        }
        for scale, params in cores.items()
    ]
    return groups + [
        {"name": name, "params": params, "lr": rates[name], "weight_decay": 0.0 if name == "gates" else decay}
        for name, params in members.items()
        if params
    ]
