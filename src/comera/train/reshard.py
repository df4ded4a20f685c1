"""A sharded model given new shapes (``TrainConfig.shard_cores=True``): FSDP2 cannot change a sharded
parameter's shape, so a prune rebuilds the model from a meta-device template and moves the model and
optimizer state over by parameter name. Details: docs/training.md, 'FSDP2: sharding the dense parts'.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from comera.train.fsdp import is_dtensor, names_in_order
from comera.train.objective import Objective

__all__ = [
    "meta_template",
    "fresh_copy",
    "whole_model_state",
    "whole_optimizer_state",
    "load_whole_optimizer_state",
    "rebuilt_on",
    "pruned_copy",
]


def meta_template(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters are on the meta device (their ``requires_grad`` kept, tied
    parameters still tied); buffers and other attributes are copied as they are. Take it before sharding."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
    return copy.deepcopy(module, memo)


def fresh_copy(template: nn.Module, device: torch.device) -> nn.Module:
    """A copy of :func:`meta_template`'s ``template`` with its parameters allocated (uninitialised) on
    ``device``; parameters tied in the template are tied in the copy."""
    fresh = copy.deepcopy(template)
    allocated: dict[int, nn.Parameter] = {}
    for layer in fresh.modules():
        for name, param in list(layer._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in allocated:
                allocated[id(param)] = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
            layer._parameters[name] = allocated[id(param)]
    return fresh


def whole_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` of a sharded ``module`` on every rank, on its device; collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def _whole(value: Any) -> Any:
    return value.full_tensor() if is_dtensor(value) else value


def whole_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of positions and every sharded state tensor
    whole (on every rank; collective when some are sharded). The param groups keep all their entries (rates,
    the schedule's ``initial_lr``, kernel flags)."""
    names = names_in_order(module, optimizer)
    state = optimizer.state_dict()
    return {
        "state": {
            names[index]: {key: _whole(value) for key, value in values.items()}
            for index, values in state["state"].items()
        },
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def _like(param: torch.Tensor, value: Any) -> Any:
    """A copy of state ``value`` for ``param``, sharded as ``param`` is when it is a whole per-entry state of
    a sharded parameter (the loaded optimizer never shares a tensor with the dictionary it was given)."""
    if not isinstance(value, torch.Tensor):
        return value
    if not (is_dtensor(param) and value.shape == param.shape):
        return value.clone()
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device).clone(), param.device_mesh, param.placements)


def load_whole_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, named: dict[str, Any]
) -> None:
    """Load :func:`whole_optimizer_state`'s ``named`` into ``optimizer`` of ``module`` (sharded or not; every
    rank passes the same) by parameter name, group by group.

    Raises:
        ValueError: the saved groups are not the optimizer's (their number, or a group's parameters).
    """
    names = names_in_order(module, optimizer)
    position = {name: index for index, name in enumerate(names)}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if len(named["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved optimizer state has {len(named['param_groups'])} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    groups, start = [], 0
    for index, (group, saved) in enumerate(zip(optimizer.param_groups, named["param_groups"], strict=True)):
        own = names[start : start + len(group["params"])]
        if sorted(own) != sorted(saved["params"]):
            raise ValueError(
                f"param group {index} holds {sorted(own)}, the saved state's group {sorted(saved['params'])}"
            )
        groups.append({**saved, "params": list(range(start, start + len(own)))})
        start += len(own)
    state = {
        position[name]: {key: _like(params[position[name]], value) for key, value in values.items()}
        for name, values in named["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rebuilt_on(
    template: nn.Module, objective: Objective, structure: dict[str, Any], old: nn.Module
) -> nn.Module:
    """A fresh unsharded copy of ``template`` (uninitialised, on ``old``'s device) with the shapes
    ``structure`` records, ``objective`` bound to it; on a structure the model cannot take, the objective is
    bound back to ``old`` and the ``ValueError`` raised."""
    first = next(iter(old.parameters()), None)
    fresh = fresh_copy(template, torch.device("cpu") if first is None else first.device)
    objective.rebind(fresh)
    try:
        objective.apply_structure(structure, None)
    except ValueError:
        objective.rebind(old)
        raise
    return fresh


def pruned_copy(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    template: nn.Module,
    objective: Objective,
    new_optimizer: Callable[[], torch.optim.Optimizer],
) -> tuple[dict[str, Any], nn.Module, dict[str, Any]] | None:
    """Prune a model whose cores are sharded: gather the whole state on every rank, prune an unsharded copy
    (``objective`` bound to it) with a plain optimizer from ``new_optimizer``; ``(details, the pruned copy,
    its whole optimizer state)``, or None (objective bound back to ``module``) when nothing changed."""
    model_state = whole_model_state(module)
    optimizer_state = whole_optimizer_state(module, optimizer)
    fresh = rebuilt_on(template, objective, objective.structure(), module)
    fresh.load_state_dict(model_state)
    del model_state
    staging = new_optimizer()
    load_whole_optimizer_state(fresh, staging, optimizer_state)
    details = objective.prune(staging)
    if details is None:
        objective.rebind(module)
        return None
    return details, fresh, whole_optimizer_state(fresh, staging)
