"""Exact binary-classification metrics over a stream of batches (:class:`BinaryMetrics`: accuracy, ROC AUC,
log loss and normalized entropy), the AUC from every score kept once (9 bytes a sample), mergeable across
processes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["BinaryMetrics", "roc_auc", "binary_entropy"]


def binary_entropy(rate: float) -> float:
    """Entropy (nats) of a Bernoulli(``rate``) variable; 0 at ``rate`` 0 or 1."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate!r}")
    return -sum(p * math.log(p) for p in (rate, 1.0 - rate) if p > 0.0)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC of ``scores`` (N,) against boolean ``labels`` (N,), NaN when one class is absent: the
    share of (positive, negative) pairs the scores order correctly (Mann-Whitney, a tie counting one half)."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels, dtype=bool).reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"scores and labels must have the same length, got {scores.size} and {labels.size}")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return math.nan
    _, group = np.unique(scores, return_inverse=True)
    pos = np.bincount(group, weights=labels).astype(np.int64)
    neg = np.bincount(group).astype(np.int64) - pos
    neg_below = np.cumsum(neg) - neg
    twice_correct = 2 * int(np.dot(pos, neg_below)) + int(np.dot(pos, neg))
    return twice_correct / (2.0 * positives * negatives)


def _as_numpy(values: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64).reshape(-1)


class BinaryMetrics:
    """Streamed exact accuracy, ROC AUC, log loss and normalized entropy: ``update(logits, labels)`` for every
    batch (raw logits of any shape, as many 0/1 labels), then :meth:`compute`; ``state()`` / ``merge()``
    combine several processes' metrics exactly."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen."""
        self._scores: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._count = 0
        self._positives = 0
        self._correct = 0
        self._loss_sum = 0.0

    def update(self, logits: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray) -> None:
        """Add a batch: ``logits`` and ``labels`` with N elements each (labels 0 or 1)."""
        scores = _as_numpy(logits)
        targets = _as_numpy(labels)
        if scores.shape != targets.shape:
            raise ValueError(
                "logits and labels must have the same number of elements, "
                f"got {scores.size} and {targets.size}"
            )
        if not np.all(np.isfinite(scores)):
            raise ValueError("logits must be finite")
        positive = targets == 1.0
        if not np.all(positive | (targets == 0.0)):
            raise ValueError("labels must be 0 or 1")
        self._scores.append(scores)
        self._labels.append(positive)
        self._count += scores.size
        self._positives += int(positive.sum())
        self._correct += int(np.sum((scores > 0.0) == positive))
        # -log p = softplus(-z) for a positive, -log(1 - p) = softplus(z) for a negative
        signed = np.where(positive, -scores, scores)
        self._loss_sum += float(np.sum(np.logaddexp(0.0, signed)))

    @property
    def count(self) -> int:
        """Samples seen."""
        return self._count

    def compute(self) -> dict[str, float]:
        """The metrics over every sample seen; raises ``ValueError`` when nothing was seen.

        Returns:
            ``{"accuracy", "auc", "log_loss", "ne", "count"}``: ``accuracy`` the share of samples with
            ``logit > 0`` equal to the label; ``auc`` exact with ties counted one half (as
            ``sklearn.metrics.roc_auc_score``), NaN with one class; ``log_loss`` the mean binary cross-entropy
            from the logits (no clipping); ``ne`` ``log_loss`` over the entropy of the click rate
            ``mean(y)`` (He et al., 2014), NaN at a rate of 0 or 1.
        """
        if self._count == 0:
            raise ValueError("no samples were given to BinaryMetrics.update")
        log_loss = self._loss_sum / self._count
        entropy = binary_entropy(self._positives / self._count)
        return {
            "accuracy": self._correct / self._count,
            "auc": roc_auc(np.concatenate(self._scores), np.concatenate(self._labels)),
            "log_loss": log_loss,
            "ne": log_loss / entropy if entropy > 0.0 else math.nan,
            "count": float(self._count),
        }

    def state(self) -> dict[str, Any]:
        """A picklable summary of everything seen (for gathering across processes)."""
        scores = np.concatenate(self._scores) if self._scores else np.zeros(0)
        labels = np.concatenate(self._labels) if self._labels else np.zeros(0, dtype=bool)
        return {
            "scores": scores,
            "labels": labels,
            "count": self._count,
            "positives": self._positives,
            "correct": self._correct,
            "loss_sum": self._loss_sum,
        }

    def merge(self, states: list[dict[str, Any]]) -> None:
        """Add the samples summarised by other instances' :meth:`state`."""
        for state in states:
            self._scores.append(np.asarray(state["scores"], dtype=np.float64))
            self._labels.append(np.asarray(state["labels"], dtype=bool))
            self._count += int(state["count"])
            self._positives += int(state["positives"])
            self._correct += int(state["correct"])
            self._loss_sum += float(state["loss_sum"])
