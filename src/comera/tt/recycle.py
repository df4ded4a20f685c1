"""Large CPU outputs of the TT paths (at least 4 MiB, 64 MiB held at most), recycled once their callers drop
them, which saves the page faults of fresh memory without a process-wide allocator setting. Details:
docs/internals.md, "Fresh memory on a CPU"."""

from __future__ import annotations

import math
import mmap
import sys
import threading
from collections.abc import Sequence

import torch

from comera.tt.workspace import in_graph_capture

__all__ = ["OutputPool", "configure_output_pool", "output_pool", "pooled_output"]

DEFAULT_MIN_BYTES = 4 << 20
DEFAULT_MAX_BYTES = 64 << 20


def _references(held: torch.Tensor) -> tuple[int, int] | None:
    """``held``'s storage use count and the reference count of its Python storage object, as seen from
    here; None where this torch has no storage use count."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    storage = held.untyped_storage()
    return use_count(storage._cdata), sys.getrefcount(storage)


_ALONE = _references(torch.empty(1))
"""What :func:`_references` reports for a tensor nothing else refers to (measured, not assumed)."""


def _unreferenced(held: torch.Tensor) -> bool:
    """Whether nothing but ``held`` refers to its storage: no other tensor or view (the use count), no
    Python storage object kept by anyone (its reference count). False where the counts are unavailable."""
    return _ALONE is not None and _references(held) == _ALONE


class OutputPool:
    """Output buffers handed out and taken back once unreferenced (docs/internals.md, "Fresh memory on a
    CPU").

    Args:
        min_bytes: outputs smaller than this are plain fresh tensors; ``>= 0``.
        max_bytes: most bytes the pool holds, buffers in use included; ``>= 0`` (0: the pool is off).
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._lock = threading.Lock()
        self._held: list[torch.Tensor] = []
        self.configure(min_bytes, max_bytes)
        self.allocations = 0
        self.reuses = 0

    def configure(self, min_bytes: int, max_bytes: int) -> None:
        """Set the limits; buffers beyond the new ``max_bytes`` are dropped (their users keep them)."""
        for name, value in (("min_bytes", min_bytes), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        with self._lock:
            self.min_bytes, self.max_bytes = min_bytes, max_bytes
            kept, total = [], 0
            for held in self._held:
                if total + _nbytes(held) <= max_bytes:
                    kept.append(held)
                    total += _nbytes(held)
            self._held = kept

    def take(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised ``shape`` tensor with ``like``'s dtype and device, not a view of anything; in a
        pooled storage nothing else refers to when there is one of exactly that size."""
        shape = tuple(shape)
        count = math.prod(shape)
        nbytes = count * like.element_size()
        if not self._applies(like, nbytes):
            return like.new_empty(shape)
        with self._lock:
            for held in self._held:
                if held.numel() == count and held.dtype == like.dtype and _unreferenced(held):
                    self.reuses += 1
                    return _alias(held, shape)
            if not self._make_room(nbytes):
                return like.new_empty(shape)
            fresh = _mapped(nbytes, like.dtype)
            self.allocations += 1
            self._held.append(fresh)
            return _alias(fresh, shape)

    def _applies(self, like: torch.Tensor, nbytes: int) -> bool:
        return (
            self.max_bytes > 0
            and like.device.type == "cpu"
            and nbytes > 0
            and self.min_bytes <= nbytes <= self.max_bytes
            and not in_graph_capture()
        )

    def _make_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under ``max_bytes``, after dropping unreferenced buffers (oldest
        first) if that is what makes them fit; nothing is dropped when they would not fit anyway."""
        excess = self.nbytes() + nbytes - self.max_bytes
        if excess <= 0:
            return True
        free = [held for held in self._held if _unreferenced(held)]
        if sum(_nbytes(held) for held in free) < excess:
            return False
        dropped = set()
        for held in free:
            if excess <= 0:
                break
            dropped.add(id(held))
            excess -= _nbytes(held)
        self._held = [held for held in self._held if id(held) not in dropped]
        return True

    def nbytes(self) -> int:
        """Bytes of every buffer the pool holds, in use or free."""
        return sum(_nbytes(held) for held in self._held)

    def free_nbytes(self) -> int:
        """Bytes of the held buffers nothing else refers to (memory the pool alone keeps alive)."""
        with self._lock:
            return sum(_nbytes(held) for held in self._held if _unreferenced(held))

    def release(self) -> None:
        """Drop every buffer (those in use stay alive with their users and are freed by them)."""
        with self._lock:
            self._held.clear()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _mapped(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` of ``dtype`` elements in their own anonymous memory map, outside glibc's heap: a pooled
    buffer held for long must not pin the heap between blocks that activations free around it (measured:
    with heap-allocated pool buffers, a six-encoder training step at batch 32 rose 276 MiB higher)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)


def _alias(held: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``shape`` on ``held``'s storage, not registered as a view (so autograd treats it as
    any fresh output, in-place changes included)."""
    return held.new_empty(0).set_(held.untyped_storage(), 0, shape)


_POOL = OutputPool()


def output_pool() -> OutputPool:
    """The process's pool of TT-path outputs."""
    return _POOL


def configure_output_pool(
    min_bytes: int = DEFAULT_MIN_BYTES, max_bytes: int = DEFAULT_MAX_BYTES
) -> OutputPool:
    """Set the process pool's limits (``max_bytes=0`` turns it off and drops its buffers); returns it."""
    _POOL.configure(min_bytes, max_bytes)
    return _POOL


def pooled_output(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """``output_pool().take(shape, like)``: an uninitialised tensor to return as an output."""
    return _POOL.take(shape, like)
