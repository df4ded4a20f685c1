"""The Trainer runs the late-stage controller exactly once per applied step, and not for a skipped one.

Counting controller steps: with the gates' learning rate 0 nothing changes the size, so every controller step
of the descend phase multiplies the dual weight by ``exp(DUAL_RATE * gap)`` with the constant
``gap = S / S* - 1``, and the trim comes at the deadline: the ``LATE``-th controller step of the late stage
(``recovery = 0``, one trim: ``trims = 1``). ``LATE`` applied late steps therefore end with one trim at the
last step and the weight ``exp((LATE - 1) DUAL_RATE gap)``; a skipped step leaves one controller step out (no
trim); a controller run twice per step would trim halfway.
"""

import math

import pytest
from tiny import loss_fn, make_data, make_model
from torch.optim.optimizer import _global_optimizer_post_hooks

from comera.methods.comera import CoMERAObjective
from comera.rank.adaptation import DUAL_RATE
from comera.train import TrainConfig, Trainer, read_metrics

EARLY = 2
LATE = 8
TARGET_RATIO = 0.8
GAP = 1 / TARGET_RATIO - 1


class NaNOnCall:
    """``loss_fn`` whose loss is NaN on one call (the Trainer calls it once per step, eagerly)."""

    def __init__(self, bad_call: int | None):
        self.bad_call = bad_call
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        loss = loss_fn(model, batch)
        return loss * float("nan") if self.calls == self.bad_call else loss


@pytest.mark.parametrize("bad_call", [None, EARLY + 3], ids=["every_step_applied", "one_late_step_skipped"])
def test_the_controller_runs_once_per_applied_step(bad_call, tmp_path):
    config = TrainConfig(
        early=EARLY,
        late=LATE,
        unit="step",
        batch_size=8,
        compile=False,
        run_dir=str(tmp_path),
        plot=False,
    )
    model = make_model()
    objective = CoMERAObjective(
        model, target_ratio=TARGET_RATIO, recovery=0.0, trims=1, lr_gates=0.0, prune_at=()
    )
    hooks = len(_global_optimizer_post_hooks)
    trainer = Trainer(model, NaNOnCall(bad_call), make_data(), config=config, objective=objective)
    result = trainer.fit()
    adaptation = trainer.objective.adaptation
    trims = [
        record["step"]
        for record in read_metrics(tmp_path)
        if record["kind"] == "event" and record["event"] == "objective" and record["action"] == "trim"
    ]
    assert result.step == EARLY + LATE
    assert float(adaptation.size_weight) == pytest.approx(math.exp((LATE - 1) * DUAL_RATE * GAP), rel=1e-6)
    if bad_call is None:
        assert result.nonfinite == 0 and trims == [EARLY + LATE] and adaptation.phase == "recover"
    else:
        assert result.nonfinite == 1 and trims == [] and adaptation.phase == "descend"
    assert len(_global_optimizer_post_hooks) == hooks, "the Trainer runs the controller itself, not by a hook"
