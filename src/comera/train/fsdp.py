"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a comera model: dense parts sharded, TT layers
replicated (their gradients averaged) or sharded, global gradient norms, and the whole state for
checkpoints that any number of processes reads. Details: docs/training.md, 'FSDP2: sharding the dense
parts'.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from comera.train.guard import total_grad_norm

__all__ = [
    "shard_model",
    "is_sharded",
    "check_sharding",
    "register_replicated_layer",
    "replicated_parameters",
    "reduce_replicated_gradients",
    "grad_norm",
    "clip_gradients",
    "gathered",
    "full_state",
    "load_full_state",
    "full_model_state",
    "unfuse_mixed_groups",
    "whole_copy",
    "is_dtensor",
    "names_in_order",
]


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``DTensor``. While ``torch.distributed.tensor`` is not imported none can
    exist, and it is not imported here: that import takes about a second, which ``import comera`` and every
    one-process run would otherwise pay (the FSDP functions below import it when they shard)."""
    package = sys.modules.get("torch.distributed.tensor")
    return package is not None and isinstance(value, package.DTensor)


def _fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The submodules of ``module`` (itself included) sharded by ``fully_shard``; none while
    ``torch.distributed.fsdp`` is not imported (see :func:`is_dtensor`)."""
    package = sys.modules.get("torch.distributed.fsdp")
    if package is None:
        return []
    return [layer for layer in module.modules() if isinstance(layer, package.FSDPModule)]


_REPLICATED_LAYER_TESTS: list[Callable[[nn.Module], bool]] = []


def register_replicated_layer(test: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """Register ``test(module) -> bool``: the modules it accepts keep their parameters replicated under FSDP
    unless ``shard_cores=True``. :mod:`comera.methods` registers the test for comera's tensorized layers, so
    the training layer needs no layer type."""
    if not callable(test):
        raise TypeError(f"test must be a callable module -> bool, got {test!r}")
    if test not in _REPLICATED_LAYER_TESTS:
        _REPLICATED_LAYER_TESTS.append(test)
    return test


def replicated_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of every registered replicated layer in ``module`` (comera's tensorized layers: TT
    cores, gates, biases)."""
    return {
        param
        for layer in module.modules()
        if any(test(layer) for test in _REPLICATED_LAYER_TESTS)
        for param in layer.parameters()
    }


def shard_model(
    module: nn.Module, shard_cores: bool = False, keep_whole: Iterable[torch.Tensor] = ()
) -> nn.Module:
    """Apply ``fully_shard`` to ``module`` in place (one FSDP unit at the root) and return it.

    Args:
        module: the unwrapped model, on its device; a process group must be running.
        shard_cores: shard the tensorized layers' parameters too (default: keep them replicated).
        keep_whole: parameters kept whole on every rank in any case (with ``shard_cores``, the gates that
            a rank objective reads between steps); their gradients are averaged by
            :func:`reduce_replicated_gradients`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(iter(module.parameters()), torch.empty(0)).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    ignored = set(keep_whole) | (set() if shard_cores else replicated_parameters(module))
    fully_shard(module, mesh=mesh, reshard_after_forward=True, ignored_params=ignored)
    return module


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) was sharded with ``fully_shard``."""
    return bool(_fsdp_units(module))


def check_sharding(optimizer_given: bool) -> None:
    """Refuse what FSDP cannot run (``ValueError`` naming the setting).

    Args:
        optimizer_given: whether the caller passed an optimizer (built on the parameters before sharding).
    """
    if optimizer_given:
        raise ValueError(
            "parallel='fsdp' builds the optimizer after sharding the model (FSDP replaces the parameters): "
            "leave optimizer=None (the default AdamW), or use parallel='ddp' (comera train: a method that "
            "brings its own optimizer, such as galore or apollo, needs --set train.parallel=ddp)"
        )


def reduce_replicated_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """Average over ranks the gradients that FSDP does not reduce (those that are not ``DTensor`` s)."""
    grads = [param.grad for param in parameters if param.grad is not None and not is_dtensor(param.grad)]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together, sharded ``DTensor`` ones and replicated ones, the same on every
    rank (0-dim tensor; NaN/Inf if any is).
    """
    sharded = [param.grad for param in parameters if is_dtensor(param.grad)]
    if not sharded:
        return total_grad_norm(parameters)
    plain = [param for param in parameters if param.grad is not None and not is_dtensor(param.grad)]
    squares = torch.stack([grad.to_local().float().pow(2).sum() for grad in sharded]).sum()
    dist.all_reduce(squares)
    replicated = total_grad_norm(plain).float().to(squares.device)
    return torch.sqrt(squares + replicated.pow(2))


