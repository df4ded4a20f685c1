"""tensorize_ / untensorize_ refuse a model wrapped in DistributedDataParallel or sharded by FSDP (the wrapper
keeps the parameters it was built on) and leave it unchanged; the plain model, converted first, wraps fine."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from comera import TTLinear, tensorize_, untensorize_


@pytest.fixture(scope="module")
def group(one_rank_group):
    """The shared one-rank group (tests/conftest.py)."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _ddp(model: nn.Module) -> nn.Module:
    return DistributedDataParallel(model)


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def _fsdp2_inner(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    return model


@pytest.mark.parametrize(
    ("wrap", "name"),
    [(_ddp, "DistributedDataParallel"), (_fsdp2, "FSDP"), (_fsdp2_inner, "FSDP")],
    ids=["ddp", "fsdp2", "fsdp2-submodule"],
)
def test_a_wrapped_model_is_refused_naming_the_wrapper_and_left_unchanged(group, wrap, name):
    wrapped = wrap(_model())
    before = [type(module) for module in wrapped.modules()]
    message = rf"tensorize_ cannot convert a model wrapped in {name}: .* before wrapping it"
    with pytest.raises(TypeError, match=message):
        tensorize_(wrapped, rank=2)
    assert [type(module) for module in wrapped.modules()] == before
    assert not any(isinstance(module, TTLinear) for module in wrapped.modules())
    with pytest.raises(TypeError, match=rf"untensorize_ cannot convert a model wrapped in {name}"):
        untensorize_(wrapped)


def test_tensorized_first_then_wrapped_in_ddp_matches_the_plain_model(group):
    """The order the message asks for: the DDP wrapper of the converted model computes what it computes."""
    model = tensorize_(_model(), rank=2)
    wrapped = DistributedDataParallel(model)
    inputs = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(wrapped(inputs), model(inputs))
    assert sum(isinstance(module, TTLinear) for module in wrapped.modules()) == 2
