"""CoMERA as a method: its settings are checked with the setting's name, its objective answers the Trainer's
hooks (prune points, stage checks, FP8 switch, parameter groups), and old keyword arguments still work."""

import pytest
import torch
from torch import nn

from comera import TTLinear, param_groups
from comera.methods import (
    CoMERAMethod,
    get_method,
    method_for,
    method_settings,
    settings_type,
    settings_values,
)
from comera.methods.comera import PRUNE_POINTS, CoMERAObjective, CoMERASettings
from comera.recipes.settings import resolve_settings


def gated_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TTLinear(12, 16, rank=3), nn.GELU(), nn.Linear(16, 3))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gamma": float("nan")}, "gamma must be a finite number"),
        ({"target_ratio": 0.0}, "target_ratio must be a finite number in \\(0.0, 1.0\\]"),
        ({"target_ratio": 1.5}, "target_ratio"),
        ({"target_loss": 0.0}, "target_loss"),
        ({"rho": (0.1,)}, "rho must be a pair"),
        ({"ema": 1.0}, "ema must be a finite number in \\[0.0, 1.0\\)"),
        ({"recovery": 1.0}, "recovery"),
        ({"prune_at": "early_end"}, "prune_at must be a tuple"),
        ({"prune_at": ("sometimes",)}, "prune_at must be a tuple of values from"),
        ({"surrogate": "l1"}, "surrogate must be one of"),
        ({"lr_cores": -1.0}, "lr_cores"),
        ({"lr_gates": float("inf")}, "lr_gates"),
    ],
)
def test_bad_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        CoMERASettings(**overrides)


def test_settings_round_trip_and_unknown_keys():
    """The method section (plain values, lists for tuples) reads back into the same settings; an unknown key
    is refused naming it."""
    settings = CoMERASettings(rho=[0.2, 0.03], prune_at=["end"], target_loss=0.7)
    values = settings_values(settings)
    assert values["rho"] == [0.2, 0.03] and values["prune_at"] == ["end"]
    assert method_settings("comera", values) == settings
    with pytest.raises(ValueError, match="unknown CoMERASettings keys \\['epochs'\\]"):
        method_settings("comera", {**values, "epochs": 3})


def test_a_method_tau_is_refused_with_where_the_threshold_lives():
    with pytest.raises(
        ValueError, match="unknown key method.tau; .*; tau is a \\[tensorize\\] setting: set tensorize.tau"
    ):
        resolve_settings({"smoke": {}}, "smoke", get_method("comera"), assignments=["method.tau=0.05"])


def test_the_method_is_registered_by_its_settings_type():
    """``comera`` is registered with :class:`CoMERASettings`: the registry gives the method for its settings
    and the settings type for its name; the section's defaults are the dataclass's."""
    method = get_method("comera")
    assert isinstance(method, CoMERAMethod) and method_for(CoMERASettings(gamma=0.5)) is method
    assert settings_type("comera") is CoMERASettings
    assert method_settings("comera", {}) == CoMERASettings()
    with pytest.raises(ValueError, match="gamma must be"):
        method_settings("comera", {"gamma": -1.0})


def test_keyword_overrides_replace_fields_of_the_settings():
    model = gated_model()
    objective = CoMERAObjective(model, CoMERASettings(gamma=0.5, lr_cores=0.1), lr_cores=0.2)
    assert (objective.settings.gamma, objective.settings.lr_cores) == (0.5, 0.2)
    assert objective.adaptation.gamma == 0.5
    with pytest.raises(TypeError, match="unknown CoMERAObjective arguments \\['epochs'\\]"):
        CoMERAObjective(model, epochs=3)
    with pytest.raises(TypeError, match="settings must be a CoMERASettings"):
        CoMERAObjective(model, {"gamma": 0.5})


@pytest.mark.parametrize(
    ("prune_at", "stage", "expected"),
    [
        (("early_end", "late_epoch", "end"), "early", {"early_end", "end"}),
        (("early_end", "late_epoch", "end"), "late", {"epoch_end", "early_end", "end"}),
        (("epoch",), "early", {"epoch_end"}),
        ((), "late", set()),
    ],
)
def test_prune_points_follow_prune_at_and_the_stage(prune_at, stage, expected):
    assert set(PRUNE_POINTS) == {"early_end", "late_epoch", "epoch", "end"}
    objective = CoMERAObjective(gated_model(), prune_at=prune_at, target_loss=1.0)
    if stage == "late":
        objective.begin_late_stage(late_steps=4)
    assert {point for point in ("epoch_end", "early_end", "end") if objective.prunes_at(point)} == expected


def test_a_late_stage_without_an_early_one_needs_a_target_loss():
    with pytest.raises(ValueError, match="method.target_loss .* is required when train.early == 0"):
        CoMERAObjective(gated_model()).check_stages(early=0, late=2)
    CoMERAObjective(gated_model(), target_loss=0.5).check_stages(early=0, late=2)
    CoMERAObjective(gated_model()).check_stages(early=1, late=2)


def test_fp8_switches_every_tt_linear_and_nothing_else():
    model = gated_model()
    objective = CoMERAObjective(model)
    before = model[0].gemm
    objective.set_precision("bf16")
    assert model[0].gemm == before
    objective.set_precision("fp8")
    assert model[0].gemm == "fp8"


def test_parameter_groups_are_comera_s_three_at_the_settings_rates():
    model = gated_model()
    groups = CoMERAObjective(model, lr_cores=0.1, lr_gates=0.2).param_groups(lr=0.3, weight_decay=0.01)
    expected = param_groups(model, lr_cores=0.1, lr_gates=0.2, lr_other=0.3, weight_decay=0.01)
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("cores", 0.1, 0.01),
        ("gates", 0.2, 0.0),
        ("other", 0.3, 0.01),
    ]
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in g["params"]] for g in expected]


def test_parameters_may_go_unused_once_a_prune_removed_a_layer():
    """A prune that only shrinks ranks keeps every parameter on the loss's path; one that removes a layer
    (every gate of a bond dead) may not, and the objective says so (a DDP run then looks for them)."""
    model = gated_model()
    objective = CoMERAObjective(model, target_loss=1.0)
    assert not objective.leaves_parameters_unused()
    with torch.no_grad():
        model[0].gates[0][1:] = 0.0
    objective.prune(None)
    assert model[0].ranks[0] == 1 and not objective.leaves_parameters_unused()
    with torch.no_grad():
        model[0].gates[0].zero_()
    objective.prune(None)
    assert objective.leaves_parameters_unused()
