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


def test_binary_entropy_at_the_ends_of_the_range():
    """Pins the closed range [0, 1]: rate 1.0 is valid (entropy 0); the error names the argument and range."""
    assert binary_entropy(1.0) == 0.0
    assert binary_entropy(0.25) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel=1e-15)
    with pytest.raises(ValueError, match=r"^rate must be in \[0, 1\], got 1\.0001$"):
        binary_entropy(1.0001)
    with pytest.raises(ValueError, match=r"^rate must be in \[0, 1\], got -0\.5$"):
        binary_entropy(-0.5)


def test_roc_auc_with_a_single_positive_or_negative():
    """Pins the one-class check at exactly one sample of a class: that is still a defined AUC, not NaN."""
    scores = np.array([0.1, 0.4, 0.35, 0.8, 0.2])
    one_positive = np.array([0, 0, 1, 0, 0])
    assert roc_auc(scores, one_positive) == pytest.approx(roc_auc_score(one_positive, scores), abs=1e-15)
    assert roc_auc(scores, one_positive) == 0.5  # 0.35 beats 0.1 and 0.2, loses to 0.4 and 0.8
    one_negative = 1 - one_positive
    assert roc_auc(scores, one_negative) == pytest.approx(roc_auc_score(one_negative, scores), abs=1e-15)


def test_roc_auc_flattens_2d_inputs():
    """Pins the flattening of scores and labels: a (3, 4) array against 12 labels, and the reverse."""
    rng = np.random.default_rng(3)
    scores = rng.normal(size=12)
    labels = np.array([0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1])
    expected = roc_auc_score(labels, scores)
    assert roc_auc(scores.reshape(3, 4), labels) == pytest.approx(expected, abs=1e-15)
    assert roc_auc(scores, labels.reshape(4, 3)) == pytest.approx(expected, abs=1e-15)


def test_roc_auc_rejects_different_lengths_with_both_sizes():
    """Pins the length-mismatch error text, which names both arguments and both sizes."""
    with pytest.raises(ValueError, match=r"^scores and labels must have the same length, got 3 and 2$"):
        roc_auc(np.zeros(3), np.array([0, 1]))


def test_roc_auc_counts_any_nonzero_label_as_positive():
    """Pins the boolean conversion of labels: 2 and 3 are positives, as in sklearn with ``labels > 0``."""
    scores = np.array([0.9, 0.1, 0.5, 0.7, 0.3, 0.2])
    labels = np.array([2, 0, 0, 3, 1, 0])
    assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels > 0, scores), abs=1e-15)
    assert roc_auc(scores, labels) == 8 / 9  # the positive 0.3 loses to the negative 0.5


def test_roc_auc_compares_scores_as_float64_like_binary_metrics():
    """Pins the float64 cast of scores: int64 2**53 and 2**53 + 1 are one float64 value, so a tie (0.5),
    the same AUC that BinaryMetrics (which keeps float64 scores) reports for these inputs."""
    scores = np.array([2**53, 2**53 + 1], dtype=np.int64)
    labels = np.array([0, 1])
    assert roc_auc(scores, labels) == 0.5
    metrics = BinaryMetrics()
    metrics.update(scores, labels)
    assert metrics.compute()["auc"] == roc_auc(scores, labels)


def test_update_takes_bfloat16_tensors():
    """Pins the cast to float64 before ``.numpy()``, which has no bfloat16: bf16 logits and labels work and
    give the float64 results of the same (exactly representable) values."""
    logits = torch.tensor([-2.5, -0.75, 0.5, 1.25, 3.0, -1.0], dtype=torch.bfloat16)
    labels = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bfloat16)
    metrics = BinaryMetrics()
    metrics.update(logits, labels)
    result = metrics.compute()
    z, y = logits.double().numpy(), labels.double().numpy()
    probs = 1.0 / (1.0 + np.exp(-z))
    assert result["log_loss"] == pytest.approx(log_loss(y, probs), rel=1e-12)
    assert result["auc"] == pytest.approx(roc_auc_score(y, z), abs=1e-15)
    assert result["accuracy"] == accuracy_score(y, probs > 0.5)


def test_update_computes_the_loss_of_float16_numpy_logits_in_float64():
    """Pins the float64 cast of numpy inputs: float16 logits must not make the loss a float16 sum."""
    rng = np.random.default_rng(4)
    logits = rng.normal(scale=2.0, size=256).astype(np.float16)
    labels = (rng.random(256) < 0.4).astype(np.int64)
    metrics = BinaryMetrics()
    metrics.update(logits, labels)
    probs = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    assert metrics.compute()["log_loss"] == pytest.approx(log_loss(labels, probs), rel=1e-12)


