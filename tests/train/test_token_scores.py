"""TokenScores: summed token cross entropy and accuracy, exact over batches and across merged ranks."""

import math

import numpy as np
import torch

from comera.train.evaluation import TokenScores


def reference(logits: np.ndarray, targets: np.ndarray) -> tuple[float, float]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(len(targets)), targets].mean()
    return float(loss), float((logits.argmax(axis=1) == targets).mean())


def test_batches_split_over_two_ranks_give_the_whole_sets_mean_loss_and_accuracy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 11, generator=generator, dtype=torch.float32) * 3
    targets = torch.randint(11, (37,), generator=generator)
    ranks = [TokenScores(), TokenScores()]
    for scores in ranks:
        scores.reset()
    for start, stop, rank in ((0, 5, 0), (5, 20, 1), (20, 21, 0), (21, 37, 1)):
        ranks[rank].add(logits[start:stop], targets[start:stop])
    ranks[0].merge([scores.state() for scores in ranks])
    loss, accuracy = ranks[0].mean_scores()
    want_loss, want_accuracy = reference(logits.double().numpy(), targets.numpy())
    assert ranks[0].count == 37
    assert math.isclose(loss, want_loss, rel_tol=1e-12)
    assert accuracy == want_accuracy


def test_no_scored_token_gives_nan():
    scores = TokenScores()
    scores.reset()
    scores.add(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    loss, accuracy = scores.mean_scores()
    assert scores.count == 0 and math.isnan(loss) and math.isnan(accuracy)
