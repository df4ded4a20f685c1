"""Checks of a baseline's ``method`` settings: each failure names the setting and its valid range."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["check_int", "check_float", "check_choice"]


def check_int(value: Any, name: str, low: int = 1) -> int:
    """``value`` as an int >= ``low``; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"method.{name} must be an int >= {low}, got {value!r}")
    return value


def check_float(
    value: Any, name: str, low: float = 0.0, high: float = math.inf, open_low: bool = True
) -> float:
    """``value`` as a finite float in ``(low, high]`` (``[low, high]`` with ``open_low=False``)."""
    valid = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > low if open_low else value >= low)
        and value <= high
    )
    if not valid:
        bracket = "(" if open_low else "["
        raise ValueError(f"method.{name} must be a number in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``; ``ValueError`` listing them otherwise."""
    if value not in choices:
        raise ValueError(f"method.{name} must be one of {list(choices)}, got {value!r}")
    return value
