"""RankAdaptation's documented defaults, its refusals word for word, and the arithmetic of the late-stage
objective, each against hand-written values.

The late objective is ``rho_L L + (rho_S + s) w S_hat + (1 - s) L`` with the switch ``s = 1`` exactly when the
loss gap ``(L_avg - L*) / |L_avg|`` is below the size gap ``(S - S*) / max(S, 1)``. Feeding a constant task
loss of 1.0 makes the bias-corrected average exactly 1.0, so both gaps are known in closed form.
"""

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear


def _tt3(dtype=torch.float64):
    # cores (1, 3, 2), (2, 4, 2), (2, 5, 1): size 3 * 2 + 2 * 4 * 2 + 2 * 5 = 32
    return TTLinear(12, 5, in_shape=(3, 4), out_shape=(5,), rank=2, dtype=dtype)


def _kill_bond(layer, bond):
    with torch.no_grad():
        layer.gates[bond].zero_()


def _calm(controller, dtype=torch.float64, steps=5):
    """Feed a constant task loss of 1.0: the loss average is then exactly 1.0."""
    for _ in range(steps):
        controller.loss(torch.tensor(1.0, dtype=dtype))
    assert controller.smoothed_loss() == 1.0


def test_a_new_controller_states_the_documented_defaults():
    controller = RankAdaptation(_tt3())
    assert controller.state_dict() == {
        "stage": "early",
        "gamma": 0.01,
        "surrogate": "size",
        "initial_size": 32,
        "target_size": None,
        "target_loss": None,
        "rho": [0.1, 0.01],
        "ema": 0.98,
        "ema_sum": 0.0,
        "ema_weight": 0.0,
        "phase": "early",
        "size_weight": 1.0,
        "late_steps": None,
        "recovery": 0.3,
        "late_count": 0,
        "reached_at_step": None,
        "trims": 8,
        "start_size": None,
        "trim_part": 0,
        "keep": None,
    }
    assert controller.events == []


def _dead_model():
    model = _tt3()
    _kill_bond(model, 1)
    return model


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: RankAdaptation(_tt3(), gamma=-1.0), "gamma must be a finite number in [0.0, inf), got -1.0"),
        (
            lambda: RankAdaptation(nn.Linear(3, 3)),
            "model has no gated layers (TTLinear, TTMLinear, ...); call comera.tensorize_ first",
        ),
        (lambda: RankAdaptation(_dead_model()), "model has size 0: every gated layer has a dead bond"),
    ],
)
def test_construction_refusals_word_for_word(build, message):
    with pytest.raises(ValueError) as error:
        build()
    assert str(error.value) == message


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"target_ratio": 0.0}, "target_ratio must be a finite number in (0.0, 1.0], got 0.0"),
        (
            {"target_ratio": 0.5, "target_loss": 0.0},
            "target_loss must be a finite number in (0.0, inf), got 0.0",
        ),
        (
            {"target_ratio": 0.5, "target_loss": 1.0, "rho": (0.1, -1.0)},
            "rho must be a finite number in [0.0, inf), got -1.0",
        ),
        (
            {"target_ratio": 0.5, "target_loss": 1.0, "ema": 1.0},
            "ema must be a finite number in [0.0, 1.0), got 1.0",
        ),
        (
            {"target_ratio": 0.5, "target_loss": 1.0, "recovery": 1.0},
            "recovery must be a finite number in [0.0, 1.0), got 1.0",
        ),
        ({"target_ratio": 0.5}, "target_loss is required when loss() has not been called yet"),
    ],
)
def test_late_stage_refusals_word_for_word(arguments, message):
    with pytest.raises(ValueError) as error:
        RankAdaptation(_tt3()).begin_late_stage(**arguments)
    assert str(error.value) == message


def test_late_stage_of_a_model_that_died_is_refused_word_for_word():
    model = _tt3()
    controller = RankAdaptation(model)
    _kill_bond(model, 0)
    with pytest.raises(ValueError) as error:
        controller.begin_late_stage(0.5, target_loss=1.0)
    assert (
        str(error.value) == "cannot begin the late stage: the model has size 0 (every layer has a dead bond)"
    )


def test_the_controller_state_is_kept_in_the_precision_of_a_float64_model():
    controller = RankAdaptation(_tt3(torch.float64))
    assert [t.dtype for t in [*controller.device_state(), controller.size_weight]] == [torch.float64] * 4


@pytest.mark.parametrize(
    "model_dtype, loss_dtype", [(torch.float64, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_the_objective_is_in_the_dtype_of_the_task_loss(model_dtype, loss_dtype):
    controller = RankAdaptation(_tt3(model_dtype))
    task = torch.tensor(1.0, dtype=loss_dtype)
    assert controller.loss(task).dtype == loss_dtype
    controller.begin_late_stage(0.5, target_loss=2.0)
    assert controller.loss(task).dtype == loss_dtype


def _late(target_loss, target_ratio=0.5, kill=False):
    model = _tt3()
    with torch.no_grad():
        for gate in model.gates:
            gate.fill_(0.5)  # the size surrogate is then well away from 1
    controller = RankAdaptation(model)
    _calm(controller)
    controller.begin_late_stage(target_ratio, target_loss=target_loss, rho=(0.2, 0.05))
    if kill:
        _kill_bond(model, 0)
    return controller


@pytest.mark.parametrize(
    "target_loss, switch",
    [
        (2.0, 1.0),  # loss gap (1 - 2) / 1 = -1 is below the size gap (32 - 16) / 32 = 0.5
        (0.5, 0.0),  # loss gap 0.5 equals the size gap: a tie goes to the loss
        (0.25, 0.0),  # loss gap 0.75 is above it
    ],
)
def test_late_objective_is_the_scalarisation_with_the_dual_weight(target_loss, switch):
    controller = _late(target_loss)
    controller.size_weight.fill_(3.0)
    surrogate = float(controller.size_surrogate().detach())
    assert abs(surrogate - 1.0) > 0.1
    objective = controller.loss(torch.tensor(1.0, dtype=torch.float64))
    assert float(controller.switch) == switch
    expected = 0.2 * 1.0 + (0.05 + switch) * 3.0 * surrogate + (1.0 - switch) * 1.0
    assert float(objective.detach()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("target_loss, switch", [(0.10000001, 1.0), (0.09999999, 0.0)])
def test_the_switch_resolves_gaps_beyond_float32(target_loss, switch):
    """Size 32, target 3.2: the size gap is 0.9 in float64 (0.89999998 in float32); loss gaps of 1 - L* on
    either side of 0.9 by 1e-8 must fall on their own side."""
    controller = _late(target_loss, target_ratio=0.1)
    controller.loss(torch.tensor(1.0, dtype=torch.float64))
    assert float(controller.switch) == switch


@pytest.mark.parametrize("target_loss, switch", [(13.0, 0.0), (18.0, 1.0)])
def test_a_model_that_died_in_the_late_stage_has_size_gap_minus_the_target(target_loss, switch):
    """Size 0, target 16: the size gap is (0 - 16) / max(0, 1) = -16; loss gaps -12 and -17: one each side."""
    controller = _late(target_loss, kill=True)
    assert controller.size() == 0
    controller.loss(torch.tensor(1.0, dtype=torch.float64))
    assert float(controller.switch) == switch