def clip_gradients(parameters: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so that their total ``norm`` is at most ``max_norm`` (as
    ``torch.nn.utils.clip_grads_with_norm_``, which cannot mix ``DTensor`` and plain gradients)."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not any(is_dtensor(grad) for grad in grads):
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return
    coefficient = min(max_norm / (float(norm) + 1e-6), 1.0)
    for grad in grads:
        grad.mul_(coefficient)


def unfuse_mixed_groups(optimizer: torch.optim.Optimizer) -> None:
    """Step every param group that mixes ``DTensor`` and plain parameters one tensor at a time: the fused and
    foreach kernels refuse the mix (a group keeps its flags otherwise)."""
    for group in optimizer.param_groups:
        kinds = {is_dtensor(param) for param in group["params"]}
        if len(kinds) > 1:
            group["fused"], group["foreach"] = None, False


@contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """Inside, every FSDP unit of ``module`` holds its full parameters and forward passes communicate
    nothing (collective on entry and exit; a no-op for a model that is not sharded)."""
    units = _fsdp_units(module)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield module
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def _state_dict_api():
    """``torch.distributed.checkpoint.state_dict``, imported on first use (see :func:`is_dtensor`)."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _whole_on_cpu():
    """Options for a whole state dict gathered on rank 0's CPU."""
    return _state_dict_api().StateDictOptions(full_state_dict=True, cpu_offload=True)


def names_in_order(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of every parameter the optimizer holds, in its param groups' order."""
    names = {id(param): name for name, param in module.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``(model state, optimizer state)`` of a sharded run, whole, on rank 0's CPU (empty on the others);
    collective. The optimizer state is keyed by parameter position, as ``optimizer.state_dict()`` of one
    process is."""
    model_state, named = _state_dict_api().get_state_dict(module, optimizer, options=_whole_on_cpu())
    if not named:
        return model_state, named
    position = {name: index for index, name in enumerate(names_in_order(module, optimizer))}
    optimizer_state = {
        "state": {position[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [position[name] for name in group["params"]]}
            for group in named["param_groups"]
        ],
    }
    return model_state, optimizer_state


def load_full_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict[str, Any]
) -> None:
    """Load a whole model and optimizer state (every rank passes the same, e.g. read from one checkpoint
    file) into a sharded ``module`` and its ``optimizer``; inverse of :func:`full_state`. The optimizer's
    groups are then unfused where needed (:func:`unfuse_mixed_groups`)."""
    names = names_in_order(module, optimizer)
    named = {
        "state": {names[index]: value for index, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }
    api = _state_dict_api()
    options = api.StateDictOptions(full_state_dict=True)
    api.set_state_dict(
        module, optimizer, model_state_dict=model_state, optim_state_dict=named, options=options
    )
    unfuse_mixed_groups(optimizer)


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` of a sharded ``module`` on rank 0's CPU (empty on the others); collective."""
    return _state_dict_api().get_model_state_dict(module, options=_whole_on_cpu())


def whole_copy(module: nn.Module, build: Callable[[], nn.Module]) -> nn.Module | None:
    """An unsharded copy of the sharded ``module`` on rank 0 (None on the others); collective. ``build()``
    makes a fresh model of the same kind, pruned as ``module`` is by the caller; the copy is loaded with
    the gathered state.
    """
    state = full_model_state(module)
    if dist.get_rank() != 0:
        return None
    whole = build()
    whole.load_state_dict(state)
    return whole
