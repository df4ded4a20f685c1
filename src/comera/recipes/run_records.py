"""The numbers ``results.json`` gives from a run's metrics records (step time, peak memory, per rank), and
its strict JSON text (NaN and infinities as null)."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

__all__ = [
    "finite_or_none",
    "finite_values",
    "strict_json",
    "median_step_time",
    "peak_memory",
    "per_rank_summary",
]


def finite_or_none(value: float) -> float | None:
    """JSON has no infinity: a ratio without tensorized layers is reported as null."""
    return value if math.isfinite(value) else None


def finite_values(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, dict):
        return {key: finite_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_values(item) for item in value]
    return value


def strict_json(value: Any) -> str:
    """``value`` (dicts, lists, numbers, strings) as strict JSON text, indented with a final newline: NaN
    and infinities become null."""
    return json.dumps(finite_values(value), indent=2, allow_nan=False) + "\n"


def median_step_time(records: list[dict[str, Any]]) -> float:
    """The median ``step_time`` of the train records after the first (its warm-up; one is kept as it is),
    eval and event records and zero or missing times left out; NaN without any."""
    times = [r["step_time"] for r in records if r.get("kind") == "train" and r.get("step_time", 0) > 0]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times) if times else float("nan")


def peak_memory(records: list[dict[str, Any]]) -> float:
    """The largest ``peak_memory_mib`` of the train records; NaN without any."""
    peaks = [r["peak_memory_mib"] for r in records if r.get("kind") == "train" and "peak_memory_mib" in r]
    return max(peaks) if peaks else float("nan")


def per_rank_summary(records: list[dict[str, Any]], processes: int) -> dict[str, list[float]]:
    """Per rank of a run that ends in ``processes`` processes: the median step time and the peak memory
    over the train records written by that many (a run resumed with another ``--nproc`` has records of
    other counts); ``{}`` for a run that ends in one process."""
    rows = [
        r
        for r in records
        if r.get("kind") == "train" and len(r.get("step_time_per_rank") or ()) == processes > 1
    ]
    if not rows:
        return {}
    ranks = range(processes)
    times = [[row["step_time_per_rank"][rank] for row in rows] for rank in ranks]
    peaks = [[row["peak_memory_mib_per_rank"][rank] for row in rows] for rank in ranks]
    return {
        "step_time_s_per_rank": [statistics.median(each[1:] if len(each) > 1 else each) for each in times],
        "peak_memory_mib_per_rank": [max(each) for each in peaks],
    }
