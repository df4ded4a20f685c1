"""Evaluation: metrics accumulated over a whole evaluation set, exact (ROC AUC, perplexity from summed token
losses), and merged across DDP ranks; :class:`MeanEvaluator` averages a per-batch function. Details:
docs/training.md, 'The loop'.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from comera.train.distributed import gather_objects
from comera.train.fsdp import gathered

__all__ = ["Evaluator", "MeanEvaluator", "TokenScores", "cuda_devices_of", "perplexity", "run_evaluation"]


class Evaluator:
    """Accumulates metrics over evaluation batches; subclasses implement :meth:`reset`, :meth:`update` (each
    batch of the rank's shard), :meth:`state` / :meth:`merge` (gathered onto rank 0 under DDP) and
    :meth:`compute`.
    """

    def reset(self) -> None:
        """Forget everything seen so far."""
        raise NotImplementedError

    def update(self, model: nn.Module, batch: Any) -> None:
        """Take one batch into account (called under ``torch.no_grad()``, model in eval mode)."""
        raise NotImplementedError

    def state(self) -> Any:
        """What this process has accumulated, as a picklable object (for :meth:`merge` on other ranks)."""
        raise NotImplementedError

    def merge(self, states: list[Any]) -> None:
        """Replace the accumulated values by the combination of ``states`` (every rank's :meth:`state`,
        this one's included)."""
        raise NotImplementedError

    def compute(self) -> dict[str, float]:
        """The metrics over everything accumulated: ``{name: value}``."""
        raise NotImplementedError


_LARGEST_EXPONENT = math.log(sys.float_info.max)


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean cross entropy (nats); ``inf`` where that overflows a float (a loss above
    about 709.78, which only a diverged model reaches: the Trainer then stops with ``training diverged``),
    NaN for NaN."""
    if math.isnan(loss) or loss < _LARGEST_EXPONENT:
        return math.exp(loss)
    return math.inf


class TokenScores(Evaluator):
    """Exact token-level scores over a split: summed cross entropy (in float64), right argmax predictions and
    the number of scored tokens, merged across ranks by summing; subclasses hand logits ``(N, V)`` and
    targets ``(N,)`` to :meth:`add`.
    """

    def reset(self) -> None:
        self.loss_sum, self.correct, self.count = 0.0, 0, 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Score every row: ``logits`` ``(N, V)`` against class ids ``targets`` ``(N,)``."""
        picked = logits.double()
        self.loss_sum += float(nn.functional.cross_entropy(picked, targets, reduction="sum"))
        self.correct += int((picked.argmax(dim=-1) == targets).sum())
        self.count += len(targets)

    def state(self) -> tuple[float, int, int]:
        return self.loss_sum, self.correct, self.count

    def merge(self, states: list[tuple[float, int, int]]) -> None:
        self.loss_sum = sum(state[0] for state in states)
        self.correct = sum(state[1] for state in states)
        self.count = sum(state[2] for state in states)

    def mean_scores(self) -> tuple[float, float]:
        """The mean cross entropy per scored token and the share predicted right; NaN for both when no
        token was scored."""
        if self.count == 0:
            return math.nan, math.nan
        return self.loss_sum / self.count, self.correct / self.count


class MeanEvaluator(Evaluator):
    """The mean over batches of ``fn(model, batch) -> {name: number}``.

    Args:
        fn: per-batch metrics; values may be 0-dim tensors or numbers.
    """

    def __init__(self, fn: Callable[[nn.Module, Any], Mapping[str, Any]]) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(model, batch), got {type(fn).__name__}")
        self.fn = fn
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, float] = {}
        self.batches = 0

    def update(self, model: nn.Module, batch: Any) -> None:
        values = self.fn(model, batch)
        if not isinstance(values, Mapping):
            raise TypeError(f"the evaluation function must return a mapping {{name: value}}, got {values!r}")
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(value)
        self.batches += 1

    def state(self) -> tuple[dict[str, float], int]:
        return dict(self.sums), self.batches

    def merge(self, states: list[tuple[dict[str, float], int]]) -> None:
        self.reset()
        for sums, batches in states:
            self.batches += batches
            for name, value in sums.items():
                self.sums[name] = self.sums.get(name, 0.0) + value

    def compute(self) -> dict[str, float]:
        return {name: total / max(self.batches, 1) for name, total in self.sums.items()}


def cuda_devices_of(module: nn.Module) -> list[int]:
    """The CUDA devices holding ``module``'s parameters, whose generators an evaluation forks with the CPU's
    (empty on a CPU run; written for GPUs, not yet run on one)."""
    return sorted({param.device.index or 0 for param in module.parameters() if param.device.type == "cuda"})


def run_evaluation(
    model: nn.Module, module: nn.Module, batches: Any, evaluator: Evaluator
) -> dict[str, float]:
    """Evaluate ``module`` (the unwrapped model) on ``batches`` with ``evaluator``, merged over DDP ranks:
    ``model`` in eval mode for the duration, gradients off, the global RNG state left as it was, an FSDP
    model gathered whole (:func:`comera.train.fsdp.gathered`).
    """
    was_training = model.training
    model.eval()
    evaluator.reset()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda_devices_of(module)), gathered(module):
            for batch in batches:
                evaluator.update(module, batch)
    finally:
        model.train(was_training)
    evaluator.merge(gather_objects(evaluator.state()))
    return evaluator.compute()
