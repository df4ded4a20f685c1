"""The non-finite guard: a step whose ``objective + total gradient norm`` is NaN/Inf is skipped, never
applied; after ``max_consecutive`` skipped steps in a row the trainer rolls back to the last checkpoint, and
after ``max_rollbacks`` rollbacks (or with no checkpoint) it raises :class:`NonFiniteError`."""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["NonFiniteError", "NonFiniteGuard", "total_grad_norm"]


class NonFiniteError(RuntimeError):
    """Training kept producing NaN/Inf and could not recover."""


def total_grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together (0-dim tensor; 0 when there is none; NaN/Inf if any is)."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([norm.to(norms[0].device) for norm in norms]))


class NonFiniteGuard:
    """Counts skipped steps and decides when to roll back.

    Attributes:
        total: non-finite steps seen in this run (rollbacks do not reset it).
        consecutive: non-finite steps in a row, up to now.
        rollbacks: rollbacks done so far.
    """

    def __init__(self, max_consecutive: int, max_rollbacks: int) -> None:
        self.max_consecutive = max_consecutive
        self.max_rollbacks = max_rollbacks
        self.total = 0
        self.consecutive = 0
        self.rollbacks = 0

    @staticmethod
    def is_finite(value: float) -> bool:
        """Whether the step's checked number is finite."""
        return math.isfinite(value)

    def record(self, finite: bool) -> bool:
        """Count one step; True when it is time to roll back (``max_consecutive`` bad steps in a row)."""
        if finite:
            self.consecutive = 0
            return False
        self.total += 1
        self.consecutive += 1
        return self.consecutive >= self.max_consecutive

    def begin_rollback(self, step: int, have_checkpoint: bool) -> None:
        """Count a rollback, or raise :class:`NonFiniteError` when none is possible or allowed."""
        if not have_checkpoint:
            raise NonFiniteError(
                f"{self.consecutive} non-finite steps in a row up to step {step} and no checkpoint to roll "
                "back to (none written yet: a run with a folder writes one every train.checkpoint_every "
                "steps, by default at each epoch end)"
            )
        if self.rollbacks >= self.max_rollbacks:
            raise NonFiniteError(
                f"{self.consecutive} non-finite steps in a row up to step {step} after {self.rollbacks} "
                f"rollbacks (max_rollbacks={self.max_rollbacks}); {self.total} non-finite steps in all"
            )
        self.rollbacks += 1
        self.consecutive = 0

    def check_end(self, step: int, last_eval: dict[str, float]) -> None:
        """At the end of a run (``step``, its final evaluation ``last_eval``): raise
        :class:`NonFiniteError` when it ended in non-finite steps and its final evaluation is not finite
        (the rollbacks it had left never got to run out); warn when it ended in non-finite steps with a
        finite final evaluation, or none (the model is that of the last applied step)."""
        if self.consecutive == 0:
            return
        count = self.consecutive
        steps = f"{count} non-finite step{'s' if count > 1 else ''}"
        counts = f"{self.total} in all, {self.rollbacks} rollbacks"
        streak = f"the run ended in {steps} in a row at step {step} ({counts})"
        broken = sorted(
            name for name, value in last_eval.items() if isinstance(value, float) and not math.isfinite(value)
        )
        if broken:
            raise NonFiniteError(f"{streak} and its final evaluation is not finite ({', '.join(broken)})")
        checked = "nothing evaluated it" if not last_eval else "its final evaluation is finite"
        warnings.warn(
            f"{streak}; {checked}: the model is that of the last applied step, check it",
            RuntimeWarning,
            stacklevel=4,
        )

    def state_dict(self) -> dict[str, int]:
        """Counters as plain ints."""
        return {"total": self.total, "consecutive": self.consecutive, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.total = int(state["total"])
        self.consecutive = int(state["consecutive"])
        self.rollbacks = int(state["rollbacks"])
