"""Scratch buffers a module owns and reuses across calls (one flat buffer per name, dtype and device, handed
out as views), for scratch that dies before the call returns. Details: docs/internals.md, "Fresh memory on a
CPU"."""

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
        """An uninitialised ``shape`` tensor with ``like``'s dtype and device, backed by buffer ``name``,
        which grows (counted in :attr:`allocations`) only past its largest request; earlier views alias it."""
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
