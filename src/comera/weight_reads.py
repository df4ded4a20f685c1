"""Submodules whose parent reads their weight instead of calling them (``nn.MultiheadAttention.out_proj``),
found from the source of the parent's methods (:func:`read_by_attribute`: read as ``self.<child>.weight`` or
``.bias``, never called), which no layer may replace; and :func:`disable_weight_fast_paths` for the eval fast
paths of torch's transformer encoders. Details: docs/architecture.md section 2."""

from __future__ import annotations

import functools
import inspect
import re

from torch import nn

__all__ = ["read_by_attribute", "disable_weight_fast_paths"]

_READ = re.compile(r"\bself\.(\w+)\.(weight|bias)\b")
_CALL = re.compile(r"\bself\.(\w+)(?:\.forward)?\s*\(")
_FAST_PATH_LINEARS = ("linear1", "linear2")


def _source(function: object) -> str:
    """The source of ``function``; "" when it cannot be read (built in, defined interactively, no files)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _methods(cls: type) -> list[object]:
    """The functions ``cls`` itself defines: methods, static and class methods, property getters."""
    found = []
    for value in vars(cls).values():
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(function):
            found.append(function)
    return found


def _forward_source(cls: type, bases: list[type]) -> str:
    """The source of the ``forward`` that ``cls`` runs, with the ``forward`` of the bases below it when it
    calls ``super()``."""
    text = ""
    for owner in (base for base in bases if "forward" in vars(base)):
        source = _source(vars(owner)["forward"])
        text += source + "\n"
        if "super(" not in source:
            break
    return text


@functools.cache
def _children_read(cls: type) -> tuple[tuple[str, str], ...]:
    """``(child, "weight" or "bias")`` for each tensor the methods of ``cls`` and its bases (below
    ``nn.Module``) read of a child attribute they never call, or that a ``forward`` reads of a child it
    calls too (T5's feed-forward reads ``self.wo.weight.dtype`` before calling ``self.wo``), sorted; the
    fast-path reads of ``nn.TransformerEncoderLayer`` excepted (:func:`disable_weight_fast_paths`)."""
    bases = [base for base in cls.__mro__ if issubclass(base, nn.Module) and base is not nn.Module]
    text = "\n".join(_source(function) for base in bases for function in _methods(base))
    forward = _forward_source(cls, bases)
    called = set(_CALL.findall(text))
    read = {(child, tensor) for child, tensor in _READ.findall(text) if child not in called}
    read |= set(_READ.findall(forward))
    if issubclass(cls, nn.TransformerEncoderLayer):
        read -= {(name, tensor) for name in _FAST_PATH_LINEARS for tensor in ("weight", "bias")}
    return tuple(sorted(read))


def read_by_attribute(root: nn.Module) -> dict[str, str]:
    """The modules under ``root`` whose tensors their parent reads by attribute (instead of calling them,
    or in its forward besides calling them), as ``{dotted name: why}`` (a module reachable under several
    names is listed under each)."""
    found: dict[str, str] = {}
    for parent_name, parent in root.named_modules(remove_duplicate=False):
        tensors: dict[str, list[str]] = {}
        for child, tensor in _children_read(type(parent)):
            if parent._modules.get(child) is not None:
                tensors.setdefault(child, []).append(f"{child}.{tensor}")
        for child, read in tensors.items():
            found[f"{parent_name}.{child}" if parent_name else child] = (
                f"its parent {type(parent).__name__} reads {' and '.join(read)} directly, so a layer without "
                "a dense weight cannot stand in for it"
            )
    return found


def _replaced(layer: nn.TransformerEncoderLayer) -> bool:
    """Whether a linear that ``layer``'s fast path reads the weight of is no longer an ``nn.Linear``."""
    return any(not isinstance(getattr(layer, name), nn.Linear) for name in _FAST_PATH_LINEARS)


def disable_weight_fast_paths(root: nn.Module) -> None:
    """Turn off the eval-mode fast paths of torch's transformer encoders under ``root`` wherever one of the
    linears they read by attribute was replaced (the standard path, used in training, takes over)."""
    for module in root.modules():
        if isinstance(module, nn.TransformerEncoderLayer) and _replaced(module):
            module.activation_relu_or_gelu = 0
        layers = module.layers if isinstance(module, nn.TransformerEncoder) else ()
        if any(isinstance(layer, nn.TransformerEncoderLayer) and _replaced(layer) for layer in layers):
            module.use_nested_tensor = False
