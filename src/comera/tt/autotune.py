"""Choices measured on the machine at first use and cached per call shape (as cuDNN's benchmark mode does):
the contraction order and the thin-GEMM kernel, off under ``set_autotune(False)``, ``COMERA_AUTOTUNE=0``,
deterministic algorithms, ``torch.compile`` and CUDA-graph capture. Details: docs/internals.md,
"Autotuning"."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "MAX_REPEATS",
    "MEASURE_SECONDS",
    "REPEATS",
    "autotune",
    "autotune_cache",
    "autotune_enabled",
    "cached_choice",
    "clear_autotune_cache",
    "set_autotune",
    "size_bucket",
    "tuned",
]

Choice = TypeVar("Choice", bound=Hashable)

ENVIRONMENT_VARIABLE = "COMERA_AUTOTUNE"
"""``COMERA_AUTOTUNE=0`` in the environment turns autotuning off for the process."""

REPEATS = 3
"""Fewest timed rounds per alternative (after one warm-up round); the median of each decides."""

MAX_REPEATS = 15
"""Most timed rounds per alternative: short alternatives (a small batch, where per-op overhead and the
machine's noise are the same size as the differences) get rounds added, up to this many, while the
measurement has taken less than :data:`MEASURE_SECONDS`."""

MEASURE_SECONDS = 0.05
"""Rounds are added (up to :data:`MAX_REPEATS`) while all timed rounds so far took less than this."""

_switch = {"enabled": os.environ.get(ENVIRONMENT_VARIABLE, "1").strip() != "0"}
_cache: dict[Hashable, Hashable] = {}


def set_autotune(enabled: bool) -> None:
    """Turn autotuning on or off for the process; while it is off the estimates decide (choices already
    measured stay cached and are used again when it is turned back on)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _switch["enabled"] = enabled


@contextmanager
def autotune(enabled: bool) -> Iterator[None]:
    """Autotuning on or off within the block; the setting before it is restored afterwards."""
    before = _switch["enabled"]
    set_autotune(enabled)
    try:
        yield
    finally:
        _switch["enabled"] = before


def _capturing() -> bool:
    """Whether a CUDA-graph capture is in progress (none can be before CUDA is initialised; asking that
    first keeps this check cheap on every call of a CPU run)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def autotune_enabled() -> bool:
    """Whether a call now may measure: the switch is on, deterministic algorithms are not requested, and
    neither ``torch.compile`` tracing nor a CUDA-graph capture is in progress."""
    return (
        _switch["enabled"]
        and not torch.are_deterministic_algorithms_enabled()
        and not torch.compiler.is_compiling()
        and not _capturing()
    )


def autotune_cache() -> dict[Hashable, Hashable]:
    """A copy of the measured choices: cache key -> the fastest alternative."""
    return dict(_cache)


def cached_choice(key: Hashable) -> Hashable | None:
    """The choice measured for ``key``, or None if there is none yet: a cheap first look for callers that
    run on every call (whether measuring is allowed now is the caller's to check, as :func:`tuned` does)."""
    return _cache.get(key)


def clear_autotune_cache() -> None:
    """Forget every measured choice (the next call of each shape measures again)."""
    _cache.clear()


def size_bucket(size: int) -> int:
    """The power-of-two range ``[2^(k-1), 2^k)`` that ``size`` falls in, as ``k`` (0 for 0)."""
    return int(size).bit_length()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_seconds(
    candidates: Sequence[Choice], run: Callable[[Choice], object], device: torch.device
) -> dict[Choice, list[float]]:
    """Each candidate run once to warm up, then rounds of all of them in turn (round-robin, so a change of
    machine load hits every candidate alike): :data:`REPEATS` rounds, and more, up to :data:`MAX_REPEATS`,
    while the timed rounds have taken less than :data:`MEASURE_SECONDS` in all; the seconds of each run."""
    for candidate in candidates:
        run(candidate)
    times: dict[Choice, list[float]] = {candidate: [] for candidate in candidates}
    for rounds in range(MAX_REPEATS):
        if rounds >= REPEATS and sum(map(sum, times.values())) >= MEASURE_SECONDS:
            break
        for candidate in candidates:
            _synchronize(device)
            start = time.perf_counter()
            run(candidate)
            _synchronize(device)
            times[candidate].append(time.perf_counter() - start)
    return times


def _fastest(times: dict[Choice, list[float]], default: Choice) -> Choice:
    """The candidate of smallest median time, if it beat ``default`` consistently: all its runs but the
    slowest quarter (rounded down: all of them for fewer than four rounds) faster than the median of
    ``default``'s (on a busy machine one lucky round must not overturn the estimate, nor one preempted
    round of many keep it); ``default`` otherwise. Without ``default`` among the candidates, the smallest
    median."""
    best = min(times, key=lambda candidate: statistics.median(times[candidate]))
    if best == default or default not in times:
        return best
    runs = sorted(times[best])
    return best if runs[len(runs) - 1 - len(runs) // 4] < statistics.median(times[default]) else default


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """The identity, as the saved-tensor hooks of the timed runs."""
    return tensor


def tuned(
    key: Hashable,
    candidates: Callable[[], Sequence[Choice]],
    default: Choice,
    run: Callable[[Choice], object],
    device: torch.device,
) -> Choice:
    """The fastest of ``candidates`` for the call shape ``key``, measured at its first call.

    Args:
        key: the call shape (hashable); the choice is cached under it.
        candidates: returns the alternatives worth measuring; called only when ``key`` has no cached choice.
        default: the estimate's choice, returned whenever nothing is measured.
        run: runs one alternative once on the call's operands (its result is discarded).
        device: where ``run`` computes (synchronised around each timing on GPUs).

    Returns:
        ``default`` while autotuning is off or cannot measure; else the choice cached for ``key`` (made now
        if there is none by :func:`_fastest`), ``default`` for fewer than two candidates.
    """
    if not autotune_enabled():
        return default
    if key in _cache:
        return _cache[key]  # type: ignore[return-value]
    candidates = tuple(candidates())
    if len(candidates) < 2:
        _cache[key] = default
        return default
    with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):  # out of reach of enclosing hooks
        best = _fastest(_timed_seconds(candidates, run, device), default)
    _cache[key] = best
    return best
