"""RankAdaptation.after_step with the size controlled by hand: the dual update, the trim margin and the
reach tolerance at their exact boundaries, what the trim event records, the choice between the structures
below and above the target, and the held gates.

The model is one 4-core TTLinear of rank 4 over modes (4, 4 | 4, 4): every bond size is 4, so live ranks
(r1, r2, r3) hold ``4 (r1 + r1 r2 + r2 r3 + r3)`` core entries (160 at full rank, 16 at the floor).
"""

import math

import pytest
import torch
from torch import nn

import comera.rank.adaptation as adaptation_module
from comera import RankAdaptation, TTLinear, prune_
from comera.rank import TrimChoice
from comera.rank.adaptation import DUAL_RATE, TARGET_TOLERANCE, TRIM_MARGIN, LateStageEvent


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64))
    assert [tuple(core.shape) for core in model[0].cores] == [(1, 4, 4), (4, 4, 4), (4, 4, 4), (4, 4, 1)]
    return model


def _size(r1, r2, r3):
    return 4 * (r1 + r1 * r2 + r2 * r3 + r3)


def _set_ranks(model, ranks):
    with torch.no_grad():
        for gate, rank in zip(model[0].gates, ranks):
            gate[rank:] = 0.0


def _late(model, ratio, tau=None, **kwargs):
    for layer in model:
        if tau is not None and hasattr(layer, "gates"):
            layer.tau = tau  # the layers own the threshold; the controller reads it
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(ratio, target_loss=1.0, **kwargs)
    return adaptation


def test_dual_weight_rises_by_the_relative_gap_when_it_is_below_one():
    model = _model()
    adaptation = _late(model, 0.625)  # S* = 100, size 160: gap 160 / 100 - 1 = 0.6
    assert adaptation.target_size == 100.0 and adaptation.size() == _size(4, 4, 4) == 160
    assert adaptation.after_step(1) is None
    assert float(adaptation.size_weight) == pytest.approx(math.exp(DUAL_RATE * 0.6), rel=1e-12)
    assert adaptation.after_step(2) is None
    assert float(adaptation.size_weight) == pytest.approx(math.exp(2 * DUAL_RATE * 0.6), rel=1e-12)
    # 160 is above (1 + TARGET_TOLERANCE) S* = 105 and above (1 + TRIM_MARGIN) S* = 110: still descending
    assert (
        adaptation.phase == "descend" and adaptation.reached_at_step is None and not adaptation.target_reached
    )


def test_size_exactly_at_the_trim_margin_trims():
    model = _model()
    adaptation = _late(model, 0.4545454545454545)  # S* = 72.72..., (1 + TRIM_MARGIN) S* = 80 exactly
    _set_ranks(model, (4, 3, 1))
    assert adaptation.size() == _size(4, 3, 1) == 80 == (1 + TRIM_MARGIN) * adaptation.target_size
    event = adaptation.after_step(5)
    assert event is not None and event.action == "trim" and event.size_before == 80
    assert adaptation.phase == "recover"
    assert float(adaptation.size_weight) == 1.0  # no dual step at the boundary


def test_reached_at_step_is_the_first_step_at_size_zero_when_every_layer_died():
    model = _model()
    adaptation = _late(model, 0.5)
    with torch.no_grad():
        model[0].gates[1].zero_()  # a dead bond: the model has size 0, there is nothing left to trim
    assert adaptation.size() == 0
    assert adaptation.after_step(3) is None
    assert adaptation.reached_at_step == 3 and adaptation.target_reached and adaptation.phase == "descend"
    assert adaptation.after_step(4) is None
    assert adaptation.reached_at_step == 3


def test_trim_to_a_floor_above_the_tolerance_is_recorded_but_not_reached():
    model = _model()
    adaptation = _late(model, 0.05, late_steps=1, recovery=0.0)  # S* = 8 is below the floor 16
    event = adaptation.after_step(2)
    assert event == LateStageEvent("trim", 2, 160, _size(1, 1, 1), 8.0, 9, 0)  # 3 + 3 + 3 entries cut
    assert event["target_reached"] is False
    assert model[0].ranks == (1, 1, 1) and adaptation.size() == 16
    assert adaptation.reached_at_step is None and not adaptation.target_reached


@pytest.mark.parametrize(
    "size_after, reached",
    [(84, True), (85, False), (120, False), (164, False)],
)
def test_event_target_reached_is_at_most_the_tolerance_above_the_target(size_after, reached):
    assert (1 + TARGET_TOLERANCE) * 80.0 == 84.0
    event = LateStageEvent("trim", 1, 160, size_after, 80.0, 0, 0)
    assert event["target_reached"] is reached


def test_layer_whose_bond_sits_exactly_at_tau_is_left_out_of_the_trim():
    torch.manual_seed(0)
    model = nn.Sequential(
        TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64),
        TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=2, dtype=torch.float64),
    )
    model[0].tau = model[1].tau = 0.25
    adaptation = RankAdaptation(model)
    with torch.no_grad():
        model[1].gates[0].fill_(0.25)  # |g| = tau: dead, the layer has size 0
    assert adaptation.size() == 160
    adaptation.begin_late_stage(0.5, target_loss=1.0, late_steps=1, recovery=0.0)
    event = adaptation.after_step(1)
    assert event is not None and event.size_after == adaptation.size() <= 84
    assert torch.equal(model[1].gates[0].detach(), torch.full((2,), 0.25, dtype=torch.float64))


