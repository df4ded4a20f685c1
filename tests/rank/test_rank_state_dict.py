"""RankAdaptation.state_dict / load_state_dict: the documented keys, the held structure of the recover
phase resumed on a copy of the model, states from before the controller existed, and the errors naming the
key or value at fault."""

import copy

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear

_KEYS = {
    "stage",
    "gamma",
    "surrogate",
    "initial_size",
    "target_size",
    "target_loss",
    "rho",
    "ema",
    "ema_sum",
    "ema_weight",
    "phase",
    "size_weight",
    "late_steps",
    "recovery",
    "late_count",
    "reached_at_step",
    "trims",
    "start_size",
    "trim_part",
    "keep",
}


def _model():
    torch.manual_seed(0)
    # ranks (4, 4, 4), bond sizes 4: 160 core entries
    return nn.Sequential(TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64))


def test_state_dict_holds_the_documented_keys_and_constructor_values():
    adaptation = RankAdaptation(_model(), gamma=0.3, surrogate="mean_gate")
    state = adaptation.state_dict()
    assert set(state) == _KEYS
    assert (state["gamma"], state["surrogate"]) == (0.3, "mean_gate")
    assert (state["stage"], state["phase"], state["initial_size"], state["keep"]) == (
        "early",
        "early",
        160,
        None,
    )


def test_recover_state_carries_the_held_structure_to_a_copy_of_the_model():
    model = _model()
    model[0].tau = 0.25
    first = RankAdaptation(model)
    first.begin_late_stage(0.5, target_loss=1.0, late_steps=1, recovery=0.0)
    event = first.after_step(1)
    assert event is not None and first.phase == "recover"
    state = first.state_dict()
    held = [(gate.detach().abs() > 0.25).tolist() for gate in model[0].gates]
    assert state["keep"] == {"0": held}
    assert sum(not entry for mask in held for entry in mask) == event.removed > 0

    resumed_model = copy.deepcopy(model)
    with torch.no_grad():
        for gate in resumed_model[0].gates:
            gate.fill_(1.0)  # every entry live again: only the loaded structure can cut them
    second = RankAdaptation(resumed_model)
    second.load_state_dict(state)
    assert second.after_step(2) is None
    assert resumed_model[0].ranks == model[0].ranks
    assert second.size() == event.size_after
    assert second.state_dict() == state


def test_early_state_round_trips_and_resumes_the_same_objective():
    model = _model()
    first = RankAdaptation(model, gamma=0.2)
    first.loss(torch.tensor(2.0, dtype=torch.float64))
    state = first.state_dict()
    second = RankAdaptation(model, gamma=0.2)
    second.load_state_dict(state)
    assert second.stage == "early" and second.phase == "early"
    assert second.state_dict() == state
    task = torch.tensor(1.5, dtype=torch.float64)
    assert float(second.loss(task).detach()) == float(first.loss(task).detach())


def test_a_state_without_the_controller_keys_is_refused_naming_them():
    """A state of an earlier comera (before the late-stage controller's keys) is not read with defaults."""
    model = _model()
    first = RankAdaptation(model)
    first.begin_late_stage(0.5, target_loss=1.0)
    state = first.state_dict()
    del state["phase"], state["trims"]
    with pytest.raises(KeyError, match=r"missing keys \['phase', 'trims'\] \(a state of an earlier comera"):
        RankAdaptation(model).load_state_dict(state)


def test_missing_keys_raise_a_key_error_listing_them():
    adaptation = RankAdaptation(_model())
    state = adaptation.state_dict()
    del state["rho"], state["ema"]
    with pytest.raises(KeyError, match=r"RankAdaptation state is missing keys \['ema', 'rho'\]"):
        adaptation.load_state_dict(state)


def test_unknown_stage_raises_naming_the_value():
    adaptation = RankAdaptation(_model())
    state = {**adaptation.state_dict(), "stage": "middle"}
    with pytest.raises(
        ValueError, match=r"^state\['stage'\] must be one of \('early', 'late'\), got 'middle'$"
    ):
        adaptation.load_state_dict(state)


@pytest.mark.parametrize("stage, phase", [("late", "early"), ("late", "cooldown"), ("early", "recover")])
def test_phase_that_does_not_match_the_stage_raises(stage, phase):
    model = _model()
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(0.5, target_loss=1.0)
    state = {**adaptation.state_dict(), "stage": stage, "phase": phase}
    with pytest.raises(
        ValueError, match=rf"^state\['phase'\] must be one of .* matching the stage, got '{phase}'$"
    ):
        RankAdaptation(model).load_state_dict(state)
