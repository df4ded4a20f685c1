"""``CoMERASettings``: CoMERA's own settings (the early stage's ``gamma``, the late stage's ``target_ratio``,
pruning, learning rates, core rule), read from a run's ``method`` section and checked on construction.
Details: docs/method.md sections 4 and 7."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

from comera.checks import check_number
from comera.rank.adaptation import DEFAULT_RECOVERY, DEFAULT_TRIMS
from comera.rank.allocation import checked_shares
from comera.rank.spectral import CORE_RULES
from comera.rank.surrogate import SURROGATES

__all__ = ["CoMERASettings", "PRUNE_POINTS"]

PRUNE_POINTS = ("early_end", "late_epoch", "epoch", "end")
"""Where :func:`comera.prune_` runs: end of the early stage, end of every late-stage epoch, end of every
epoch, end of training. An empty tuple never prunes."""


def _check_patterns(patterns: object) -> None:
    if isinstance(patterns, str) or not isinstance(patterns, (tuple, list)):
        raise ValueError(f"zero_last must be a list of regular expressions, got {patterns!r}")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ValueError(f"zero_last must be a list of regular expressions, got an entry {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"zero_last entry {pattern!r} is not a regular expression ({error})") from None


@dataclass(frozen=True)
class CoMERASettings:
    """CoMERA's settings; paper values where the paper gives them.

    Attributes:
        gamma, surrogate: early-stage size weight and size surrogate (see :class:`comera.RankAdaptation`).
        target_ratio: late-stage size target as a fraction of the size at the end of the early stage, (0, 1].
        target_loss: late-stage loss target ``L*``; None = 1.05 x the smoothed loss at the stage switch
            (required when the run has no early stage).
        rho: late-stage augmentation weights ``(rho_loss, rho_size)``.
        ema: decay of the loss moving average used by the late-stage switch, [0, 1).
        recovery: fraction of the late stage kept for recovery after the exact trim to the target, [0, 1):
            the trim happens at the latest after ``1 - recovery`` of the late stage.
        trims: gradual trims of the late stage, an int >= 1: the window before that deadline is cut into
            ``trims`` parts with falling size budgets (:meth:`comera.RankAdaptation.begin_late_stage`);
            1 = a single trim, to the target.
        prune_at: subset of :data:`PRUNE_POINTS`; empty never prunes. The default prunes at the end of the
            early stage, of every late-stage epoch and of training (so the trained model holds its active
            ranks even when the late stage ends mid-epoch).
        lr_cores, lr_gates: learning rates of the cores and gates groups of the default AdamW
            (:func:`comera.param_groups`; every other parameter trains at ``TrainConfig.lr_other``).
        core_rule: ``"uniform"`` (every core at ``lr_cores``, the layers' own initialisation) or
            ``"spectral"`` (per-core initialisation and learning rate, ``lr_cores`` the dense-equivalent
            rate: :mod:`comera.rank.spectral`).
        zero_last: with ``core_rule="spectral"``, regular expressions naming the linear layers whose last
            core starts at zero (those writing into a residual stream, e.g. ``attention\\.o$``).
        rank_shares: ``{pattern: share}``: uneven ranks at the size of the tensorization as given
            (:func:`comera.rank.allocation.allocate_ranks`: each matched module gets a rank proportional to
            its share); empty (the default) keeps the tensorization's ranks.
    """

    gamma: float = 0.01
    surrogate: str = "size"
    target_ratio: float = 0.5
    target_loss: float | None = None
    rho: tuple[float, float] = (0.1, 0.01)
    ema: float = 0.98
    recovery: float = DEFAULT_RECOVERY
    trims: int = DEFAULT_TRIMS
    prune_at: tuple[str, ...] = ("early_end", "late_epoch", "end")
    lr_cores: float = 1e-4
    lr_gates: float = 1e-3
    core_rule: str = "uniform"
    zero_last: tuple[str, ...] = ()
    rank_shares: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_number(self.gamma, "gamma", 0.0)
        if self.surrogate not in SURROGATES:
            raise ValueError(f"surrogate must be one of {SURROGATES}, got {self.surrogate!r}")
        check_number(self.target_ratio, "target_ratio", 0.0, 1.0, open_low=True)
        if self.target_loss is not None:
            check_number(self.target_loss, "target_loss", 0.0, open_low=True)
        if not isinstance(self.rho, (tuple, list)) or len(self.rho) != 2:
            raise ValueError(f"rho must be a pair (rho_loss, rho_size) of numbers >= 0, got {self.rho!r}")
        for value in self.rho:
            check_number(value, "rho", 0.0)
        object.__setattr__(self, "rho", tuple(float(value) for value in self.rho))
        check_number(self.ema, "ema", 0.0, 1.0, open_high=True)
        check_number(self.recovery, "recovery", 0.0, 1.0, open_high=True)
        if isinstance(self.trims, bool) or not isinstance(self.trims, int) or self.trims < 1:
            raise ValueError(f"trims must be an int >= 1, got {self.trims!r}")
        if isinstance(self.prune_at, str) or not all(point in PRUNE_POINTS for point in self.prune_at):
            raise ValueError(f"prune_at must be a tuple of values from {PRUNE_POINTS}, got {self.prune_at!r}")
        object.__setattr__(self, "prune_at", tuple(self.prune_at))
        for name in ("lr_cores", "lr_gates"):
            check_number(getattr(self, name), name, 0.0)
        if self.core_rule not in CORE_RULES:
            raise ValueError(f"core_rule must be one of {CORE_RULES}, got {self.core_rule!r}")
        _check_patterns(self.zero_last)
        if self.zero_last and self.core_rule != "spectral":
            raise ValueError(
                "zero_last needs core_rule='spectral' (the uniform rule keeps the layers' own "
                f"initialisation), got zero_last={list(self.zero_last)} with core_rule={self.core_rule!r}"
            )
        object.__setattr__(self, "zero_last", tuple(self.zero_last))
        shares = checked_shares(self.rank_shares, "rank_shares") if self.rank_shares != {} else {}
        object.__setattr__(self, "rank_shares", shares)
