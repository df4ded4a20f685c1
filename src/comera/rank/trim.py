"""Exact trim of the weakest rank-gate entries down to a size budget: entries scored by the norm of their term
(:func:`entry_scores`), chosen by :func:`choose_entries`, written into the gates by :func:`hold_entries`.
Details: docs/training.md, "Late stage", docs/internals.md, "The exact trim"."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from comera.nn.gated import GatedTrain
from comera.tt.cores import num_train_parameters

__all__ = [
    "TrimChoice",
    "SWAP_TOLERANCE",
    "SEARCH_LIMIT",
    "entry_scores",
    "choose_entries",
    "hold_entries",
]

SWAP_TOLERANCE = 1e-3
SEARCH_LIMIT = 4096


@dataclass(frozen=True)
class TrimChoice:
    """The entries to keep: ``keep[t][k]`` is a bool tensor (length ``r_k``) for bond ``k`` of train ``t``;
    ``size`` is the kept structure's exact size, ``removed`` the live entries dropped, ``revived`` the dead
    ones (``0 < |g| <= tau``) brought back."""

    keep: list[list[torch.Tensor]]
    size: int
    removed: int
    revived: int


def _three_way(core: torch.Tensor) -> torch.Tensor:
    return core.detach().double().reshape(core.shape[0], -1, core.shape[-1])


@torch.no_grad()
def entry_scores(train: GatedTrain) -> list[torch.Tensor]:
    """Relative score of every gate entry of ``train``, per bond (float64 on the CPU, length ``r_k``): entry
    ``j`` of bond ``k`` scores ``|g_k[j]| ||L_j|| ||R_j|| / ||W||`` (``L``, ``R`` the cores left and right of
    the bond, other gates folded in), from Gram matrices of the halves, ``O(sum_k c_k r^3)``."""
    cores = [_three_way(core) for core in train.core_list()]
    gates = [gate.detach().double().to(cores[0].device) for gate in train.gate_list()]
    masks = [mask.detach().double().to(cores[0].device) for mask in train.masked_gates()]
    # Index legend: a, b left ranks (two copies of one bond); i merged modes of a core; c, d right ranks.
    count = len(cores)
    left = torch.ones(1, 1, dtype=torch.float64, device=cores[0].device)
    left_grams = []
    for core, mask in zip(cores[:-1], masks):
        gram = torch.einsum("ab,aic,bid->cd", left, core, core)
        left_grams.append(gram)
        left = gram * torch.outer(mask, mask)
    whole = torch.einsum("ab,aic,bic->", left, cores[-1], cores[-1]).clamp_min(0.0).sqrt()
    right = torch.ones(1, 1, dtype=torch.float64, device=cores[0].device)
    right_grams = [right] * (count - 1)
    for k in range(count - 1, 0, -1):
        core = cores[k] if k == count - 1 else cores[k] * masks[k]
        right = torch.einsum("cd,aic,bid->ab", right, core, core)
        right_grams[k - 1] = right
    scores = []
    for k, gate in enumerate(gates):
        left_norms = left_grams[k].diagonal().clamp_min(0.0).sqrt()
        right_norms = right_grams[k].diagonal().clamp_min(0.0).sqrt()
        term = gate.abs() * left_norms * right_norms
        scores.append((term / whole if whole > 0 else term).cpu())
    return scores


class _Selection:
    """Kept entries with their per-bond counts and exact sizes, updated one entry at a time."""

    def __init__(self, keep: list[list[torch.Tensor]], bond_sizes: list[tuple[int, ...]]):
        self.keep = keep
        self.bond_sizes = bond_sizes
        self.counts = [[int(mask.sum()) for mask in masks] for masks in keep]
        self.sizes = [num_train_parameters(c, r) for c, r in zip(bond_sizes, self.counts)]
        self.total = sum(self.sizes)

    def _set(self, entry: tuple[int, int, int], value: bool) -> None:
        t, k, j = entry
        self.keep[t][k][j] = value
        self.counts[t][k] += 1 if value else -1
        new = num_train_parameters(self.bond_sizes[t], self.counts[t])
        self.total += new - self.sizes[t]
        self.sizes[t] = new

    def kept(self, entry: tuple[int, int, int]) -> bool:
        t, k, j = entry
        return bool(self.keep[t][k][j])

    def drop(self, entry: tuple[int, int, int]) -> bool:
        """Drop a kept entry unless it is the last of its bond; whether it was dropped."""
        t, k, _ = entry
        if not self.kept(entry) or self.counts[t][k] == 1:
            return False
        self._set(entry, False)
        return True

    def restore(self, entry: tuple[int, int, int]) -> None:
        """Keep ``entry`` again, whatever the budget (undoes a :meth:`drop`)."""
        if not self.kept(entry):
            self._set(entry, True)

    def add_within(self, entry: tuple[int, int, int], budget: float) -> bool:
        """Add a dropped entry if the size stays within ``budget``; whether it was added."""
        if self.kept(entry):
            return False
        self._set(entry, True)
        if self.total <= budget:
            return True
        self._set(entry, False)
        return False

    def fill(self, order: list[tuple[int, int, int]], budget: float, skip=None) -> list[tuple[int, int, int]]:
        """Add entries of ``order`` (best first) that fit the budget; the ones added."""
        return [entry for entry in order if entry != skip and self.add_within(entry, budget)]


def _search_ranks(
    pool: list[list[torch.Tensor]],
    scores: list[list[torch.Tensor]],
    bond_sizes: list[tuple[int, ...]],
    budget: float,
) -> list[list[torch.Tensor]]:
    """Every combination of ranks (the top-scored entries of ``pool`` per bond): among those at or below
    ``budget`` whose sum of squared scores is within ``SWAP_TOLERANCE`` of the best there, the largest size
    (else the smallest size of all, the floor)."""
    bonds = [(t, k) for t, masks in enumerate(pool) for k in range(len(masks))]
    ordered, energy = {}, {}
    for t, k in bonds:
        values = torch.where(pool[t][k], scores[t][k], -1.0)
        ordered[t, k] = torch.argsort(values, descending=True)
        count = int(pool[t][k].sum())
        energy[t, k] = [0.0, *values[ordered[t, k][:count]].square().cumsum(0).tolist()]
    counts = [range(1, int(pool[t][k].sum()) + 1) for t, k in bonds]
    options = []
    for ranks in itertools.product(*counts):
        chosen = dict(zip(bonds, ranks))
        size = sum(
            num_train_parameters(sizes, [chosen[t, k] for k in range(len(pool[t]))])
            for t, sizes in enumerate(bond_sizes)
        )
        options.append((size, sum(energy[bond][rank] for bond, rank in chosen.items()), chosen))
    within = [option for option in options if option[0] <= budget]
    if not within:
        best = min(options, key=lambda option: (option[0], -option[1]))[2]
    else:
        most = max(kept for _, kept, _ in within)
        near = [option for option in within if option[1] >= most - SWAP_TOLERANCE]
        best = max(near, key=lambda option: (option[0], option[1]))[2]
    keep = [[torch.zeros_like(mask) for mask in masks] for masks in pool]
    for (t, k), rank in best.items():
        keep[t][k][ordered[t, k][:rank]] = True
    return keep


@torch.no_grad()
def choose_entries(trains: Sequence[GatedTrain], budget: float, swaps: int = 32) -> TrimChoice:
    """The gate entries to keep so that the exact size of ``trains`` is at most ``budget``: greedy cut and
    fill, then up to ``swaps`` single swaps, or the exhaustive search for small models (docs/internals.md,
    "The exact trim").

    Args:
        trains: gated layers, each with at least one bond and at least one live entry per bond.
        budget: the size to stay at or below (> 0); if one entry per bond exceeds it, that floor is returned.
        swaps: how many single-entry swaps to try (>= 0).
    """
    if not budget > 0:
        raise ValueError(f"budget must be > 0, got {budget!r}")
    if isinstance(swaps, bool) or not isinstance(swaps, int) or swaps < 0:
        raise ValueError(f"swaps must be an int >= 0, got {swaps!r}")
    keep, pool, scored, all_scores = [], [], [], []
    for t, train in enumerate(trains):
        live = [(gate.detach().abs() > train.tau).cpu() for gate in train.gate_list()]
        if any(not bool(mask.any()) for mask in live):
            raise ValueError(f"trains[{t}] has a dead bond: prune it before trimming")
        nonzero = [(gate.detach() != 0).cpu() for gate in train.gate_list()]
        all_scores.append(entry_scores(train))
        for k, score in enumerate(all_scores[-1]):
            scored.extend((float(score[j]), (t, k, j)) for j in range(len(score)) if nonzero[k][j])
        keep.append(live)
        pool.append(nonzero)
    score_of = {entry: score for score, entry in scored}
    was_live = [[mask.clone() for mask in masks] for masks in keep]
    bond_sizes = [train.bond_sizes for train in trains]
    if math.prod(int(mask.sum()) for masks in pool for mask in masks) <= SEARCH_LIMIT:
        chosen = _search_ranks(pool, all_scores, bond_sizes, budget)
        return _result(chosen, was_live, bond_sizes)
    selection = _Selection(keep, bond_sizes)
    weakest_first = [entry for _, entry in sorted(scored)]
    for entry in weakest_first:
        if selection.total <= budget:
            break
        selection.drop(entry)
    best_first = weakest_first[::-1]
    selection.fill(best_first, budget)
    tried = 0
    for entry in weakest_first:
        if tried == swaps or selection.total == budget:
            break
        if not selection.kept(entry):
            continue
        before = selection.total
        if not selection.drop(entry):
            continue
        tried += 1
        added = selection.fill(best_first, budget, skip=entry)
        lost = score_of[entry] ** 2 - sum(score_of[other] ** 2 for other in added)
        if selection.total <= before or lost > SWAP_TOLERANCE:
            for other in added:
                selection.drop(other)
            selection.restore(entry)
    return _result(selection.keep, was_live, bond_sizes)


def _result(
    keep: list[list[torch.Tensor]], was_live: list[list[torch.Tensor]], bond_sizes: list[tuple[int, ...]]
) -> TrimChoice:
    size = sum(
        num_train_parameters(sizes, [int(mask.sum()) for mask in masks])
        for sizes, masks in zip(bond_sizes, keep)
    )
    pairs = [
        (new, old) for new_masks, old_masks in zip(keep, was_live) for new, old in zip(new_masks, old_masks)
    ]
    removed = sum(int((old & ~new).sum()) for new, old in pairs)
    revived = sum(int((new & ~old).sum()) for new, old in pairs)
    return TrimChoice(keep, size, removed, revived)


@torch.no_grad()
def hold_entries(trains: Sequence[GatedTrain], keep: Sequence[Sequence[torch.Tensor]], floor: float) -> None:
    """Set dropped gate entries to 0 and kept ones to at least ``floor`` in magnitude (in place, no sync).

    Args:
        trains: the gated layers ``keep`` was chosen for.
        keep: ``keep[t][k]`` bool masks as in :class:`TrimChoice` (moved to each gate's device).
        floor: smallest magnitude of a kept entry; must exceed every train's ``tau``.
    """
    for train, masks in zip(trains, keep):
        if not floor > train.tau:
            raise ValueError(f"floor must be > tau ({train.tau}), got {floor!r}")
        for gate, mask in zip(train.gate_list(), masks):
            mask = mask.to(gate.device)
            sign = torch.where(gate >= 0, 1.0, -1.0).to(gate.dtype)
            held = sign * gate.abs().clamp_min(floor)
            gate.copy_(torch.where(mask, held, torch.zeros_like(gate)))
