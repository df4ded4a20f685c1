"""The spectral rule: per-core initialisation std and learning rate against the published formulas, and the
width-transfer property that the rule exists for."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from comera import TensorizeConfig, TTLinear, TTMEmbedding, TTMLinear, param_groups
from comera.methods import MethodContext, get_method
from comera.methods.comera import CoMERASettings
from comera.rank.spectral import spectral_init_, spectral_lr_scales
from comera.tt.cores import spectral_std
from comera.tt.shapes import factorize


def _fans_by_hand(core: torch.Tensor, layer: nn.Module, index: int) -> tuple[int, int]:
    """(fan_in, fan_out) read off a core's shape: a TTM core reads its left rank and row mode; a TT core of
    an input mode reads its left rank and mode, one of an output mode its left rank alone."""
    if isinstance(layer, TTMLinear):
        left, rows, cols, right = core.shape
        return left * rows, cols * right
    left, mode, right = core.shape
    return (left * mode, right) if index < len(layer.in_shape) else (left, mode * right)


def test_the_worked_example_of_the_small_q_projection():
    layer = TTMLinear(128, 128, bias=False, in_shape=(4, 4, 8), out_shape=(8, 4, 4), rank=16)
    assert layer.core_fans() == [(4, 128), (64, 64), (128, 4)]
    assert [spectral_std(*fans) for fans in layer.core_fans()] == [0.5, 0.125, 2 / 128]
    scales = spectral_lr_scales(nn.Sequential(layer))
    assert [scales[id(core)] * 2e-3 for core in layer.cores] == pytest.approx(
        [2.1333e-2, 1.3333e-3, 6.6667e-4], rel=1e-4
    )


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from([TTLinear, TTMLinear]),
    in_modes=st.lists(st.integers(2, 5), min_size=2, max_size=3),
    out_modes=st.lists(st.integers(2, 5), min_size=2, max_size=3),
    rank=st.integers(1, 6),
)
def test_per_core_std_and_rate_follow_the_formulas(kind, in_modes, out_modes, rank):
    if kind is TTMLinear:
        out_modes = (out_modes * 3)[: len(in_modes)]
    features_in, features_out = math.prod(in_modes), math.prod(out_modes)
    layer = kind(features_in, features_out, in_shape=in_modes, out_shape=out_modes, rank=rank)
    cores = list(layer.cores)
    for index, core in enumerate(cores):
        assert layer.core_fans()[index] == _fans_by_hand(core, layer, index)
    groups = param_groups(layer, lr_cores=1e-3, lr_gates=5e-4, lr_other=2e-4, core_rule="spectral")
    rate_of = {id(param): group["lr"] for group in groups for param in group["params"]}
    for index, core in enumerate(cores):
        fan_in, fan_out = _fans_by_hand(core, layer, index)
        assert rate_of[id(core)] == pytest.approx(1e-3 * features_in / fan_in / len(cores))
        assert spectral_std(fan_in, fan_out) == pytest.approx(math.sqrt(min(fan_in, fan_out)) / fan_in)
    assert all(rate_of[id(gate)] == 5e-4 for gate in layer.gates)
    assert rate_of[id(layer.bias)] == 2e-4
    torch.optim.AdamW(groups)  # every parameter exactly once, or AdamW raises


def test_spectral_init_draws_each_core_at_its_std_and_zeroes_the_named_last_cores():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "up": TTMLinear(256, 512, in_shape=(8, 4, 8), out_shape=(8, 8, 8), rank=24),
            "down": TTMLinear(512, 256, in_shape=(8, 8, 8), out_shape=(8, 4, 8), rank=24),
        }
    )
    for gate in model["up"].gates:
        gate.data.fill_(0.5)
    names = spectral_init_(model, zero_last=[r"down$"])
    assert names == ["up", "down"]
    for core, (fan_in, fan_out) in zip(model["up"].cores, model["up"].core_fans()):
        assert core.std().item() == pytest.approx(spectral_std(fan_in, fan_out), rel=0.08)
    assert all(bool((gate == 1).all()) for gate in model["up"].gates)
    assert torch.count_nonzero(model["down"].cores[-1]) == 0
    assert torch.count_nonzero(model["down"](torch.randn(3, 512)) - model["down"].bias) == 0


def test_embeddings_keep_the_uniform_rate_under_the_spectral_rule():
    model = nn.ModuleDict({"table": TTMEmbedding(60, 16, rank=3), "proj": TTMLinear(16, 16, rank=3)})
    groups = param_groups(model, lr_cores=1e-3, lr_gates=1e-3, lr_other=1e-3, core_rule="spectral")
    rate_of = {id(param): group["lr"] for group in groups for param in group["params"]}
    assert [rate_of[id(core)] for core in model["table"].cores] == [1e-3] * len(model["table"].cores)
    scales = spectral_lr_scales(model)
    assert [rate_of[id(core)] for core in model["proj"].cores] == [
        1e-3 * scales[id(c)] for c in model["proj"].cores
    ]
    assert not set(scales) & {id(core) for core in model["table"].cores}


def test_an_unknown_core_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="core_rule must be one of"):
        param_groups(TTLinear(8, 8, rank=2), lr_cores=1.0, lr_gates=1.0, lr_other=1.0, core_rule="mup")


def _relative_change_of_one_step(width: int, rule: str, lr_cores: float) -> float:
    """||f_1(x) - f_0(x)|| / ||f_0(x)|| of a TTM layer of ``width`` after one Adam step on a random target."""
    torch.manual_seed(0)
    modes = factorize(width, 3)
    layer = TTMLinear(width, width, bias=False, in_shape=modes, out_shape=tuple(reversed(modes)), rank=8)
    if rule == "spectral":
        spectral_init_(layer)
    x, target = torch.randn(256, width), torch.randn(256, width)
    with torch.no_grad():
        before = layer(x)
    optimizer = torch.optim.Adam(
        param_groups(layer, lr_cores=lr_cores, lr_gates=0.0, lr_other=0.0, core_rule=rule)
    )
    ((layer(x) - target) ** 2).mean().backward()
    optimizer.step()
    with torch.no_grad():
        return ((layer(x) - before).norm() / before.norm()).item()


def test_a_rate_tuned_at_one_width_moves_the_function_alike_at_every_width():
    """The width-transfer property: with the spectral rule and the dense-equivalent rate scaled as 1 / width
    (lr_cores = c * 128 / width), one Adam step changes the layer's output by the same relative amount at
    widths 64 to 1024 (within 1.6x), which is what lets the best multiplier found at one width stay best at
    another; the same rate per core without the rule moves the narrow and the wide layer differently."""
    widths = (64, 128, 256, 512, 1024)
    spectral = [_relative_change_of_one_step(width, "spectral", 1e-2 * 128 / width) for width in widths]
    assert max(spectral) / min(spectral) < 1.6, spectral
    unscaled = [_relative_change_of_one_step(width, "spectral", 1e-2) for width in widths]
    assert max(unscaled) / min(unscaled) > 3.0, unscaled


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"core_rule": "mup"}, "core_rule must be one of"),
        ({"core_rule": "spectral", "zero_last": "down"}, "zero_last must be a list"),
        ({"core_rule": "spectral", "zero_last": ["("]}, r"zero_last entry '\(' is not a regular expression"),
        ({"zero_last": ["down"]}, "zero_last needs core_rule='spectral'"),
    ],
)
def test_bad_rule_settings_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        CoMERASettings(**changes)


def test_the_comera_method_draws_and_groups_by_the_rule_its_settings_name():
    torch.manual_seed(0)
    model = nn.ModuleDict({"attention": nn.ModuleDict({"o": nn.Linear(64, 64)}), "up": nn.Linear(64, 256)})
    config = TensorizeConfig(target_modules=("o", "up"), format="ttm", rank=8)
    settings = {"core_rule": "spectral", "zero_last": [r"\.o$"], "lr_cores": 1e-3}
    context = MethodContext(tensorize=config, settings=settings)
    method = get_method("comera")
    model = method.prepare(model, context)
    assert torch.count_nonzero(model["attention"]["o"].cores[-1]) == 0
    first = model["up"].cores[0]
    assert first.std().item() == pytest.approx(spectral_std(*model["up"].core_fans()[0]), rel=0.25)
    groups = method.objective(model, context).param_groups(lr=5e-4, weight_decay=0.0)
    rate_of = {id(param): group["lr"] for group in groups for param in group["params"]}
    scales = spectral_lr_scales(model)
    for layer in (model["attention"]["o"], model["up"]):
        assert [rate_of[id(core)] for core in layer.cores] == [
            1e-3 * scales[id(core)] for core in layer.cores
        ]
