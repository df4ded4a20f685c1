"""How the command layer writes numbers into its tables and summaries, in one place: a missing value (None) is
``"-"``, a value that is not a number (NaN: a diverged loss) is ``"nan"``, never ``"-"``.
"""

from __future__ import annotations

import math

__all__ = ["milliseconds", "number", "times"]


def number(value: object) -> str:
    """``value`` with four significant digits if a float (a whole number with thousands separators from 10,000
    on, e.g. tokens per second), as ``str`` otherwise; ``"-"`` for None, ``"nan"`` for NaN."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:,.0f}" if math.isfinite(value) and abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def milliseconds(seconds: float | None) -> str:
    """``seconds`` in milliseconds, as :func:`number` writes it."""
    return "-" if seconds is None else number(seconds * 1000)


def times(value: float | None, digits: int | None = None) -> str:
    """A ratio followed by ``x``: ``digits`` decimals, or four significant digits when ``digits`` is None;
    ``"-"`` for None and ``"nan"`` for NaN (no ``x`` after either)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return number(value)
    return f"{value:.{digits}f}x" if digits is not None else f"{number(value)}x"
