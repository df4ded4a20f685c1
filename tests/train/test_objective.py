"""Objectives: one Trainer loop for a dense baseline and for CoMERA; the default-objective and evaluation-hook
registries; the generic hooks; tau ownership; a detached loss."""

import math

import pytest
import torch
from tiny import CLASSES, FEATURES, loss_fn, make_data, make_model, parameters_of
from torch import nn

import comera.train.objective as objective_module
from comera import TTLinear
from comera.methods.comera import CoMERAObjective
from comera.train import TrainConfig, Trainer, read_metrics
from comera.train.objective import (
    TaskObjective,
    default_objective,
    register_default_objective,
    register_evaluation_hook,
)


def dense_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, CLASSES))


def hand_loop(model: nn.Module, batches: list, lr: float) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for inputs, labels in batches:
        loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_a_dense_model_trains_through_the_same_trainer_as_a_plain_adamw_loop(tmp_path):
    data = make_data()
    config = TrainConfig(
        early=2, late=1, batch_size=16, shuffle=False, lr_other=1e-2, log_every=1, run_dir=str(tmp_path)
    )
    model = dense_model()
    trainer = Trainer(model, loss_fn, data, config=config)
    assert isinstance(trainer.objective, TaskObjective)
    result = trainer.fit()
    assert result.step == 9 and result.stage == "train", "early + late steps of the task loss"
    expected = dense_model()
    batches = [(data.tensors[0][i : i + 16], data.tensors[1][i : i + 16]) for i in range(0, 48, 16)] * 3
    hand_loop(expected, batches, lr=1e-2)
    got, want = parameters_of(model), parameters_of(expected)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    records = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in records] == list(range(1, 10))
    dense_size = sum(p.numel() for p in expected.parameters())
    assert all(r["size"] == dense_size and r["ratio"] == 1.0 for r in records)
    assert all(r["step_time"] > 0 and "ranks" not in r for r in records)
    assert not any(
        r["kind"] == "event" and r["event"] in ("prune", "late_stage") for r in read_metrics(tmp_path)
    )
    assert (tmp_path / "plots" / "loss.png").exists()


def test_default_objective_follows_the_model():
    objective = default_objective(make_model())
    assert isinstance(objective, CoMERAObjective) and objective.settings.gamma == 0.01
    assert isinstance(default_objective(dense_model()), TaskObjective)
    assert isinstance(Trainer(make_model(), loss_fn, make_data()).objective, CoMERAObjective)


def test_a_registered_default_objective_factory_is_asked_first(monkeypatch):
    monkeypatch.setattr(objective_module, "_DEFAULT_FACTORIES", list(objective_module._DEFAULT_FACTORIES))
    asked = []

    def only_dense(model):
        asked.append(model)
        return None if any(isinstance(m, TTLinear) for m in model.modules()) else TaskObjective(model)

    assert register_default_objective(only_dense) is only_dense
    register_default_objective(only_dense)
    dense, gated = dense_model(), make_model()
    assert type(default_objective(dense)) is TaskObjective and asked == [dense]
    assert isinstance(default_objective(gated), CoMERAObjective), "falls through to the earlier factory"
    with pytest.raises(TypeError, match="factory must be callable"):
        register_default_objective("comera")


def test_evaluation_hooks_run_before_every_evaluation(monkeypatch):
    monkeypatch.setattr(objective_module, "_EVALUATION_HOOKS", [])
    calls = []
    register_evaluation_hook(lambda: calls.append("hook"))
    config = TrainConfig(early=2, batch_size=16, plot=False)
    Trainer(dense_model(), loss_fn, make_data(), eval_data=make_data(16, 3), config=config).fit()
    assert calls == ["hook", "hook"], "one evaluation per epoch end"
    with pytest.raises(TypeError, match="hook must be callable"):
        register_evaluation_hook(None)


def test_task_objective_hooks_do_nothing_and_give_one_group():
    model = dense_model()
    objective = TaskObjective(model)
    assert not any(objective.prunes_at(point) for point in objective_module.STAGE_POINTS)
    assert objective.structure() == {} and objective.prune(None) is None
    objective.check_stages(early=0, late=3)
    objective.set_precision("fp8")
    (group,) = objective.param_groups(lr=0.5, weight_decay=0.1)
    assert (group["name"], group["lr"], group["weight_decay"]) == ("other", 0.5, 0.1)
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]


