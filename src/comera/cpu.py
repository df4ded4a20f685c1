"""CPU allocation tuning for training with compressed layers.

A compressed layer spends a large share of its time allocating fresh output-sized tensors. glibc returns
freed blocks above its mmap threshold (at most 32 MiB) to the kernel, and trims the top of its heap once
more than twice that is free, so such tensors are faulted in and zeroed page by page again.
:func:`reuse_freed_memory` raises the threshold and turns trimming off, so freed blocks stay in the heap and
are reused, which the layer benchmark measures (``comera bench layers --allocator``). It changes the whole
process's allocator, for dense and compressed layers alike, and costs memory that stays mapped after a peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["reuse_freed_memory"]

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
