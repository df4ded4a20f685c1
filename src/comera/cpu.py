"""CPU allocation tuning for training with compressed layers (:func:`reuse_freed_memory`, glibc's ``mallopt``
so freed blocks stay in the heap), and the process's resident memory from ``/proc/self/status``
(:func:`status_kib`, :func:`reset_peak_resident`, Linux). Details: docs/training.md, "CPU allocation"."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

__all__ = ["reuse_freed_memory", "status_kib", "reset_peak_resident"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_NEVER_TRIM = -1
"""``M_TRIM_THRESHOLD`` of -1: glibc never gives the top of its heap back to the kernel."""


def reuse_freed_memory(threshold_bytes: int = 1 << 30) -> bool:
    """Keep freed blocks below ``threshold_bytes`` in the heap for reuse and never trim it (glibc
    ``mallopt``), so activations freed at once (over 1 GiB in a masked-LM step at 4 x 512 tokens) are not
    faulted in again.

    Args:
        threshold_bytes: blocks smaller than this are served from (and returned to) the heap; in
            ``[1 MiB, 2 GiB)``.

    Returns:
        True when the setting was applied; False where the C library has no ``mallopt`` (not glibc).
    """
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int):
        raise ValueError(f"threshold_bytes must be an int in [1 MiB, 2 GiB), got {threshold_bytes!r}")
    if not (1 << 20) <= threshold_bytes < (1 << 31):
        raise ValueError(f"threshold_bytes must be in [1 MiB, 2 GiB), got {threshold_bytes}")
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt"):
        return False
    applied = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
    return applied and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1


def status_kib(field: str) -> int | None:
    """The ``field`` line of ``/proc/self/status`` (e.g. ``"VmRSS"``, ``"VmHWM"``) in KiB; None where the
    file or the field does not exist (not Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_resident() -> bool:
    """Reset the kernel's resident high-water mark (``VmHWM``) to the current resident set, through
    ``/proc/self/clear_refs``; False where that is not possible (not Linux, or not permitted)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return status_kib("VmHWM") is not None
