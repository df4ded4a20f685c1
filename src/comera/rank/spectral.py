"""The spectral rule for TT and TTM linear layers: per-core initialisation std
``sqrt(min(d_in, d_out)) / d_in`` and learning rate ``lr_cores * (D_in / d_in) / K`` from each core's fans
(Qiu et al., ICML 2024). Details: docs/method.md section 4.5."""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import nn

from comera.nn.linear import TTLinear, TTMLinear
from comera.rank.size import gated_trains
from comera.tt.cores import spectral_lr_scale

__all__ = ["CORE_RULES", "spectral_init_", "spectral_lr_scales", "spectral_layers"]

CORE_RULES = ("uniform", "spectral")
"""How the cores of the gated layers are initialised and what learning rate each gets: ``"uniform"`` (the
layers' own initialisation, ``lr_cores`` for every core) or ``"spectral"`` (the rule above)."""


def spectral_layers(model: nn.Module) -> list[tuple[str, TTLinear | TTMLinear]]:
    """The TT and TTM linear layers of ``model`` that the spectral rule applies to, with their names."""
    return [(name, layer) for name, layer in gated_trains(model) if isinstance(layer, (TTLinear, TTMLinear))]


def spectral_lr_scales(model: nn.Module) -> dict[int, float]:
    """``{id(core): learning-rate multiplier}`` for every core of :func:`spectral_layers`."""
    scales = {}
    for _, layer in spectral_layers(model):
        count = len(layer.cores)
        for core, (fan_in, _) in zip(layer.cores, layer.core_fans()):
            scales[id(core)] = spectral_lr_scale(layer.in_features, fan_in, count)
    return scales


def spectral_init_(model: nn.Module, zero_last: Sequence[str] = ()) -> list[str]:
    """Redraw the cores of every :func:`spectral_layers` layer by the spectral rule, in place; returns the
    names of the layers redrawn.

    Args:
        model: a model with TT or TTM linear layers (``comera.tensorize_`` first).
        zero_last: regular expressions (``re.search`` on the layer's dotted name); a layer they match starts
            with its last core at zero, so it adds nothing to its residual stream at the start (e.g.
            ``("attention.o", "mlp.down")``).
    """
    patterns = [re.compile(pattern) for pattern in zero_last]
    names = []
    for name, layer in spectral_layers(model):
        layer.spectral_init_(zero_last=any(pattern.search(name) for pattern in patterns))
        names.append(name)
    return names
