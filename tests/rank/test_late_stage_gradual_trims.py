"""Gradual trims of the late stage, with gates that do not move by themselves (no optimizer): the size must
still fall step by step on the schedule ``S_0 (S* / S_0)^(i / trims)`` instead of in one cut at the deadline.

The model is one 4-core TTLinear of rank 4 over modes (4, 4 | 4, 4): live ranks (r1, r2, r3) hold
``4 (r1 + r1 r2 + r2 r3 + r3)`` core entries (160 at full rank, 16 at the floor). With ``late_steps=20`` and
``recovery=0.5`` the descend window is 10 controller steps; ``trims=5`` cuts it into parts of 2 steps, so the
budgets start at steps 2, 4, 6 and 8 and the deadline trim to the target comes at step 10.
"""

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear
from comera.rank.adaptation import TARGET_TOLERANCE, TRIM_MARGIN

START, RATIO, TRIMS = 160, 0.25, 5


def _model():
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64))


def _late(model, **kwargs):
    adaptation = RankAdaptation(model)
    options = {"late_steps": 20, "recovery": 0.5, "trims": TRIMS, **kwargs}
    adaptation.begin_late_stage(RATIO, target_loss=1.0, **options)
    return adaptation


def _budget(part):
    return START * RATIO ** (part / TRIMS)


def test_the_size_falls_on_the_schedule_and_lands_on_the_target_at_the_deadline():
    adaptation = _late(_model())
    assert adaptation.start_size == START and adaptation.target_size == RATIO * START
    events = {step: adaptation.after_step(step) for step in range(1, 13)}
    partial = {step: event for step, event in events.items() if event is not None and event.action != "trim"}
    assert sorted(partial) == [2, 4, 6, 8]
    sizes = [START]
    for part, step in enumerate([2, 4, 6, 8], start=1):
        event = partial[step]
        assert event.action == "partial_trim" and event.target_size == pytest.approx(_budget(part), rel=1e-12)
        assert event.size_before == sizes[-1] and event.size_after <= _budget(part)
        sizes.append(event.size_after)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    # the cut to the target: right after the size came within the trim margin, else at the deadline
    final_step = 9 if sizes[-1] <= (1 + TRIM_MARGIN) * adaptation.target_size else 10
    final = events[final_step]
    assert final is not None and final.action == "trim" and final.size_before == sizes[-1]
    assert final.size_after <= (1 + TARGET_TOLERANCE) * adaptation.target_size
    assert all(events[step] is None for step in range(1, 13) if step not in (*partial, final_step))
    assert adaptation.phase == "recover" and adaptation.events == [*partial.values(), final]


def test_one_trim_keeps_the_size_until_the_deadline():
    model = _model()
    adaptation = _late(model, trims=1)
    assert all(adaptation.after_step(step) is None for step in range(1, 10))
    assert adaptation.size() == START
    assert adaptation.after_step(10).action == "trim"


def test_entries_a_partial_trim_dropped_stay_at_zero_and_kept_ones_stay_free():
    model = _model()
    adaptation = _late(model)
    adaptation.after_step(1)
    event = adaptation.after_step(2)
    assert event is not None and event.removed > 0
    gates = [gate.detach().clone() for gate in model[0].gates]
    dropped = [(k, j) for k, gate in enumerate(gates) for j in range(gate.numel()) if gate[j] == 0]
    kept = [(k, j) for k, gate in enumerate(gates) for j in range(gate.numel()) if gate[j] != 0]
    assert len(dropped) == event.removed
    with torch.no_grad():
        for k, j in dropped:
            model[0].gates[k][j] = 0.5  # as Adam's momentum would move it
        k, j = kept[0]
        model[0].gates[k][j] = 0.015  # live (> tau = 0.01) but below the recover phase's floor
    assert adaptation.after_step(3) is None and adaptation.phase == "descend"
    assert all(float(model[0].gates[k].detach()[j]) == 0.0 for k, j in dropped)
    assert float(model[0].gates[k].detach()[j]) == 0.015


def test_a_size_already_below_the_budget_is_not_trimmed():
    model = _model()
    adaptation = _late(model)
    with torch.no_grad():
        model[0].gates[1][2:] = 0.0  # ranks (4, 2, 4): size 4 (4 + 8 + 8 + 4) = 96 < the first budget 121.9
    assert adaptation.size() == 96
    assert [adaptation.after_step(step) for step in (1, 2, 3)] == [None, None, None]
    event = adaptation.after_step(4)
    assert event is not None and event.action == "partial_trim" and event.size_before == 96
    assert event.size_after <= _budget(2)


def test_a_resumed_controller_trims_where_the_uninterrupted_one_does():
    first_model, second_model = _model(), _model()
    first = _late(first_model)
    for step in range(1, 4):
        first.after_step(step)
    second = RankAdaptation(second_model)
    second_model.load_state_dict(first_model.state_dict())
    second.load_state_dict(first.state_dict())
    for step in range(4, 12):
        assert first.after_step(step) == second.after_step(step)
    assert first_model[0].ranks == second_model[0].ranks


@pytest.mark.parametrize("trims", [0, -1, 2.0, True, "4"])
def test_trims_must_be_a_positive_int(trims):
    adaptation = RankAdaptation(_model())
    with pytest.raises(ValueError, match=r"trims must be an int >= 1"):
        adaptation.begin_late_stage(RATIO, target_loss=1.0, late_steps=20, trims=trims)


def test_the_switch_aims_at_the_next_parts_budget_and_weighs_the_loss_below_it():
    model = _model()
    adaptation = _late(model)
    task = torch.tensor(1.0, dtype=torch.float64)  # equal to target_loss: the loss gap is 0
    assert float(adaptation.aim_size) == pytest.approx(_budget(1), rel=1e-12)
    adaptation.loss(task)
    assert float(adaptation.switch) == 1.0  # size 160 above the aim: the size term
    with torch.no_grad():
        model[0].gates[1][2:] = 0.0  # size 96, below the first budget
    adaptation.loss(task)
    assert float(adaptation.switch) == 0.0  # at or below the aim: the task loss
    adaptation.after_step(1)
    adaptation.after_step(2)  # part 1 begins: the aim moves to the second budget
    assert float(adaptation.aim_size) == pytest.approx(_budget(2), rel=1e-12)
    for step in range(3, 9):
        adaptation.after_step(step)  # part 4 (the last) aims at the target itself
    assert float(adaptation.aim_size) == adaptation.target_size


def test_without_a_schedule_the_switch_aims_at_the_target():
    adaptation = _late(_model(), trims=1)
    assert float(adaptation.aim_size) == adaptation.target_size
    second = RankAdaptation(_model())
    second.begin_late_stage(RATIO, target_loss=1.0)  # no deadline, no schedule
    assert float(second.aim_size) == second.target_size
