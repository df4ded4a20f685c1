"""``TrainConfig.device``: the names it takes, the checks against this machine, the Trainer's in-place move.

The CUDA cases are skipped without a GPU; the move itself is exercised on CPU by resolving the name to the
meta device, which every build has."""

from __future__ import annotations

import pytest
import torch
from tiny import make_data, make_model

import comera.train.setup as setup
from comera.train import Trainer
from comera.train.config import TrainConfig
from comera.train.parallel import training_device
from comera.train.setup import place_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _loss(model, batch):
    inputs, labels = batch
    device = next(model.parameters()).device
    return torch.nn.functional.cross_entropy(model(inputs.to(device)), labels.to(device))


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "", "meta", 0])
def test_a_device_name_outside_its_forms_is_refused(name):
    with pytest.raises(ValueError, match="device must be None, 'cpu', 'cuda' or 'cuda:N'"):
        TrainConfig(device=name)


def test_the_cpu_is_the_cpu():
    assert training_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_on_a_machine_without_it_is_refused_naming_the_setting(name):
    with pytest.raises(ValueError, match=rf"train.device='{name}': CUDA is not available"):
        training_device(name)
    with pytest.raises(ValueError, match="CUDA is not available"):
        Trainer(make_model(), _loss, make_data(), config=TrainConfig(device=name))


@needs_cuda
def test_a_gpu_index_past_the_last_is_refused_with_the_valid_range():
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"GPU {count} does not exist.*indices 0 to {count - 1}"):
        training_device(f"cuda:{count}")


def test_a_stepped_optimizer_or_one_whose_parameters_the_move_replaced_is_refused(monkeypatch):
    monkeypatch.setattr(setup, "training_device", lambda name: torch.device("meta"))
    stepped = make_model()
    optimizer = torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9)
    _loss(stepped, (torch.randn(4, 12), torch.zeros(4, dtype=torch.long))).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="train.device='cuda': the optimizer passed in already holds state"):
        place_model(stepped, "cuda", optimizer)
    assert all(p.device.type == "cpu" for p in stepped.parameters())

    fresh = make_model()  # CPU -> meta makes new parameter objects (CPU -> CUDA does not)
    with pytest.raises(ValueError, match="replaced its parameters, so the optimizer passed in holds the old"):
        place_model(fresh, "cuda", torch.optim.SGD(fresh.parameters(), lr=0.1))
    alone = make_model()
    place_model(alone, "cuda", None)
    assert all(p.device.type == "meta" for p in alone.parameters())


@needs_cuda
def test_on_the_gpu_the_move_keeps_the_parameters_an_optimizer_holds():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = list(model.parameters())
    place_model(model, "cuda", optimizer)
    assert all(p is q and p.is_cuda for p, q in zip(before, model.parameters()))


def test_none_and_the_device_the_model_is_on_change_nothing():
    runs = []
    for device in (None, "cpu"):
        model = make_model(dropout=0.0)
        Trainer(model, _loss, make_data(), config=TrainConfig(device=device, early=1, batch_size=8)).fit()
        runs.append(model.state_dict())
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][key], runs[1][key]) for key in runs[0])


@needs_cuda
def test_a_cpu_built_model_trains_on_the_gpu_as_on_the_cpu():
    trained = {}
    for device in ("cpu", "cuda"):
        model = make_model(dropout=0.0)
        config = TrainConfig(device=device, early=2, batch_size=8, shuffle=False, reuse_cpu_memory=False)
        trainer = Trainer(model, _loss, make_data(), config=config)
        assert all(p.device.type == device for p in trainer.module.parameters())
        trainer.fit()
        trained[device] = {key: value.cpu() for key, value in model.state_dict().items()}
    for key, value in trained["cpu"].items():
        torch.testing.assert_close(trained["cuda"][key], value, rtol=1e-4, atol=1e-5, msg=key)