def test_recover_phase_lifts_kept_entries_to_twice_tau():
    model = _model()
    adaptation = _late(model, 1.0, late_steps=1, recovery=0.0, tau=0.25)
    event = adaptation.after_step(1)
    assert event is not None and event.removed == 0 and model[0].ranks == (4, 4, 4)
    with torch.no_grad():
        model[0].gates[0][1] = 0.3  # live (> tau) but below the hold floor max(2 tau, 1e-3) = 0.5
        model[0].gates[2][0] = -0.3
    assert adaptation.after_step(2) is None
    assert float(model[0].gates[0].detach()[1]) == 0.5 and float(model[0].gates[2].detach()[0]) == -0.5


def test_structure_read_after_a_prune_drops_a_gate_exactly_at_tau():
    model = _model()
    adaptation = _late(model, 0.5, late_steps=1, recovery=0.0, tau=0.25)
    assert adaptation.after_step(1) is not None
    prune_(model)  # new shapes: the held structure is re-read from the live entries
    ranks = model[0].ranks
    with torch.no_grad():
        model[0].gates[0][0] = 0.25  # exactly tau: dead, so not part of the held structure
    assert adaptation.after_step(2) is None
    assert float(model[0].gates[0].detach()[0]) == 0.0
    assert model[0].ranks == (ranks[0] - 1, *ranks[1:])


class _Choices:
    """Stands in for choose_entries: the structure and size answered for each budget, and the budgets asked.

    A structure is the live ranks (r1, r2, r3) to keep (the first entries of each bond)."""

    def __init__(self, answers):
        self.answers = answers
        self.budgets = []

    def __call__(self, trains, budget):
        self.budgets.append(budget)
        size, ranks, removed, revived = self.answers[budget]
        keep = [[torch.arange(len(gate)) < rank for gate, rank in zip(trains[0].gate_list(), ranks)]]
        return TrimChoice(keep, size, removed, revived)


def _trim_with(monkeypatch, answers, ratio=0.625):
    model = _model()
    adaptation = _late(model, ratio, late_steps=1, recovery=0.0)
    choices = _Choices(answers)
    monkeypatch.setattr(adaptation_module, "choose_entries", choices)
    event = adaptation.after_step(1)
    return model, adaptation, choices, event


def test_nearer_structure_above_the_target_replaces_one_too_far_below(monkeypatch):
    above = (1 + TARGET_TOLERANCE) * 100.0  # S* = 100
    answers = {100.0: (90, (4, 2, 4), 2, 0), above: (104, (4, 4, 3), 1, 0)}
    model, adaptation, choices, event = _trim_with(monkeypatch, answers)
    assert choices.budgets == [100.0, above]
    assert (event.size_after, event.removed, event.revived) == (104, 1, 0)
    assert model[0].ranks == (4, 4, 3) and adaptation.reached_at_step == 1


def test_structure_within_the_tolerance_below_is_kept_without_looking_above(monkeypatch):
    above = (1 + TARGET_TOLERANCE) * 100.0
    answers = {100.0: (97, (4, 3, 4), 1, 0), above: (101, (4, 4, 3), 1, 0)}
    model, _, choices, event = _trim_with(monkeypatch, answers)
    assert choices.budgets == [100.0]
    assert event.size_after == 97 and model[0].ranks == (4, 3, 4)


def test_structure_exactly_at_the_tolerance_below_is_kept(monkeypatch):
    assert (1 - TARGET_TOLERANCE) * 100.0 == 95.0
    above = (1 + TARGET_TOLERANCE) * 100.0
    answers = {100.0: (95, (4, 3, 4), 1, 0), above: (100, (4, 4, 3), 1, 0)}
    model, _, choices, event = _trim_with(monkeypatch, answers)
    assert choices.budgets == [100.0]
    assert event.size_after == 95 and model[0].ranks == (4, 3, 4)


@pytest.mark.parametrize("above_size", [90, 88])  # equally near, farther
def test_structure_above_that_is_not_nearer_does_not_replace(monkeypatch, above_size):
    above = (1 + TARGET_TOLERANCE) * 100.0
    answers = {100.0: (90, (4, 2, 4), 2, 0), above: (above_size, (2, 4, 4), 2, 1)}
    model, _, choices, event = _trim_with(monkeypatch, answers)
    assert choices.budgets == [100.0, above]
    assert (event.size_after, event.removed, event.revived) == (90, 2, 0)
    assert model[0].ranks == (4, 2, 4)


def test_trim_landing_exactly_at_the_tolerance_above_reaches_the_target(monkeypatch):
    # S* = 80: a floor of 84 = (1 + TARGET_TOLERANCE) S* is the best the budget 80 gets
    answers = {80.0: (84, (4, 2, 3), 4, 0)}
    model, adaptation, choices, event = _trim_with(monkeypatch, answers, ratio=0.5)
    assert choices.budgets == [80.0] and event.size_before == 160
    assert event.size_after == 84 and event["target_reached"] is True
    assert adaptation.reached_at_step == 1 and adaptation.target_reached
