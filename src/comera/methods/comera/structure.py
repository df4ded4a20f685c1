"""Record the ranks a model has been pruned to (per gated layer, its stored ranks or that it was removed), and
bring a freshly built model to the same shapes (:func:`apply_structure`: the first entries of each bond live,
the rest killed, then :func:`comera.prune_`) so a checkpoint's state dict loads. Details: docs/method.md
section 3."""

from __future__ import annotations

import torch
from torch import nn

from comera.nn.removed import RemovedLayer
from comera.rank.prune import prune_
from comera.rank.size import gated_trains

__all__ = ["model_structure", "apply_structure"]


def model_structure(module: nn.Module) -> dict[str, dict]:
    """``{layer name: {"ranks": [...], "removed": bool}}`` for every gated or removed layer of ``module``."""
    structure = {
        name: {"ranks": list(layer_train.max_ranks), "removed": False}
        for name, layer_train in gated_trains(module)
    }
    for name, layer in module.named_modules():
        if isinstance(layer, RemovedLayer):
            structure[name] = {"ranks": [], "removed": True}
    return structure


def apply_structure(
    module: nn.Module, structure: dict[str, dict], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Prune ``module`` (and ``optimizer``'s references) to the ranks recorded in ``structure``.

    Raises:
        ValueError: a recorded layer is missing from ``module``, or records more rank than the layer holds.
    """
    current = model_structure(module)
    missing = sorted(set(structure) - set(current))
    if missing:
        raise ValueError(f"checkpoint key 'structure' names layers the model lacks: {missing}")
    with torch.no_grad():
        for name, layer_train in gated_trains(module):
            if name not in structure:
                continue
            spec = structure[name]
            if spec["removed"]:
                layer_train.gates[0].zero_()
                continue
            ranks = list(spec["ranks"])
            if len(ranks) != len(layer_train.gates) or any(
                r > m for r, m in zip(ranks, layer_train.max_ranks)
            ):
                raise ValueError(
                    f"checkpoint key 'structure.{name}' records ranks {ranks}; "
                    f"the layer holds {layer_train.max_ranks}"
                )
            for gate, rank in zip(layer_train.gates, ranks):
                gate[:rank] = layer_train.tau + 1.0
                gate[rank:] = 0.0
    prune_(module, optimizer)
