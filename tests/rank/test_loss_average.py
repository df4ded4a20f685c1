"""The loss moving average of RankAdaptation keeps its own precision (float64 for a float64 model)."""

import pytest
import torch

from comera import RankAdaptation, TTLinear


def test_average_of_a_float32_loss_is_accumulated_in_float64_for_a_float64_model():
    model = TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=2, dtype=torch.float64)
    adaptation = RankAdaptation(model, gamma=0.0)
    task = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    adaptation.loss(task)
    # one observation: the bias-corrected average is that observation, to float64 rounding
    assert adaptation.smoothed_loss() == pytest.approx(float(task), rel=1e-14, abs=0.0)
    ema_sum, ema_weight = adaptation.loss_average_state()
    assert ema_sum.dtype == ema_weight.dtype == torch.float64
