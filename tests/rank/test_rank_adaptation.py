"""RankAdaptation: the early and late objectives against hand-computed formulas, targets, no host syncs."""

import math

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear, TTMLinear, prune_
from comera.rank import size_surrogate
from comera.rank.adaptation import DUAL_RATE, TARGET_TOLERANCE, TRIM_MARGIN


def _model(dtype=torch.float64):
    return nn.Sequential(
        TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=dtype),
        nn.Tanh(),
        TTMLinear(16, 8, in_shape=(4, 4), out_shape=(2, 4), rank=3, dtype=dtype),
    )


def _kill(layer, bond, entries):
    with torch.no_grad():
        layer.gates[bond][list(entries)] = 0.0


def test_early_loss_is_task_loss_plus_gamma_times_size_surrogate():
    model = _model()
    adaptation = RankAdaptation(model, gamma=0.3)
    with torch.no_grad():
        model[0].gates[1].mul_(0.5)
    task = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    loss = adaptation.loss(task)
    expected = 2.0 + 0.3 * float(size_surrogate([model[0], model[2]], adaptation.initial_size).detach())
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert task.grad.item() == 1.0
    assert model[0].gates[1].grad is not None and model[0].gates[1].grad.abs().sum() > 0


def test_mean_gate_surrogate_option():
    model = _model()
    adaptation = RankAdaptation(model, gamma=1.0, surrogate="mean_gate")
    with torch.no_grad():
        model[2].gates[0].fill_(3.0)
    gates = torch.cat([g.detach() for layer in (model[0], model[2]) for g in layer.gates])
    loss = adaptation.loss(torch.tensor(0.0, dtype=torch.float64))
    assert float(loss.detach()) == pytest.approx(float(gates.mean()))


def test_size_ratio_and_initial_size_count_active_ranks():
    model = _model()
    adaptation = RankAdaptation(model)
    full = model[0].num_parameters() + model[2].num_parameters()
    assert adaptation.initial_size == full and adaptation.ratio() == 1.0
    _kill(model[0], 1, [0, 1])
    assert adaptation.size() == model[0].num_parameters() + model[2].num_parameters() < full
    assert adaptation.ratio() == pytest.approx(adaptation.size() / full)


def test_tau_is_read_from_the_gated_layers_which_must_agree():
    model = _model()
    model[0].tau = model[2].tau = 0.2
    assert RankAdaptation(model).tau == 0.2
    model[2].tau = 0.3
    with pytest.raises(ValueError, match=r"different gate thresholds \[0.2, 0.3\]"):
        RankAdaptation(model)


def _late(model, target_ratio=0.5, target_loss=1.0, rho=(0.1, 0.01)):
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(target_ratio, target_loss, rho=rho, ema=0.0)
    return adaptation


def test_late_stage_targets_and_stage():
    model = _model()
    _kill(model[0], 0, [0])
    adaptation = RankAdaptation(model)
    for value in (1.0, 3.0):
        adaptation.loss(torch.tensor(value, dtype=torch.float64))
    adaptation.begin_late_stage(0.25)
    assert adaptation.stage == "late"
    assert adaptation.target_size == pytest.approx(0.25 * adaptation.size())
    smoothed = (0.98 * 0.02 * 1.0 + 0.02 * 3.0) / (1 - 0.98**2)
    assert adaptation.smoothed_loss() == pytest.approx(smoothed)
    assert adaptation.target_loss == pytest.approx(1.05 * smoothed)


@pytest.mark.parametrize(
    "task_value, expect_size_term",
    [(1.01, True), (5.0, False)],  # loss near its target: push size; loss far above: recover loss
)
def test_late_loss_follows_the_switch(task_value, expect_size_term):
    model = _model()
    adaptation = _late(model, target_ratio=0.5, target_loss=1.0)
    task = torch.tensor(task_value, dtype=torch.float64, requires_grad=True)
    loss = adaptation.loss(task)
    size = adaptation.size()
    loss_gap = (task_value - 1.0) / task_value
    size_gap = (size - adaptation.target_size) / size
    assert (loss_gap < size_gap) == expect_size_term
    surrogate = float(size_surrogate([model[0], model[2]], adaptation.initial_size).detach())
    switch = 1.0 if expect_size_term else 0.0
    expected = 0.1 * task_value + 0.01 * surrogate + switch * surrogate + (1 - switch) * task_value
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert float(adaptation.switch) == switch
    loss.backward()
    assert task.grad.item() == pytest.approx(0.1 + 1 - switch)


