"""Walking and replacing modules in a model's tree: :func:`trainable_parameters` (each once),
:func:`unwrap_model` (through ``torch.compile`` and DDP / DataParallel wrappers), :func:`replace_module`
(under every name a module is reachable by, so sharing survives) and :func:`state_shapes` (the state dict
after such swaps). Details: docs/architecture.md section 2."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

__all__ = [
    "trainable_parameters",
    "unwrap_model",
    "set_submodule",
    "names_of",
    "replace_module",
    "state_shapes",
]

_WRAPPER_NAMES = ("DistributedDataParallel", "DataParallel")


def trainable_parameters(params: Iterable[nn.Parameter], seen: set[int] | None = None) -> list[nn.Parameter]:
    """The parameters of ``params`` that require gradients and are not in ``seen`` (ids), each once, in order;
    ``seen`` is updated in place, so successive calls split parameters into disjoint groups."""
    seen = set() if seen is None else seen
    kept = []
    for param in params:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            kept.append(param)
    return kept


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile`` (``_orig_mod``) and DDP / DataParallel (``module``) wrappers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    while True:
        inner = model._modules.get("_orig_mod")
        if inner is None and type(model).__name__ in _WRAPPER_NAMES:
            inner = model._modules.get("module")
        if inner is None:
            return model
        model = inner


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``name`` inside ``root`` (the root itself cannot be replaced)."""
    if not name:
        raise ValueError("cannot replace the root module in place; convert a model that contains it")
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def names_of(root: nn.Module) -> dict[int, list[str]]:
    """Every dotted name of every module under ``root``, keyed by ``id(module)`` (shared modules have
    several names, first as ``named_modules`` lists it)."""
    names: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return names


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> list[str]:
    """Put ``new`` wherever ``old`` sits under ``root``; returns the names replaced. A parameter of ``old``
    that a module also holds directly under another name (RoBERTa's LM head and its decoder's bias) is
    repointed to ``new``'s parameter of the same local name; ``ValueError`` when ``old`` is ``root`` or not
    under it."""
    names = [name for name, module in root.named_modules(remove_duplicate=False) if module is old]
    if not names:
        raise ValueError(f"the module {type(old).__name__} to replace is not part of the model")
    carried = {
        id(param): new._parameters[key]
        for key, param in old._parameters.items()
        if param is not None and new._parameters.get(key) is not None
    }
    for name in names:
        set_submodule(root, name, new)
    if carried:
        for module in root.modules():
            for key, param in list(module._parameters.items()):
                if param is not None and id(param) in carried and module is not new:
                    module._parameters[key] = carried[id(param)]
    return names


_EXTRA_STATE_KEY = "_extra_state"
"""The state-dict key torch gives a module's ``get_extra_state()`` value."""


def state_shapes(
    root: nn.Module, swaps: Mapping[int, nn.Module] | None = None
) -> dict[str, torch.Size | None]:
    """Shapes of ``root.state_dict()`` as they would be if every module ``m`` with ``id(m)`` in ``swaps``
    were replaced by ``swaps[id(m)]`` (nothing is changed). Shared modules and tensors are listed under
    every name, as ``state_dict`` does. A module with extra state (``get_extra_state`` overridden) has its
    ``_extra_state`` key listed with shape None (any value)."""
    swaps = swaps or {}
    shapes: dict[str, torch.Size | None] = {}

    def walk(module: nn.Module, prefix: str) -> None:
        module = swaps.get(id(module), module)
        for key, param in module._parameters.items():
            if param is not None:
                shapes[prefix + key] = param.shape
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                shapes[prefix + key] = buffer.shape
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            shapes[prefix + _EXTRA_STATE_KEY] = None
        for key, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{key}.")

    walk(root, "")
    return shapes
