"""Whether a run ended at a plateau: the relative change ``(m_end - m_start) / |m_start|`` of an evaluation
metric over the last fifth of the run, against :data:`PLATEAU_TOLERANCE`; runs too short to judge say so.
Details: docs/recipes.md, 'Comparing methods: comera compare'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "PLATEAU_TOLERANCE",
    "LAST_PART",
    "MIN_EVALUATIONS",
    "MIN_STEPS",
    "TOO_SHORT",
    "last_fifth_change",
    "at_plateau",
    "plateau_note",
]

PLATEAU_TOLERANCE = 0.01
"""Largest relative change over the last fifth of a run that still counts as a plateau (1 %)."""
LAST_PART = 0.2
"""The share of the run, by evaluated step, over which the change is measured."""
MIN_EVALUATIONS = 5
"""The fewest evaluations of the metric a plateau is judged on."""
MIN_STEPS = 100
"""The earliest step the last evaluation may come at for a plateau to be judged."""
TOO_SHORT = "too short to judge a plateau"
"""The note of a run below :data:`MIN_EVALUATIONS` or :data:`MIN_STEPS`."""


def _points(records: Sequence[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every evaluation with a finite ``metric``, in the records' order."""
    return [
        (record["step"], record["metrics"][metric])
        for record in records
        if record.get("kind") == "eval"
        and isinstance(record.get("metrics", {}).get(metric), (int, float))
        and math.isfinite(record["metrics"][metric])
    ]


def last_fifth_change(records: Sequence[dict[str, Any]], metric: str) -> float | None:
    """Relative change of ``metric`` between the last evaluation and the last one at or before 80 % of its
    step, or None when fewer than two finite evaluations exist or none is at or before 80 %.

    Args:
        records: the run's ``metrics.jsonl`` records (:func:`comera.train.metrics.read_metrics`).
        metric: an evaluation metric's name (e.g. ``"loss"``).
    """
    points = _points(records, metric)
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


def plateau_note(records: Sequence[dict[str, Any]], metric: str) -> str | None:
    """``"plateau"`` or ``"not at a plateau"`` for a run long enough to judge, :data:`TOO_SHORT`
    for one with fewer than :data:`MIN_EVALUATIONS` finite evaluations of ``metric`` or whose last one is
    before :data:`MIN_STEPS`, None for a run without any evaluation of it or whose change cannot be measured
    (:func:`last_fifth_change`)."""
    points = _points(records, metric)
    if not points:
        return None
    if len(points) < MIN_EVALUATIONS or points[-1][0] < MIN_STEPS:
        return TOO_SHORT
    plateau = at_plateau(last_fifth_change(records, metric))
    if plateau is None:
        return None
    return "plateau" if plateau else "not at a plateau"