def test_late_switch_uses_the_smoothed_loss():
    model = _model()
    adaptation = RankAdaptation(model)
    adaptation.loss(torch.tensor(1.0, dtype=torch.float64))
    adaptation.begin_late_stage(0.5, target_loss=1.0, ema=0.9)
    # one noisy batch far above the target does not flip the switch: the average is still near 1.0
    adaptation.loss(torch.tensor(1.5, dtype=torch.float64))
    assert float(adaptation.switch) == 1.0


def test_loss_runs_in_a_full_graph_without_host_syncs():
    model = _model(torch.float32)
    adaptation = RankAdaptation(model)
    adaptation.loss(torch.tensor(1.0))
    adaptation.begin_late_stage(0.5)
    x = torch.randn(4, 16)

    def step(inputs):
        return adaptation.loss(model(inputs).square().mean())

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))


def test_state_dict_round_trip():
    model = _model()
    first = RankAdaptation(model)
    first.loss(torch.tensor(2.0, dtype=torch.float64))
    first.begin_late_stage(0.4, rho=(0.2, 0.02), ema=0.5)
    second = RankAdaptation(model)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    task = torch.tensor(1.3, dtype=torch.float64)
    assert float(second.loss(task).detach()) == float(first.loss(task).detach())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gamma": -1.0}, "gamma"),
        ({"gamma": float("nan")}, "gamma"),
        ({"surrogate": "l0"}, "surrogate"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankAdaptation(_model(), **kwargs)


def test_model_without_gated_layers_raises():
    with pytest.raises(ValueError, match="tensorize_"):
        RankAdaptation(nn.Linear(4, 4))


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0.0,), {"target_loss": 1.0}, "target_ratio"),
        ((1.5,), {"target_loss": 1.0}, "target_ratio"),
        ((0.5,), {"target_loss": -1.0}, "target_loss"),
        ((0.5,), {"target_loss": 1.0, "rho": (0.1,)}, "rho"),
        ((0.5,), {"target_loss": 1.0, "ema": 1.0}, "ema"),
        ((0.5,), {}, "target_loss is required"),
    ],
)
def test_bad_late_stage_arguments_raise(args, kwargs, match):
    adaptation = RankAdaptation(_model())
    with pytest.raises(ValueError, match=match):
        adaptation.begin_late_stage(*args, **kwargs)
    assert adaptation.stage == "early"


def test_task_loss_must_be_a_scalar_tensor():
    adaptation = RankAdaptation(_model())
    with pytest.raises(ValueError, match="task_loss"):
        adaptation.loss(torch.ones(3))


def test_non_finite_losses_leave_the_moving_average_untouched():
    adaptation = RankAdaptation(TTLinear(16, 16, rank=2), gamma=0.0)
    adaptation.loss(torch.tensor(2.0))
    before = adaptation.smoothed_loss()
    for bad in (float("nan"), float("inf")):
        assert not math.isfinite(adaptation.loss(torch.tensor(bad)).item())
    assert adaptation.smoothed_loss() == before == pytest.approx(2.0)
    state = adaptation.loss_average_state()
    adaptation.loss(torch.tensor(10.0))
    assert adaptation.smoothed_loss() > 2.0
    adaptation.restore_loss_average(state)
    assert adaptation.smoothed_loss() == pytest.approx(2.0)


def test_after_step_does_nothing_in_the_early_stage():
    model = _model()
    adaptation = RankAdaptation(model)
    gates = [gate.detach().clone() for gate in model.parameters()]
    assert adaptation.after_step(1) is None
    assert all(torch.equal(a, b.detach()) for a, b in zip(gates, model.parameters()))
    assert adaptation.phase == "early" and not adaptation.target_reached


def test_dual_weight_rises_while_the_size_is_above_the_target():
    model = _model()
    adaptation = _late(model, target_ratio=0.25)
    size, target = adaptation.size(), adaptation.target_size
    expected = 1.0
    for step in range(1, 6):
        assert adaptation.after_step(step) is None
        expected *= math.exp(DUAL_RATE * min(1.0, size / target - 1.0))
        assert float(adaptation.size_weight) == pytest.approx(expected)
    # the descend objective scales the size term by the dual weight
    task = torch.tensor(1.01, dtype=torch.float64)
    surrogate = float(adaptation.size_surrogate().detach())
    switch = 1.0
    expected_loss = 0.1 * 1.01 + (0.01 + switch) * expected * surrogate
    assert float(adaptation.loss(task).detach()) == pytest.approx(expected_loss, rel=1e-9)
    assert not adaptation.target_reached and adaptation.phase == "descend"


