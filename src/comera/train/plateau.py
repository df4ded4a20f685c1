"""Whether a run ended at a plateau: the relative change of an evaluation metric over the last fifth of it.

A comparison of training methods says little about models far from converged, so ``comera compare``
reports, per run, :func:`last_fifth_change` of the validation loss: ``(m_end - m_start) / |m_start|`` with
``m_end`` the last evaluation and ``m_start`` the last evaluation at or before 80 % of the last evaluated
step. A run is at a plateau when that change is smaller than :data:`PLATEAU_TOLERANCE` in magnitude
(:func:`at_plateau`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["PLATEAU_TOLERANCE", "LAST_PART", "last_fifth_change", "at_plateau"]

PLATEAU_TOLERANCE = 0.01
"""Largest relative change over the last fifth of a run that still counts as a plateau (1 %)."""
LAST_PART = 0.2
"""The share of the run, by evaluated step, over which the change is measured."""


def last_fifth_change(records: Sequence[dict[str, Any]], metric: str) -> float | None:
    """Relative change of ``metric`` over the last fifth of the run's evaluations (module doc), or None when
    fewer than two finite evaluations of it exist or none is at or before 80 % of the last one's step.

    Args:
        records: the run's ``metrics.jsonl`` records (:func:`comera.train.metrics.read_metrics`).
        metric: an evaluation metric's name (e.g. ``"loss"``).
    """
    points = [
        (record["step"], record["metrics"][metric])
        for record in records
        if record.get("kind") == "eval"
        and isinstance(record.get("metrics", {}).get(metric), (int, float))
        and math.isfinite(record["metrics"][metric])
    ]
    if len(points) < 2:
        return None
    last_step, last = points[-1]
    earlier = [value for step, value in points[:-1] if step <= (1.0 - LAST_PART) * last_step]
    if not earlier or earlier[-1] == 0:
        return None
    return (last - earlier[-1]) / abs(earlier[-1])


def at_plateau(change: float | None) -> bool | None:
    """Whether a :func:`last_fifth_change` is a plateau (None when it could not be measured)."""
    return None if change is None else abs(change) < PLATEAU_TOLERANCE
