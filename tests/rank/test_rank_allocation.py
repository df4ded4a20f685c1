"""allocate_ranks: uneven ranks from shares at the size of the tensorization as given."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import comera
from comera.methods import MethodContext, get_method
from comera.rank import gated_trains
from comera.rank.allocation import allocate_ranks, core_entries


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "q": nn.Linear(64, 64),
            "k": nn.Linear(64, 64),
            "v": nn.Linear(64, 64),
            "down": nn.Linear(256, 64),
        }
    )


CONFIG = comera.TensorizeConfig(target_modules=("q", "k", "v", "down"), format="ttm", rank=8)


def _entries_by_hand(model: nn.Module, config: comera.TensorizeConfig) -> int:
    converted = comera.tensorize_(model, config)
    return sum(core.numel() for _, layer in gated_trains(converted) for core in layer.cores)


def test_core_entries_count_the_cores_the_conversion_makes_and_leave_the_model_alone():
    model = _model()
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert core_entries(model, CONFIG) == _entries_by_hand(_model(), CONFIG)
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert all(isinstance(module, nn.Linear) for module in model.values())


@settings(max_examples=15, deadline=None)
@given(low=st.floats(0.2, 1.0), high=st.floats(1.0, 4.0), rank=st.integers(2, 12))
def test_the_shares_set_proportional_ranks_within_the_uniform_size(low, high, rank):
    config = CONFIG.with_overrides(rank=rank)
    shares = {r"^(q|k)$": low, r"^(v|down)$": high}
    chosen = allocate_ranks(_model(), config, shares)
    budget = _entries_by_hand(_model(), config)
    assert core_entries(_model(), chosen) <= budget
    small, large = chosen.rank_pattern[r"^(q|k)$"], chosen.rank_pattern[r"^(v|down)$"]
    assert small <= large
    alpha = large / high
    assert abs(small - alpha * low) <= 0.5 + alpha * low * 0.5 or small == 1
    bigger = config.with_overrides(rank_pattern={r"^(q|k)$": small, r"^(v|down)$": large + 1})
    assert core_entries(_model(), bigger) > budget or large + 1 > 64, "the larger share cannot grow further"


def test_a_given_total_is_met_from_below_and_unmatched_modules_keep_their_rank():
    chosen = allocate_ranks(_model(), CONFIG, {r"^down$": 1.0}, total=6000)
    assert core_entries(_model(), chosen) <= 6000
    converted = comera.tensorize_(_model(), chosen)
    assert converted["q"].max_ranks == comera.tensorize_(_model(), CONFIG)["q"].max_ranks


@pytest.mark.parametrize(
    ("shares", "total", "message"),
    [
        ({}, None, "shares must be a non-empty mapping"),
        ({"(": 1.0}, None, "shares key '\\(' is not a regular expression"),
        ({"q": 0}, None, r"shares\['q'\] must be a number > 0"),
        ({"q": True}, None, r"shares\['q'\] must be a number > 0"),
        ({"q": 1.0}, 3, r"total \(3\) is below the core entries of rank 1"),
    ],
)
def test_bad_shares_and_totals_are_refused_by_name(shares, total, message):
    with pytest.raises(ValueError, match=message):
        allocate_ranks(_model(), CONFIG, shares, total)


def test_the_comera_method_tensorizes_with_the_allocated_ranks():
    context = MethodContext(tensorize=CONFIG, settings={"rank_shares": {r"^(q|k)$": 0.5, r"^(v|down)$": 2.0}})
    model = get_method("comera").prepare(_model(), context)
    assert max(model["q"].max_ranks) < max(model["v"].max_ranks)
    assert core_entries(_model(), CONFIG) >= sum(
        core.numel() for _, layer in gated_trains(model) for core in layer.cores
    )


def _trained(config: comera.TensorizeConfig = CONFIG) -> nn.Module:
    """A converted model (one bond per layer) whose gates are uneven: ``q``'s bond holds 3 nonzero entries,
    ``down``'s 5, every other entry is live, and the entries of each bond weaken from first to last."""
    model = comera.tensorize_(_model(), config)
    with torch.no_grad():
        model["q"].gates[0][3:] = 0.0
        model["down"].gates[0][5:] = 0.0
        for layer in model.values():
            for gate in layer.gates:
                gate.mul_(torch.linspace(1.0, 0.5, len(gate)))
    return model


def test_ranks_from_gates_at_the_live_size_keep_every_live_entry_and_a_fresh_model_starts_there():
    trained = _trained()
    live = {name: layer.ranks for name, layer in trained.items()}
    assert live["q"] == (3,) and live["down"] == (5,)
    chosen = comera.rank.ranks_from_gates(trained, CONFIG)
    fresh = comera.tensorize_(_model(), chosen)
    assert {name: layer.max_ranks for name, layer in fresh.items()} == live
    size = sum(layer.num_parameters() for layer in trained.values())
    assert core_entries(_model(), chosen) == size == _entries_by_hand(_model(), chosen)


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.8])
def test_ranks_from_gates_stay_within_the_total_ignore_a_layers_scale_and_drop_its_weak_entries(fraction):
    trained = _trained()
    total = int(fraction * sum(layer.num_parameters() for layer in trained.values()))

    def chosen() -> dict[str, nn.Module]:
        config = comera.rank.ranks_from_gates(trained, CONFIG, total=total)
        assert core_entries(_model(), config) <= total
        return dict(comera.tensorize_(_model(), config).items())

    def chosen_ranks() -> dict[str, tuple[int, ...]]:
        return {name: layer.max_ranks for name, layer in chosen().items()}

    base = chosen()
    with torch.no_grad():
        trained["v"].gates[0].mul_(100.0)
    assert chosen_ranks() == {name: layer.max_ranks for name, layer in base.items()}, "scores are relative"
    with torch.no_grad():
        trained["v"].gates[0][4:] *= 1e-4
    weakened = chosen()
    assert weakened["v"].max_ranks[0] <= min(4, base["v"].max_ranks[0])
    others = ("q", "k", "down")
    assert sum(weakened[name].num_parameters() for name in others) >= sum(
        base[name].num_parameters() for name in others
    ), "the entries v gives up go to the other layers"


def test_ranks_from_gates_refuse_a_model_without_gates_and_a_total_below_one_rank_per_bond():
    with pytest.raises(ValueError, match="model has no gated layer"):
        comera.rank.ranks_from_gates(_model(), CONFIG)
    with pytest.raises(ValueError, match=r"total \(10\) is below the core entries of one rank per bond"):
        comera.rank.ranks_from_gates(_trained(), CONFIG, total=10)
    with pytest.raises(ValueError, match="total must be an int >= 1"):
        comera.rank.ranks_from_gates(_trained(), CONFIG, total=0)
