"""Differentiable stand-ins for the model size, the size objective's gradient: ``"size"``, the size-weighted
l1 of the masked gates, and ``"mean_gate"``, the reference code's mean live gate. Details: docs/method.md
section 4.2."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from comera.nn.gated import GatedTrain

__all__ = ["SURROGATES", "size_surrogate", "mean_gate_surrogate"]

SURROGATES = ("size", "mean_gate")


def _train_surrogate(train: GatedTrain) -> torch.Tensor:
    norms = [mask.abs().sum() for mask in train.masked_gates()]
    one = torch.ones((), dtype=norms[0].dtype, device=norms[0].device)
    full = [one, *norms, one]
    relaxed = sum(c * full[k] * full[k + 1] for k, c in enumerate(train.bond_sizes))
    alive = torch.stack([(norm > 0) for norm in norms]).all()
    return relaxed * alive


def size_surrogate(trains: Sequence[GatedTrain], reference_size: float) -> torch.Tensor:
    """Size-weighted l1 relaxation of the size of ``trains``, divided by ``reference_size`` (0-dim tensor).

    Args:
        trains: the gated layers of the model (each with at least one bond).
        reference_size: the normaliser, usually the exact size when rank adaptation began (> 0).
    """
    if reference_size <= 0:
        raise ValueError(f"reference_size must be > 0, got {reference_size!r}")
    terms = [_train_surrogate(train) for train in trains if len(train.gates)]
    if not terms:
        raise ValueError("trains must contain at least one gated layer with a bond")
    device = terms[0].device
    return torch.stack([term.to(device) for term in terms]).sum() / reference_size


def mean_gate_surrogate(trains: Sequence[GatedTrain]) -> torch.Tensor:
    """Mean absolute value of the live gate entries of all ``trains`` (0 when none is live), 0-dim tensor."""
    masks = [mask for train in trains for mask in train.masked_gates()]
    if not masks:
        raise ValueError("trains must contain at least one gated layer with a bond")
    device = masks[0].device
    total = torch.stack([mask.abs().sum().to(device) for mask in masks]).sum()
    live = torch.stack([(mask != 0).sum().to(device) for mask in masks]).sum()
    return total / live.clamp_min(1)
