"""The late-stage switch reads the smoothed task loss, not the batch loss: sequences where the two disagree.

The reference is a direct loop over the task losses: the bias-corrected exponential moving average
``sum_t d^(T-t) (1 - d) L_t / sum_t d^(T-t) (1 - d)`` with the early decay 0.98 before ``begin_late_stage``
and the late decay after it.
"""

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear, TTMLinear
from comera.rank import size_surrogate

_EARLY_DECAY = 0.98


def _model():
    return nn.Sequential(
        TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64),
        nn.Tanh(),
        TTMLinear(16, 8, in_shape=(4, 4), out_shape=(2, 4), rank=3, dtype=torch.float64),
    )


def _moving_average(losses: list[float], decays: list[float]) -> float:
    total = weight = 0.0
    for loss, decay in zip(losses, decays):
        total = decay * total + (1.0 - decay) * loss
        weight = decay * weight + (1.0 - decay)
    return total / weight


@pytest.mark.parametrize(
    "history, spike, expect_switch",
    [
        # a long calm history at the target, then one bad batch: the batch alone says "recover the loss"
        # (gap 0.8 > 0.5), the average (about 1.4) says "keep shrinking"
        (1.0, 5.0, 1.0),
        # a long bad history, then one lucky batch at the target: the batch alone says "keep shrinking"
        # (gap 0.0 < 0.5), the average (about 3.7) says "recover the loss"
        (4.0, 1.0, 0.0),
    ],
)
def test_switch_follows_the_moving_average_where_the_batch_loss_disagrees(history, spike, expect_switch):
    model = _model()
    adaptation = RankAdaptation(model)
    losses, decays = [], []
    for _ in range(150):
        adaptation.loss(torch.tensor(history, dtype=torch.float64))
        losses.append(history)
        decays.append(_EARLY_DECAY)
    late_decay, target_loss, target_ratio = 0.9, 1.0, 0.5
    adaptation.begin_late_stage(target_ratio, target_loss=target_loss, ema=late_decay)
    task = torch.tensor(spike, dtype=torch.float64, requires_grad=True)
    loss = adaptation.loss(task)
    losses.append(spike)
    decays.append(late_decay)

    smoothed = _moving_average(losses, decays)
    size = adaptation.size()
    size_gap = (size - target_ratio * size) / size
    raw_switch = float((spike - target_loss) / spike < size_gap)
    smoothed_switch = float((smoothed - target_loss) / smoothed < size_gap)
    assert raw_switch != smoothed_switch  # the sequence separates the two rules
    assert smoothed_switch == expect_switch
    # the decay enters as a float32 scalar (torch.where of Python floats), hence 1e-6 rather than 1e-12
    assert adaptation.smoothed_loss() == pytest.approx(smoothed, rel=1e-6)
    assert float(adaptation.switch) == expect_switch

    surrogate = float(size_surrogate([model[0], model[2]], adaptation.initial_size).detach())
    expected = 0.1 * spike + 0.01 * surrogate + expect_switch * surrogate + (1 - expect_switch) * spike
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert task.grad.item() == pytest.approx(0.1 + 1.0 - expect_switch)


def test_switch_tracks_the_average_over_a_late_sequence():
    model = _model()
    adaptation = RankAdaptation(model)
    adaptation.loss(torch.tensor(1.0, dtype=torch.float64))
    adaptation.begin_late_stage(0.5, target_loss=1.0, ema=0.7)
    losses, decays = [1.0], [_EARLY_DECAY]
    sequence = [1.2, 3.0, 0.9, 0.8, 2.5, 2.5, 2.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    size_gap = 0.5
    seen = []
    for value in sequence:
        adaptation.loss(torch.tensor(value, dtype=torch.float64))
        losses.append(value)
        decays.append(0.7)
        smoothed = _moving_average(losses, decays)
        assert float(adaptation.switch) == float((smoothed - 1.0) / smoothed < size_gap)
        seen.append(((value - 1.0) / value < size_gap, (smoothed - 1.0) / smoothed < size_gap))
    assert any(raw != average for raw, average in seen)
    assert {average for _, average in seen} == {True, False}
