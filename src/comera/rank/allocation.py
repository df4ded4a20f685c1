"""Per-bond ranks for a fresh run at a fixed number of core entries: :func:`allocate_ranks` from relative
shares per module-name pattern, :func:`ranks_from_gates` from a trained model's gates (as the late stage's
exact trim reads them). Details: docs/method.md section 4.5."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from comera.checks import check_int
from comera.rank.size import gated_trains
from comera.rank.trim import choose_entries
from comera.tensorize import tensorize_
from comera.tensorize_config import TensorizeConfig
from comera.tt.cores import num_train_parameters
from comera.tt.shapes import resolve_ranks

__all__ = ["allocate_ranks", "checked_shares", "core_entries", "ranks_from_gates"]


def _converted_trains(model: nn.Module, config: TensorizeConfig) -> dict[str, tuple[int, ...]]:
    """``{module name: bond sizes}`` of every gated train ``config`` makes of ``model`` (converted on a copy
    on the meta device)."""
    with torch.device("meta"):
        copied = copy.deepcopy(model).to("meta")
    tensorize_(copied, config)
    return {name: tuple(layer.bond_sizes) for name, layer in gated_trains(copied)}


def _entries(bond_sizes: tuple[int, ...], rank: int | tuple[int, ...]) -> int:
    return num_train_parameters(bond_sizes, resolve_ranks(rank, bond_sizes))


def core_entries(model: nn.Module, config: TensorizeConfig) -> int:
    """Core entries of ``model`` tensorized by ``config`` at its stored ranks (``model`` is not changed; the
    conversion runs on a copy on the meta device)."""
    trains = _converted_trains(model, config)
    return sum(_entries(bonds, config.rank_for(name)) for name, bonds in trains.items())


def checked_shares(shares: Mapping[str, float], name: str = "shares") -> dict[str, float]:
    """``shares`` as ``{pattern: float}``; ``ValueError`` naming ``name`` and a bad pattern or share."""
    if not isinstance(shares, Mapping) or not shares:
        raise ValueError(f"{name} must be a non-empty mapping {{pattern: share > 0}}, got {shares!r}")
    checked = {}
    for pattern, share in shares.items():
        try:
            re.compile(pattern)
        except (re.error, TypeError) as error:
            raise ValueError(f"{name} key {pattern!r} is not a regular expression ({error})") from None
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < math.inf:
            raise ValueError(f"{name}[{pattern!r}] must be a number > 0, got {share!r}")
        checked[pattern] = float(share)
    return checked


def allocate_ranks(
    model: nn.Module, config: TensorizeConfig, shares: Mapping[str, float], total: int | None = None
) -> TensorizeConfig:
    """``config`` with a ``rank_pattern`` giving the modules each pattern of ``shares`` matches rank
    ``round(alpha * share)`` (at least 1, clipped by each layer), ``alpha`` the largest for which the model's
    core entries stay at most ``total``.

    Args:
        model: the dense model ``config`` will convert (any device, meta included; it is not changed).
        config: the tensorization; its own ``rank_pattern`` entries come after the new ones.
        shares: ``{pattern: share > 0}`` (``re.search`` on module names, first match wins), e.g.
            ``{r"attention\\.(q|k)$": 0.5, r"mlp\\.down$": 1.5}``.
        total: the core entries to stay within (default: :func:`core_entries` of ``config`` as given).

    Returns:
        The new config, :func:`core_entries` at most ``total`` and the largest such on the grid of ``alpha``.

    Raises:
        ValueError: a bad share or pattern, ``total`` below the entries of rank 1 everywhere.
    """
    shares = checked_shares(shares)
    trains = _converted_trains(model, config)
    budget = (
        sum(_entries(bonds, config.rank_for(name)) for name, bonds in trains.items())
        if total is None
        else check_int(total, "total", 1)
    )

    def at(alpha: float) -> TensorizeConfig:
        ranks = {pattern: max(1, round(alpha * share)) for pattern, share in shares.items()}
        return config.with_overrides(rank_pattern={**ranks, **config.rank_pattern})

    def size(alpha: float) -> int:
        chosen = at(alpha)
        return sum(_entries(bonds, chosen.rank_for(name)) for name, bonds in trains.items())

    low, high = 0.0, 1.0
    if size(low) > budget:
        raise ValueError(f"total ({budget}) is below the core entries of rank 1 for every matched module")
    while size(high) <= budget and high < 2**20:
        low, high = high, 2 * high
    for _ in range(40):
        middle = (low + high) / 2
        if size(middle) <= budget:
            low = middle
        else:
            high = middle
    return at(low)


def ranks_from_gates(model: nn.Module, config: TensorizeConfig, total: int | None = None) -> TensorizeConfig:
    """``config`` with a ``rank_pattern`` giving every gated layer of ``model`` the per-bond ranks its gates
    support at ``total`` core entries: the entries the exact trim keeps
    (:func:`comera.rank.trim.entry_scores`), counted per bond.

    Args:
        model: a model ``config`` converted and that has trained (its gates decide; it is not changed).
        config: the tensorization that made ``model``; its own ``rank_pattern`` entries come after the new
            ones, which name each layer exactly (``re.escape`` of its name).
        total: the core entries to stay within (default: the live size of ``model`` now).

    Returns:
        The new config, whose :func:`core_entries` on the dense model is at most ``total``.

    Raises:
        ValueError: ``model`` has no gated layer, a layer has a dead bond (prune it first), or ``total`` is
            below one entry per bond everywhere.
    """
    trains = gated_trains(model)
    if not trains:
        raise ValueError("model has no gated layer (TTLinear, TTMLinear, TTMEmbedding): nothing to read")
    layers = [train for _, train in trains]
    budget = (
        sum(train.num_parameters() for train in layers) if total is None else check_int(total, "total", 1)
    )
    choice = choose_entries(layers, budget)
    if choice.size > budget:
        raise ValueError(
            f"total ({budget}) is below the core entries of one rank per bond everywhere ({choice.size})"
        )
    ranks = {
        re.escape(name): tuple(int(mask.sum()) for mask in masks)
        for (name, _), masks in zip(trains, choice.keep)
    }
    return config.with_overrides(rank_pattern={**ranks, **config.rank_pattern})
