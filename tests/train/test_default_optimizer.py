"""The Trainer's default AdamW: PyTorch's fused kernel where the parameters allow it, same updates."""

import torch
from tiny import implementation, loss_fn, make_data, make_model, trainer_optimizer

from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.train import Trainer
from comera.train.config import TrainConfig
from comera.train.setup import default_optimizer, fusable


def test_cpu_models_get_the_fused_kernel_and_the_same_update_as_the_plain_one():
    model = make_model()
    objective = CoMERAObjective(model)
    optimizer = default_optimizer(objective, TrainConfig())
    assert all(group["fused"] for group in optimizer.param_groups)
    twin = make_model()
    plain = torch.optim.AdamW(
        CoMERAObjective(twin, lr_cores=1e-3, lr_gates=1e-2).param_groups(lr=1e-3, weight_decay=0.01),
        foreach=False,
    )
    for group in optimizer.param_groups:
        group.update(lr=1e-3, weight_decay=0.01)
    for group in plain.param_groups:
        group.update(lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(model.parameters(), twin.parameters()):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        optimizer.step()
        plain.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_parameters_the_kernel_cannot_take_fall_back_to_the_default():
    on_meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    assert not fusable([on_meta])
    assert fusable([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])


def settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every param group's options and parameter shapes."""
    return [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "shapes": [p.shape for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]


def test_reference_loops_step_with_the_very_optimizer_the_trainer_builds():
    """The hand-written loops that tests compare with a Trainer bit for bit build their optimizer with
    ``tiny.trainer_optimizer``: it must be the Trainer's default in class, groups, rates and implementation
    (two AdamW implementations agree only to rounding, by an amount that depends on the CPU)."""
    config = TrainConfig(lr_other=4e-3, weight_decay=0.05)
    rates = CoMERASettings(lr_cores=2e-3, lr_gates=3e-2)
    model = make_model()
    trainer = Trainer(model, loss_fn, make_data(), config=config, objective=CoMERAObjective(model, rates))
    reference = trainer_optimizer(make_model(), config, rates)
    assert type(reference) is type(trainer.optimizer)
    assert implementation(reference) == implementation(trainer.optimizer)
    assert settings(reference) == settings(trainer.optimizer)
