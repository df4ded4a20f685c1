"""Scratch buffers a module owns and reuses across calls, so hot paths do not allocate fresh memory per call.

A fresh large tensor costs more than its arithmetic suggests on a CPU: glibc returns big freed blocks to the
kernel, so each new one is faulted in and zeroed page by page. A :class:`Workspace` keeps one flat buffer per
name, dtype and device, grown to the largest request seen and handed out as views; ``release()`` frees them
(e.g. after a peak batch). Only scratch that dies before the call returns may live in a workspace: never an
output, nor a tensor saved for backward. A workspace is not shared between threads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["Workspace", "in_graph_capture", "scratch"]


def in_graph_capture() -> bool:
    """True while ``torch.compile`` traces or a CUDA graph captures (no data-dependent shapes or syncs)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Workspace:
    """Named, growable scratch buffers; :meth:`take` returns a view of the requested shape."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.allocations = 0

    def take(self, name: str, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised ``shape`` tensor with ``like``'s dtype and device, backed by buffer ``name``.

        The buffer grows (a new allocation, counted in :attr:`allocations`) only when ``shape`` holds more
        elements than any earlier request for ``name``; views taken earlier under the same name alias it.
        """
        count = math.prod(shape)
        key = (name, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(count, dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
            self.allocations += 1
        return buffer[:count].view(tuple(shape))

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def release(self) -> None:
        """Drop every buffer (the next :meth:`take` allocates again)."""
        self._buffers.clear()


def scratch(workspace: Workspace | None, name: str, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """``workspace.take(name, shape, like)``, or a fresh tensor without a workspace or inside a captured or
    compiled graph (where the graph owns its memory)."""
    if workspace is None or in_graph_capture():
        return like.new_empty(tuple(shape))
    return workspace.take(name, shape, like)
