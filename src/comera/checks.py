"""Argument checks shared by the whole library: each raises ``ValueError`` naming the argument, the valid
range and the value it got. Booleans are never accepted as numbers."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["check_int", "check_optional_int", "check_number", "check_choice", "check_bool"]


def check_int(value: object, name: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]`` (either bound may be None)."""
    ok = not isinstance(value, bool) and isinstance(value, int)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        bounds = {
            (True, True): f" in [{low}, {high}]",
            (True, False): f" >= {low}",
            (False, True): f" <= {high}",
            (False, False): "",
        }[(low is not None, high is not None)]
        raise ValueError(f"{name} must be an int{bounds}, got {value!r}")
    return value


def check_optional_int(
    value: object, name: str, low: int | None = None, high: int | None = None
) -> int | None:
    """None, or :func:`check_int`."""
    return None if value is None else check_int(value, name, low, high)


def check_number(
    value: object,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """``value`` as a float if it is a finite int or float (not a bool) in the interval from ``low`` to
    ``high`` (closed unless ``open_low`` / ``open_high``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        opens = "(" if open_low or math.isinf(low) else "["  # an infinite end is never a finite value
        closes = ")" if open_high or math.isinf(high) else "]"
        interval = f"{opens}{low}, {high}{closes}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return float(value)


def check_choice(value: Any, name: str, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    choices = tuple(choices)
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