def test_task_objective_counts_trainable_entries_once():
    model = dense_model()
    model[2].weight.requires_grad_(False)
    shared = nn.Sequential(model, model)
    objective = TaskObjective(shared)
    assert objective.size() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert objective.device_state() == [] and objective.prune(None) is None
    with pytest.raises(RuntimeError, match="no late stage"):
        objective.begin_late_stage(late_steps=3)
    with pytest.raises(ValueError, match="0-dim"):
        objective.loss(torch.ones(2))


def test_tau_belongs_to_the_layers_and_the_objective_reads_it():
    model = make_model()
    for module in model.modules():
        if hasattr(module, "tau"):
            module.tau = 0.05
    trainer = Trainer(model, loss_fn, make_data(), config=TrainConfig(plot=False))
    assert trainer.objective.adaptation.tau == 0.05
    assert all(m.tau == 0.05 for m in model.modules() if hasattr(m, "gates"))
    with pytest.raises(TypeError, match="unknown CoMERAObjective arguments"):
        CoMERAObjective(model, tau=0.2)


def test_layers_with_different_taus_need_an_explicit_choice():
    model = make_model()
    model[0].tau = 0.3
    with pytest.raises(ValueError, match="different gate thresholds"):
        Trainer(model, loss_fn, make_data(), config=TrainConfig(plot=False))


def test_a_loss_detached_from_the_model_is_refused_at_the_first_step():
    def detached(model, batch):
        return loss_fn(model, batch).detach()

    for model in (make_model(), dense_model()):
        trainer = Trainer(model, detached, make_data(), config=TrainConfig(plot=False))
        with pytest.raises(ValueError, match="no trainable parameter reaches"):
            trainer.fit()
        assert trainer.step == 0


def test_objective_state_round_trips_through_a_checkpoint(tmp_path):
    config = TrainConfig(early=1, late=1, batch_size=16, run_dir=str(tmp_path), plot=False)

    def trainer():
        model = make_model()
        objective = CoMERAObjective(model, target_loss=2.0)
        return Trainer(model, loss_fn, make_data(), config=config, objective=objective)

    first = trainer()
    first.fit()
    resumed = trainer()
    resumed.fit(resume=True)
    a, b = first.objective.adaptation, resumed.objective.adaptation
    assert (b.stage, b.target_size, b.target_loss) == (a.stage, a.target_size, a.target_loss)
    assert math.isclose(b.smoothed_loss(), a.smoothed_loss())


def test_a_checkpoint_of_another_objective_is_refused(tmp_path):
    config = TrainConfig(early=1, batch_size=16, run_dir=str(tmp_path), plot=False)
    Trainer(dense_model(), loss_fn, make_data(), config=config).fit()
    model = nn.Sequential(TTLinear(FEATURES, 16, rank=2), nn.GELU(), nn.Linear(16, CLASSES))
    trainer = Trainer(model, loss_fn, make_data(), config=config)
    with pytest.raises((ValueError, RuntimeError)):
        trainer.fit(resume=True)


def test_resume_falls_back_to_the_previous_checkpoint_when_the_newest_is_corrupt(tmp_path):
    config = TrainConfig(
        early=1, batch_size=8, checkpoint_every=2, keep_checkpoints=2, run_dir=str(tmp_path), plot=False
    )
    Trainer(make_model(), loss_fn, make_data(), config=config).fit()
    newest = tmp_path / "checkpoints" / "step-00000006.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    trainer = Trainer(make_model(), loss_fn, make_data(), config=config)
    with pytest.warns(RuntimeWarning, match="unreadable checkpoint"):
        trainer.fit(resume=True)
    events = [r for r in read_metrics(tmp_path) if r["kind"] == "event"]
    assert any(e["event"] == "unreadable_checkpoint" for e in events)
    assert any(e["event"] == "resume" and e["checkpoint"].endswith("step-00000004.pt") for e in events)
    assert trainer.step == 6
    (tmp_path / "checkpoints" / "step-00000004.pt").write_bytes(b"junk")
    newest.write_bytes(b"junk")
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="no readable checkpoint"):
        Trainer(make_model(), loss_fn, make_data(), config=config).fit(resume=True)
