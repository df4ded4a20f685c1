"""A train record's loss is the mean over the window's applied steps: a skipped step is left out.

Only visible with ``log_every > 1`` and a skipped step inside a window: the loss function below records every
task loss it returns, so the expected means are computed from those values, not from the Trainer.
"""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from comera.train import TrainConfig, Trainer, read_metrics

LOG_EVERY = 4
BAD_CALLS = {2, 7}


class RecordingLoss:
    """Mean squared error that keeps every value it returns; chosen calls get a non-finite gradient
    (``"grad"``: the loss stays finite) or a non-finite loss (``"loss"``)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.values: list[float] = []

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        inputs, targets = batch
        loss = (model(inputs) - targets).pow(2).mean()
        self.values.append(float(loss.detach()))
        if len(self.values) not in BAD_CALLS:
            return loss
        if self.kind == "loss":
            self.values[-1] = float("nan")
            return loss * float("nan")
        weight = model[0].weight
        return loss + torch.sqrt(weight - weight.detach()).sum()  # value unchanged, gradient +inf


@pytest.mark.parametrize("kind", ["grad", "loss"])
def test_window_loss_is_the_mean_of_the_applied_steps(kind, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    data = TensorDataset(torch.randn(96, 6), torch.randn(96, 3))
    loss = RecordingLoss(kind)
    config = TrainConfig(
        early=12,
        unit="step",
        batch_size=8,
        shuffle=False,
        log_every=LOG_EVERY,
        run_dir=str(tmp_path),
        max_nonfinite=3,
        plot=False,
        compile=False,
    )
    Trainer(model, loss, data, config=config).fit()
    records = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [4, 8, 12]
    for record in records:
        window = range(record["step"] - LOG_EVERY, record["step"])
        applied = [loss.values[i] for i in window if i + 1 not in BAD_CALLS]
        assert math.isfinite(record["loss"])
        assert record["loss"] == pytest.approx(sum(applied) / len(applied), rel=1e-6)
    assert records[-1]["nonfinite"] == len(BAD_CALLS)
