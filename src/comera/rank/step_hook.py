"""An optimizer step post-hook that runs host-side work after every optimizer step of a given set of
parameters, so that a hand-written training loop cannot forget to call it (docs/training.md, "late stage").

The hook is registered globally (``torch.optim.optimizer.register_optimizer_step_post_hook``): it sees every
optimizer, whichever loop or wrapper calls ``step()``. It holds its owner weakly and is removed when the owner
is garbage collected, and it is excluded from ``torch.compile`` (``torch.compiler.disable``), so a compiled
``optimizer.step()`` or training step still calls it eagerly after each step. An optimizer step that does not
happen (a step skipped for a non-finite gradient, or by ``GradScaler``) calls no hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["register_weak_step_hook", "holds_any", "capturing_cuda_graph"]


def register_weak_step_hook(callback: Callable[[torch.optim.Optimizer], None]) -> weakref.finalize:
    """Call the bound method ``callback(optimizer)`` after every optimizer step, while its object lives.

    Returns:
        A ``weakref.finalize`` of the object: calling it removes the hook now (it is idempotent); it also runs
        when the object is garbage collected.
    """
    method = weakref.WeakMethod(callback)

    @torch.compiler.disable
    def after_optimizer_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        bound = method()
        if bound is not None:
            bound(optimizer)

    handle = register_optimizer_step_post_hook(after_optimizer_step)
    return weakref.finalize(callback.__self__, handle.remove)


def holds_any(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> bool:
    """Whether ``optimizer`` has any of ``parameters`` (by identity) in its param groups."""
    wanted = {id(param) for param in parameters}
    return any(id(param) in wanted for group in optimizer.param_groups for param in group["params"])


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a graph (its replays will run no Python hook)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
