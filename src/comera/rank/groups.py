"""The three optimizer parameter groups of CoMERA: cores, gates, everything else (docs/method.md §4)."""

from __future__ import annotations

from torch import nn

from comera.checks import check_number
from comera.modules import trainable_parameters
from comera.rank.size import gated_trains

__all__ = ["param_groups"]


def param_groups(
    model: nn.Module, *, lr_cores: float, lr_gates: float, lr_other: float, weight_decay: float = 0.0
) -> list[dict]:
    """Parameter groups ``[cores, gates, other]`` for ``torch.optim.AdamW`` (each dict has a ``"name"``).

    Cores and gates are those of every gated layer; "other" is every remaining trainable parameter (biases,
    norms, dense layers). Shared parameters appear once. ``weight_decay`` applies to cores and other
    parameters, never to gates: pulling gates toward zero is the rank objective's job. Empty groups are left
    out. Paper values: ``lr_cores=1e-4, lr_gates=1e-3, lr_other=5e-5, weight_decay=0``.
    """
    rates = {
        "cores": check_number(lr_cores, "lr_cores", 0.0),
        "gates": check_number(lr_gates, "lr_gates", 0.0),
        "other": check_number(lr_other, "lr_other", 0.0),
    }
    decay = check_number(weight_decay, "weight_decay", 0.0)
    seen: set[int] = set()
    members: dict[str, list[nn.Parameter]] = {"cores": [], "gates": [], "other": []}
    for _, layer_train in gated_trains(model):
        members["cores"] += trainable_parameters(layer_train.cores, seen)
        members["gates"] += trainable_parameters(layer_train.gates, seen)
    members["other"] += trainable_parameters(model.parameters(), seen)
    return [
        {"name": name, "params": params, "lr": rates[name], "weight_decay": 0.0 if name == "gates" else decay}
        for name, params in members.items()
        if params
    ]
