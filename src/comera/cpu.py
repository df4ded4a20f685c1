"""CPU allocation tuning for training with compressed layers, and the process's resident memory.

A compressed layer spends a large share of its time allocating fresh output-sized tensors. glibc returns
freed blocks above its mmap threshold (at most 32 MiB) to the kernel, and trims the top of its heap once
more than twice that is free, so such tensors are faulted in and zeroed page by page again.
:func:`reuse_freed_memory` raises the threshold and turns trimming off, so freed blocks stay in the heap and
are reused, which the layer benchmark measures (``comera bench layers --allocator``). It changes the whole
process's allocator, for dense and compressed layers alike, and costs memory that stays mapped after a peak.

:func:`status_kib` reads ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the resident set and its high-water
mark) and :func:`reset_peak_resident` resets the high-water mark to the current resident set (Linux), so a
peak can be measured over a part of a process's life (the Trainer's: training only, not the data build
before it).
"""

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
    """Keep freed blocks below ``threshold_bytes`` in the heap for reuse (glibc ``mallopt``).

    Blocks below the threshold come from the heap, and the heap is never trimmed: however much is freed at
    once (a masked-LM step at 4 x 512 tokens frees over 1 GiB of activations), it stays mapped for the next
    step instead of being faulted in again.

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
