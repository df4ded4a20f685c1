"""Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2's ``y = x W + b`` with ``weight`` of shape
``(in_features, out_features)``, always a bias) seen as the linear layer it is, for the linear layer types and
their removed stand-in (``dense_kind="conv1d"``); ``transformers`` is never imported here. Details:
docs/architecture.md section 2."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

__all__ = [
    "DENSE_KINDS",
    "conv1d_type",
    "is_conv1d",
    "dense_kind_of",
    "check_dense_kind",
    "linear_sizes",
    "weight_in_out",
    "new_conv1d",
    "conv1d_mismatch",
]

DENSE_KINDS = ("linear", "conv1d")
_MODULE = "transformers.pytorch_utils"


def conv1d_type() -> type[nn.Module] | None:
    """``transformers.pytorch_utils.Conv1D`` when ``transformers`` has been imported, else None."""
    return getattr(sys.modules.get(_MODULE), "Conv1D", None)


def is_conv1d(module: object) -> bool:
    """Whether ``module`` is a ``transformers`` ``Conv1D`` (exactly that class)."""
    kind = conv1d_type()
    return kind is not None and type(module) is kind


def dense_kind_of(module: nn.Module) -> str:
    """``"conv1d"`` for a ``Conv1D``, else ``"linear"``."""
    return "conv1d" if is_conv1d(module) else "linear"


def check_dense_kind(value: object) -> str:
    """``value`` if it is one of :data:`DENSE_KINDS`; ``ValueError`` otherwise."""
    if value not in DENSE_KINDS:
        raise ValueError(f"dense_kind must be one of {DENSE_KINDS}, got {value!r}")
    return value


def linear_sizes(module: nn.Module) -> dict[str, Any]:
    """``{"in_features", "out_features", "bias"}`` of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        in_features, out_features = module.weight.shape
    else:
        in_features, out_features = module.in_features, module.out_features
    return {"in_features": in_features, "out_features": out_features, "bias": module.bias is not None}


def weight_in_out(module: nn.Module) -> torch.Tensor:
    """The weight of an ``nn.Linear`` or a ``Conv1D`` as ``(in_features, out_features)`` (a view)."""
    return module.weight if is_conv1d(module) else module.weight.t()


def new_conv1d(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A ``Conv1D`` holding copies of ``weight`` ``(out_features, in_features)`` (``nn.Linear``'s layout)
    and ``bias`` (zeros when None)."""
    kind = conv1d_type()
    if kind is None:
        raise RuntimeError("a layer converted from a transformers Conv1D needs transformers to rebuild it")
    out_features, in_features = weight.shape
    conv = kind(out_features, in_features).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight.t())
        conv.bias.copy_(bias if bias is not None else torch.zeros_like(conv.bias))
    return conv


def conv1d_mismatch(expected: dict[str, Any], module: nn.Module) -> str | None:
    """For a layer standing for a linear with ``expected`` attributes (``linear_sizes``' keys), what differs
    in the ``Conv1D`` ``module``, or None."""
    found = linear_sizes(module)
    return None if found == expected else f"expected Conv1D attributes {expected}, found {found}"