def test_trim_when_close_then_recover_with_the_structure_held():
    model = _model()
    adaptation = _late(model, target_ratio=0.5)
    target = adaptation.target_size
    # kill entries by hand until the size is within TRIM_MARGIN of the target, as the descent would
    for layer, bond in ((model[0], 1), (model[0], 2), (model[0], 0), (model[2], 0)):
        for entry in range(layer.gates[bond].numel() - 1, 0, -1):
            if adaptation.size() <= (1 + TRIM_MARGIN) * target:
                break
            _kill(layer, bond, [entry])
    before = adaptation.size()
    assert target < before <= (1 + TRIM_MARGIN) * target or before <= target
    event = adaptation.after_step(7)
    assert event is not None and event.action == "trim" and event.step == 7
    assert event.size_before == before
    assert event.size_after == adaptation.size() <= (1 + TARGET_TOLERANCE) * target
    assert adaptation.phase == "recover" and adaptation.target_reached and adaptation.reached_at_step == 7
    # recovery: the objective is the task loss; optimizer momentum cannot revive a trimmed entry
    task = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    assert float(adaptation.loss(task).detach()) == 2.5
    held = [layer.ranks for layer in (model[0], model[2])]
    with torch.no_grad():
        for layer in (model[0], model[2]):
            for gate in layer.gates:
                gate.add_(0.3)  # what a stale Adam step could do to a dead entry
    assert adaptation.after_step(8) is None
    assert [layer.ranks for layer in (model[0], model[2])] == held
    assert adaptation.size() == event.size_after


def test_deadline_trims_even_when_far_from_the_target():
    model = _model()
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(0.3, target_loss=1.0, late_steps=10, recovery=0.5, trims=1)
    events = [adaptation.after_step(step) for step in range(1, 11)]
    assert all(event is None for event in events[:4])
    assert (
        events[4] is not None
        and events[4].action == "trim"
        and events[4].size_after <= (1 + TARGET_TOLERANCE) * adaptation.target_size
    )
    assert all(event is None for event in events[5:])
    assert adaptation.reached_at_step == 5


def test_prune_after_the_trim_keeps_the_held_structure():
    model = _model()
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(0.4, target_loss=1.0, late_steps=2, recovery=0.5)
    assert adaptation.after_step(1) is not None
    x = torch.randn(3, 16, dtype=torch.float64)
    before, size = model(x), adaptation.size()
    prune_(model)
    assert adaptation.after_step(2) is None
    torch.testing.assert_close(model(x), before)
    assert adaptation.size() == size


def test_recover_phase_loss_runs_in_a_full_graph():
    model = _model(torch.float32)
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(0.5, target_loss=1.0, late_steps=1, recovery=0.0)
    assert adaptation.after_step(1) is not None
    x = torch.randn(4, 16)

    def step(inputs):
        return adaptation.loss(model(inputs).square().mean())

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))


def test_state_dict_round_trip_in_the_recover_phase():
    model = _model()
    first = RankAdaptation(model)
    first.begin_late_stage(0.5, target_loss=1.0, late_steps=4, recovery=0.5)
    for step in range(1, 4):
        first.after_step(step)
    assert first.phase == "recover"
    state = first.state_dict()
    second = RankAdaptation(model)
    second.load_state_dict(state)
    assert second.state_dict() == state
    assert second.phase == "recover" and second.reached_at_step == first.reached_at_step
    with torch.no_grad():
        model[0].gates[0].fill_(1.0)  # revive everything on bond 0; the loaded held structure undoes it
    second.after_step(4)
    assert second.size() == first.size() <= (1 + TARGET_TOLERANCE) * first.target_size


@pytest.mark.parametrize(
    "kwargs, match",
    [({"late_steps": 0}, "late_steps"), ({"late_steps": 2.5}, "late_steps"), ({"recovery": 1.0}, "recovery")],
)
def test_bad_controller_arguments_raise(kwargs, match):
    adaptation = RankAdaptation(_model())
    with pytest.raises(ValueError, match=match):
        adaptation.begin_late_stage(0.5, target_loss=1.0, **kwargs)


def test_after_step_needs_an_int_step():
    adaptation = _late(_model())
    with pytest.raises(ValueError, match="step"):
        adaptation.after_step(1.5)


def test_trim_event_reads_as_a_log_mapping():
    adaptation = RankAdaptation(_model())
    adaptation.begin_late_stage(0.5, target_loss=1.0, late_steps=1, recovery=0.0)
    event = adaptation.after_step(3)
    logged = {"kind": "event", "step": 3, "event": "objective", **event}
    assert logged["kind"] == "event" and logged["step"] == 3 and event.step == 3
    assert event.get("changed") is True and logged["action"] == "trim"
    assert logged["size_after"] == event.size_after == adaptation.size()
    assert logged["target_reached"] == adaptation.target_reached
    assert set(event) == {
        "action",
        "changed",
        "size_before",
        "size_after",
        "target_size",
        "removed",
        "revived",
        "target_reached",
    }