def test_update_flattens_2d_logits_and_labels():
    """Pins the flattening in update: (4, 3) logits with 12 labels, and 12 logits with (12, 1) labels."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=12)
    labels = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1], dtype=np.float32)
    probs = 1.0 / (1.0 + np.exp(-logits))
    for z, y in [(torch.from_numpy(logits).reshape(4, 3), labels), (logits, labels.reshape(12, 1))]:
        metrics = BinaryMetrics()
        metrics.update(z, y)
        result = metrics.compute()
        assert result["log_loss"] == pytest.approx(log_loss(labels, probs), rel=1e-12)
        assert result["auc"] == pytest.approx(roc_auc_score(labels, logits), abs=1e-15)
        assert result["count"] == 12


def test_logit_of_exactly_zero_predicts_the_negative_class():
    """Pins ``logit > 0`` (p > 0.5) as the positive prediction: logits 0.0 and -0.0 (p = 0.5) predict 0."""
    logits = torch.tensor([0.0, -0.0, 1.0, -1.0])
    labels = torch.tensor([0.0, 0.0, 1.0, 0.0])
    metrics = BinaryMetrics()
    metrics.update(logits, labels)
    assert metrics.compute()["accuracy"] == 1.0
    assert accuracy_score(labels.numpy(), logits.numpy() > 0.0) == 1.0


def test_error_messages_are_exact():
    """Pins the whole text of each error (the anchored patterns fail on any added or changed character)."""
    metrics = BinaryMetrics()
    with pytest.raises(
        ValueError, match=r"^logits and labels must have the same number of elements, got 3 and 2$"
    ):
        metrics.update(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match=r"^logits must be finite$"):
        metrics.update(torch.tensor([0.0, math.inf]), torch.zeros(2))
    with pytest.raises(ValueError, match=r"^labels must be 0 or 1$"):
        metrics.update(torch.zeros(2), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match=r"^no samples were given to BinaryMetrics\.update$"):
        metrics.compute()


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_ne_and_auc_are_nan_when_only_one_class_was_seen(label):
    """Pins the ``entropy > 0`` guard: click rate exactly 0 or 1 gives NaN NE (no division by zero) and
    NaN AUC, while the log loss is still the mean cross-entropy."""
    logits = np.array([-1.5, 0.25, 2.0])
    labels = np.full(3, label)
    metrics = BinaryMetrics()
    metrics.update(logits, labels)
    result = metrics.compute()
    assert math.isnan(result["ne"])
    assert math.isnan(result["auc"])
    probs = 1.0 / (1.0 + np.exp(-logits))
    assert result["log_loss"] == pytest.approx(log_loss(labels, probs, labels=[0.0, 1.0]), rel=1e-12)


def test_state_of_empty_metrics():
    """Pins the empty state: zero-length float64 scores and bool labels, zero counts, and that merging it
    changes nothing."""
    state = BinaryMetrics().state()
    assert state["scores"].shape == (0,) and state["scores"].dtype == np.float64
    assert state["labels"].shape == (0,) and state["labels"].dtype == np.bool_
    assert (state["count"], state["positives"], state["correct"], state["loss_sum"]) == (0, 0, 0, 0.0)
    logits = np.array([0.3, -1.2, 2.2, -0.1])
    labels = np.array([1.0, 0.0, 0.0, 1.0])
    alone = _stream(logits, labels, 4)
    merged = BinaryMetrics()
    merged.merge([state, alone.state(), BinaryMetrics().state()])
    assert merged.compute() == alone.compute()
    assert merged.state()["scores"].tolist() == logits.tolist()


def test_merge_keeps_float64_scores_and_bool_labels():
    """Pins the dtype casts in merge: a state whose scores are float32 and labels int 0/1 is kept as float64
    scores and bool labels (the documented 9 bytes a sample), with the same metrics."""
    logits = np.array([0.5, -0.25, 1.75, -2.0, 0.125], dtype=np.float32)
    labels = np.array([1, 0, 0, 0, 1])
    reference = _stream(logits, labels, 5)
    foreign = dict(reference.state(), scores=logits, labels=labels)
    merged = BinaryMetrics()
    merged.merge([foreign])
    state = merged.state()
    assert state["scores"].dtype == np.float64 and state["labels"].dtype == np.bool_
    assert state["scores"].nbytes + state["labels"].nbytes == 9 * logits.size
    assert merged.compute() == reference.compute()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_update_takes_cuda_tensors():
    """Pins the move to the CPU in ``_as_numpy``: CUDA logits and labels give the CPU results."""
    logits = torch.tensor([0.5, -1.0, 2.0, -0.25])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    on_cpu, on_gpu = BinaryMetrics(), BinaryMetrics()
    on_cpu.update(logits, labels)
    on_gpu.update(logits.cuda(), labels.cuda())
    assert on_gpu.compute() == on_cpu.compute()
