"""FSDP helpers in one process (a one-rank gloo group): sharding is detected, DTensor gradients are told from
replicated ones, the global gradient norm and clipping over both kinds match the whole gradients, refusals
name their setting, and registered replicated layers stay outside FSDP."""

import pytest
import torch
from tiny import make_model
from torch import nn

from comera.train import fsdp
from comera.train.fsdp import (
    check_sharding,
    clip_gradients,
    grad_norm,
    is_sharded,
    register_replicated_layer,
    replicated_parameters,
    shard_model,
    unfuse_mixed_groups,
)

SHARDED = ("5.weight", "5.bias")  # the dense head of the tiny model; the TT layers stay replicated


@pytest.fixture(scope="module")
def group(one_rank_group):
    """The shared one-rank group (tests/conftest.py)."""


@pytest.fixture
def sharded(group):
    """The tiny model sharded at world size 1, with the gradients of one backward pass."""
    model = shard_model(make_model())
    inputs = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))
    model(inputs).square().sum().backward()
    return model


def whole_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as a plain float64 tensor (a DTensor gradient gathered whole)."""
    return {
        name: (param.grad.full_tensor() if name in SHARDED else param.grad).detach().double().clone()
        for name, param in model.named_parameters()
    }


def test_is_sharded_is_true_only_after_shard_model_for_the_model_and_its_parents(group):
    """is_sharded: False for a plain model, True for the sharded one and for a module that contains it."""
    model = make_model()
    assert not is_sharded(model)
    shard_model(model)
    assert is_sharded(model)
    assert is_sharded(nn.Sequential(model))
    assert not is_sharded(make_model())


def test_only_the_dense_parameters_become_dtensors_and_mixed_groups_are_unfused(sharded):
    """is_dtensor tells the sharded head's DTensors from the replicated TT parameters; unfuse_mixed_groups
    turns foreach off for a group mixing both and leaves a plain-only group as it was."""
    for name, param in sharded.named_parameters():
        assert fsdp.is_dtensor(param) == (name in SHARDED), name
        assert fsdp.is_dtensor(param.grad) == (name in SHARDED), name
    assert not fsdp.is_dtensor(torch.zeros(2)) and not fsdp.is_dtensor(None)
    params = dict(sharded.named_parameters())
    mixed = [params["0.bias"], params["5.weight"]]
    plain = [params["3.bias"]]
    optimizer = torch.optim.AdamW(
        [{"params": mixed, "foreach": True}, {"params": plain, "foreach": True}], lr=0.1
    )
    unfuse_mixed_groups(optimizer)
    assert optimizer.param_groups[0]["foreach"] is False and optimizer.param_groups[0]["fused"] is None
    assert optimizer.param_groups[1]["foreach"] is True


def test_grad_norm_over_sharded_and_replicated_gradients_is_the_norm_of_the_whole_gradients(sharded):
    """grad_norm with DTensor and plain gradients: a plain 0-dim tensor, the 2-norm of all whole gradients."""
    grads = whole_gradients(sharded)
    expected = torch.sqrt(sum(grad.square().sum() for grad in grads.values()))
    norm = grad_norm(list(sharded.parameters()))
    assert type(norm) is torch.Tensor and norm.dim() == 0
    assert float(norm) == pytest.approx(float(expected), rel=1e-5)
    # the sharded part alone, then the replicated part alone, each counted once
    sharded_only = torch.sqrt(sum(grads[name].square().sum() for name in SHARDED))
    for name, param in sharded.named_parameters():
        if name not in SHARDED:
            param.grad = None
    assert float(grad_norm(list(sharded.parameters()))) == pytest.approx(float(sharded_only), rel=1e-5)


def test_grad_norm_adds_replicated_gradients_once_when_some_have_none(sharded):
    """grad_norm skips parameters without a gradient and counts every other gradient exactly once."""
    params = dict(sharded.named_parameters())
    params["0.bias"].grad = None
    params["3.bias"].grad = torch.full_like(params["3.bias"], 2.0)
    expected = torch.sqrt(
        sum(
            (param.grad.full_tensor() if name in SHARDED else param.grad).double().square().sum()
            for name, param in params.items()
            if param.grad is not None
        )
    )
    assert float(grad_norm(list(params.values()))) == pytest.approx(float(expected), rel=1e-5)


def scaled_gradients(model: nn.Module, norm: float) -> dict[str, torch.Tensor]:
    """Scale every gradient of ``model`` to a total 2-norm of ``norm``; return the whole gradients."""
    grads = whole_gradients(model)
    total = float(torch.sqrt(sum(grad.square().sum() for grad in grads.values())))
    with torch.no_grad():
        for param in model.parameters():
            param.grad.mul_(norm / total)
    return whole_gradients(model)


@pytest.mark.parametrize("norm", [1e-5, 4.0])
def test_clip_gradients_scales_mixed_gradients_by_max_norm_over_norm_plus_epsilon(sharded, norm):
    """clip_gradients over DTensor and plain gradients: each scaled by max_norm / (norm + 1e-6)."""
    before = scaled_gradients(sharded, norm)
    params = list(sharded.parameters())
    total = grad_norm(params)
    max_norm = norm / 4
    clip_gradients(params, max_norm, total)
    coefficient = max_norm / (float(total) + 1e-6)
    after = whole_gradients(sharded)
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad * coefficient, rtol=1e-5, atol=0, msg=name)
    assert float(grad_norm(params)) == pytest.approx(max_norm * norm / (norm + 1e-6), rel=1e-4)


def test_clip_gradients_leaves_gradients_under_max_norm_unchanged(sharded):
    """clip_gradients never scales up: gradients whose norm is under max_norm stay as they are."""
    before = scaled_gradients(sharded, 0.5)
    params = list(sharded.parameters())
    clip_gradients(params, 10.0, grad_norm(params))
    after = whole_gradients(sharded)
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, rtol=1e-6, atol=0, msg=name)


def test_check_sharding_refuses_a_given_optimizer_naming_it():
    """check_sharding: an optimizer built before sharding is refused; shard_cores with a pruning, staged
    objective is no longer refused (the Trainer rebuilds the sharded model at a prune)."""
    with pytest.raises(
        ValueError, match=r"^parallel='fsdp' builds the optimizer after sharding the model "
    ) as error:
        check_sharding(optimizer_given=True)
    assert str(error.value).endswith(
        "leave optimizer=None (the default AdamW), or use parallel='ddp' (comera train: a method that brings "
        "its own optimizer, such as galore or apollo, needs --set train.parallel=ddp)"
    )
    check_sharding(optimizer_given=False)


class Marker(nn.Module):
    """A layer that a registered test keeps replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))


def test_register_replicated_layer_adds_a_test_once_and_refuses_a_non_callable(monkeypatch):
    """register_replicated_layer: returns the test, registers it once, and its layers' parameters become
    replicated; a non-callable is a TypeError that shows it."""
    monkeypatch.setattr(fsdp, "_REPLICATED_LAYER_TESTS", list(fsdp._REPLICATED_LAYER_TESTS))

    def test(layer: nn.Module) -> bool:
        return isinstance(layer, Marker)

    model = nn.Sequential(Marker(), nn.Linear(2, 2))
    assert replicated_parameters(model) == set()
    assert register_replicated_layer(test) is test
    assert register_replicated_layer(test) is test
    assert fsdp._REPLICATED_LAYER_TESTS.count(test) == 1
    assert replicated_parameters(model) == {model[0].weight}
    with pytest.raises(TypeError, match=r"^test must be a callable module -> bool, got 5$"):
        register_replicated_layer(5)
    assert replicated_parameters(model) == {model[0].weight}
