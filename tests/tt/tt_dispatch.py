"""Dispatch-mode recorders shared by the tt tests: what really runs inside a ``with`` block."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class GemmFlops(TorchDispatchMode):
    """FLOPs (2 per multiply-add) of the GEMMs dispatched inside the mode: ``mm``/``addmm`` of
    ``(m, k) @ (k, n)`` count ``2 m k n``, ``bmm``/``baddbmm`` of ``(b, m, k) @ (b, k, n)`` count
    ``2 b m k n`` (out= variants too)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"):
            first, second = args[-2], args[-1]
            self.flops += 2 * first.shape[:-1].numel() * first.shape[-1] * second.shape[-1]
        return func(*args, **(kwargs or {}))


class OpNames(TorchDispatchMode):
    """The names (``"aten.mm"``, ...) of every op dispatched inside the mode, in order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
