"""Streamed binary metrics against scikit-learn and direct computations."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

from comera.metrics import BinaryMetrics, binary_entropy, roc_auc


def _stream(logits: np.ndarray, labels: np.ndarray, chunk: int) -> BinaryMetrics:
    metrics = BinaryMetrics()
    for start in range(0, logits.size, chunk):
        metrics.update(torch.from_numpy(logits[start : start + chunk]), labels[start : start + chunk])
    return metrics


def _pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """AUC by comparing every (positive, negative) pair, a tie counting one half."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_streamed_metrics_equal_sklearn(chunk):
    rng = np.random.default_rng(0)
    labels = (rng.random(997) < 0.3).astype(np.float32)
    logits = (rng.normal(size=997) + labels).astype(np.float32)
    result = _stream(logits, labels, chunk).compute()
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    assert result["auc"] == pytest.approx(roc_auc_score(labels, logits), abs=1e-12)
    assert result["log_loss"] == pytest.approx(log_loss(labels, probs), rel=1e-9)
    assert result["accuracy"] == accuracy_score(labels, probs > 0.5)
    rate = labels.mean(dtype=np.float64)
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert result["ne"] == pytest.approx(log_loss(labels, probs) / entropy, rel=1e-9)
    assert result["count"] == 997


def test_auc_with_heavy_ties_equals_sklearn_and_pair_count():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 5, size=400).astype(np.float64)
    labels = (rng.random(400) < 0.4).astype(np.int64)
    expected = _pairwise_auc(scores, labels)
    assert roc_auc(scores, labels) == pytest.approx(expected, abs=1e-15)
    assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-15)
    assert roc_auc(np.zeros(6), np.array([0, 1, 0, 1, 1, 0])) == 0.5


def test_auc_of_one_class_is_nan():
    assert math.isnan(roc_auc(np.arange(4.0), np.ones(4)))


def test_log_loss_is_stable_for_extreme_logits():
    metrics = BinaryMetrics()
    metrics.update(torch.tensor([200.0, -200.0]), torch.tensor([0.0, 1.0]))
    assert metrics.compute()["log_loss"] == pytest.approx(200.0)


def test_merge_of_states_equals_one_stream():
    rng = np.random.default_rng(2)
    labels = (rng.random(300) < 0.5).astype(np.float32)
    logits = rng.normal(size=300)
    whole = _stream(logits, labels, 300).compute()
    first, second = _stream(logits[:120], labels[:120], 50), _stream(logits[120:], labels[120:], 50)
    merged = BinaryMetrics()
    merged.merge([first.state(), second.state()])
    assert merged.compute() == pytest.approx(whole, rel=1e-12)


def test_binary_entropy_direct():
    assert binary_entropy(0.5) == pytest.approx(math.log(2))
    assert binary_entropy(0.0) == 0.0
    with pytest.raises(ValueError, match="rate must be in"):
        binary_entropy(1.5)


def test_bad_input_is_rejected():
    metrics = BinaryMetrics()
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        metrics.update(torch.zeros(3), torch.tensor([0.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match="same number of elements"):
        metrics.update(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        metrics.update(torch.tensor([math.nan]), torch.zeros(1))
    with pytest.raises(ValueError, match="no samples"):
        metrics.compute()
