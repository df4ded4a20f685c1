"""GaLore and APOLLO through their packages: parameter groups, the rank of GaLore's update, APOLLO's
channel-wise scaled gradient, checkpoints read with weights_only=True, and the missing-package message."""

import io
import sys

import pytest
import torch
from torch import nn

from comera.methods import MethodContext
from comera.methods.apollo import APOLLOMethod
from comera.methods.galore import GaLoreMethod
from comera.methods.projected import low_rank_groups, projection_rank
from comera.tensorize_config import TensorizeConfig
from comera.train.config import TrainConfig


def _model():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 3))


def _context(**settings):
    tensorize = TensorizeConfig(target_modules=["0", "2"])
    return MethodContext(tensorize=tensorize, settings=settings, train=TrainConfig(lr_other=1e-2))


def _step(model, optimizer, seed):
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_groups_put_targeted_weights_in_rank_groups_and_everything_else_once():
    model = _model()
    groups = low_rank_groups(
        model,
        _context().tensorize,
        rank=128,
        rank_fraction=0.25,
        lr=0.1,
        weight_decay=0.0,
        projection={"x": 1},
    )
    assert [g["name"] for g in groups] == ["other", "low_rank_4", "low_rank_8"]
    assert groups[1]["params"] == [model[0].weight] and groups[2]["params"] == [model[2].weight]
    assert groups[1]["rank"] == 4 and groups[2]["x"] == 1 and "rank" not in groups[0]
    listed = [id(p) for g in groups for p in g["params"]]
    assert sorted(listed) == sorted(id(p) for p in model.parameters())
    assert projection_rank((512, 2048), 128, 0.25) == 128 and projection_rank((3, 3), 128, 0.25) == 1


def test_galore_update_of_a_targeted_weight_has_the_projection_rank():
    pytest.importorskip("galore_torch")
    model = _model()
    optimizer = GaLoreMethod().optimizer(model, _context())
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, optimizer, 0)
    change = model[2].weight.detach() - before[2]
    assert torch.linalg.matrix_rank(change).item() == 8, "rank 128 capped at 32 / 4"
    assert torch.linalg.matrix_rank(model[4].weight.detach() - before[4]).item() == 3, (
        "the head is not projected"
    )


def test_apollo_scales_the_raw_gradient_per_channel():
    pytest.importorskip("apollo_torch")
    model = _model().double()
    optimizer = APOLLOMethod().optimizer(model, _context())
    weight = model[2].weight
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    gradient, before = weight.grad.detach().clone(), weight.detach().clone()
    optimizer.step()
    ratio = (weight.detach() - before) / gradient
    # (64, 32): the gradient is projected on its 32-long side, so the scale is one number per row
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-9, atol=1e-12)
    assert (ratio < 0).all() and ratio[:, 0].std() > 0


@pytest.mark.parametrize(
    ("package", "method"), [("galore_torch", GaLoreMethod), ("apollo_torch", APOLLOMethod)]
)
def test_optimizer_state_round_trips_through_a_weights_only_checkpoint(package, method):
    pytest.importorskip(package)
    model = _model()
    context = _context(update_proj_gap=2)
    optimizer = method().optimizer(model, context)
    for seed in range(3):
        _step(model, optimizer, seed)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    payload = torch.load(buffer, weights_only=True)
    twin = _model()
    twin.load_state_dict(payload["model"])
    twin_optimizer = method().optimizer(twin, context)
    twin_optimizer.load_state_dict(payload["optimizer"])
    for seed in range(3, 6):
        _step(model, optimizer, seed)
        _step(twin, twin_optimizer, seed)
    for param, twin_param in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(twin_param, param, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("method", "module", "distribution"),
    [(GaLoreMethod, "galore_torch", "galore-torch"), (APOLLOMethod, "apollo_torch", "apollo-torch")],
)
def test_a_missing_package_names_the_extra(monkeypatch, method, module, distribution):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        ImportError, match=rf"needs the '{distribution}' package.*pip install 'comera\[baselines\]'"
    ):
        method().prepare(_model(), _context())


@pytest.mark.parametrize(
    ("method", "settings", "match"),
    [
        (GaLoreMethod, {"rank": 0}, r"method.rank must be an int >= 1, got 0"),
        (GaLoreMethod, {"proj_type": "diag"}, r"method.proj_type must be one of \('std'"),
        (
            GaLoreMethod,
            {"rank_fraction": 1.5},
            r"method.rank_fraction must be a finite number in \(0.0, 1.0\]",
        ),
        (APOLLOMethod, {"scale_type": "row"}, r"method.scale_type must be one of \('channel', 'tensor'\)"),
        (APOLLOMethod, {"update_proj_gap": 0}, r"method.update_proj_gap must be an int >= 1"),
    ],
)
def test_bad_settings_name_the_setting(method, settings, match):
    with pytest.raises(ValueError, match=match):
        method().prepare(_model(), _context(**settings))


def test_importing_a_baseline_package_prints_no_warning_and_restores_the_log_levels():
    import logging
    import subprocess
    import sys

    pytest.importorskip("galore_torch")
    code = (
        "import logging; from comera.methods.projected import require_package, QUIET_LOGGERS; "
        "require_package('galore_torch', 'galore-torch', 'galore'); "
        "print([logging.getLogger(name).level for name in QUIET_LOGGERS])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr == "" and done.stdout.strip() == str([logging.NOTSET])
