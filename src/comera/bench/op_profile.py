"""Where a training step's CPU time goes: ``torch.profiler``'s operator totals of a few steps, per step, in
the categories that tell a tensor-train step from a dense one (matrix products, copies and reshapes,
elementwise, attention, embedding and loss, the optimizer) plus the operator count."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["CATEGORIES", "category_of", "profile_steps"]

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"^(aten::_foreach_|aten::_fused_adam|Optimizer\.)"),
    ("attention", r"scaled_dot_product|flash_attention|_efficient_attention|softmax_backward|aten::_softmax"),
    ("embedding and loss", r"embedding|nll_loss|log_softmax|cross_entropy"),
    ("matrix products", r"^aten::(mm|bmm|addmm|baddbmm|matmul|linear|einsum|tensordot|dot|mv|addmv)$"),
    (
        "copies and reshapes",
        r"^aten::(copy_|clone|contiguous|cat|stack|permute|transpose|t|view|reshape|_reshape_alias|expand|"
        r"as_strided|_unsafe_view|unsqueeze|squeeze|select|slice|split|narrow|index_select|empty|empty_like|"
        r"zeros|zeros_like|ones_like|new_zeros|new_empty|flatten|unflatten|detach|alias|to|_to_copy|"
        r"empty_strided|resize_|fill_|zero_)$",
    ),
    ("elementwise", r"^aten::"),
)
"""(category, regular expression on the operator's name), tried in order; an operator no pattern matches
(autograd nodes, profiler records) is ``other``."""

_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in CATEGORIES)


def category_of(operator: str) -> str:
    """The first category of :data:`CATEGORIES` whose pattern matches ``operator`` (a profiler key such as
    ``aten::mm``), else ``other``."""
    return next((name for name, pattern in _COMPILED if pattern.search(operator)), "other")


def profile_steps(step: Callable[[], None], steps: int, top: int = 8) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step`` on the CPU and return, per step: ``ms`` (the operators' self
    time), ``operators`` (operator calls), ``categories`` (``{category: {"ms", "calls"}}``) and ``top`` (the
    ``top`` operators by self time: ``{"op", "ms", "calls"}``); ``ValueError`` naming ``steps`` below 1."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    events = list(profiler.key_averages())
    categories: dict[str, dict[str, float]] = {}
    for event in events:
        total = categories.setdefault(category_of(event.key), {"ms": 0.0, "calls": 0.0})
        total["ms"] += event.self_cpu_time_total / 1e3 / steps
        total["calls"] += event.count / steps
    ranked = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:top]
    return {
        "ms": sum(entry["ms"] for entry in categories.values()),
        "operators": sum(event.count for event in events if event.key.startswith("aten::")) / steps,
        "categories": categories,
        "top": [
            {"op": event.key, "ms": event.self_cpu_time_total / 1e3 / steps, "calls": event.count / steps}
            for event in ranked
        ],
    }
