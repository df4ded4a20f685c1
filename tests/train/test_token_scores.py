"""TokenScores: summed token cross entropy and accuracy, exact over batches and across merged ranks."""

import math

import numpy as np
import pytest
import torch

from comera.train.evaluation import TokenScores, perplexity
from comera.workloads.llm.recipe import NextTokenEvaluator
from comera.workloads.mlm.recipe import MaskedLMEvaluator


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


def test_perplexity_is_exp_of_the_loss_and_inf_where_exp_overflows():
    for loss in (0.0, 1e-12, 2.5, 700.0, 709.78):
        assert perplexity(loss) == math.exp(loss)
    for loss in (709.79, 1e4, 1e300, math.inf):
        assert perplexity(loss) == math.inf
    assert math.isnan(perplexity(math.nan))


@pytest.mark.parametrize("evaluator", [NextTokenEvaluator, MaskedLMEvaluator])
def test_a_diverged_models_loss_gives_an_infinite_perplexity_not_an_overflow(evaluator):
    scores = evaluator()
    scores.reset()
    scores.add(torch.tensor([[0.0, 2e4], [3e4, 0.0]]), torch.tensor([0, 1]))
    metrics = scores.compute()
    assert math.isfinite(metrics[next(name for name in metrics if name.endswith("loss"))])
    assert metrics["perplexity"] == math.inf
