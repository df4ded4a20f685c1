"""Trainer: the two stages, prune points, evaluation and resume against hand-written references."""

import pytest
import torch
from tiny import accuracy_fn, loss_fn, make_data, make_model, parameters_of, run_settings, trainer_optimizer
from torch import nn

import comera.train.trainer as trainer_module
from comera import RankAdaptation, prune_
from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.train import TrainConfig, Trainer, read_metrics

FAST_GATES = {"gamma": 1.0, "lr_gates": 0.05, "lr_cores": 1e-3, "lr_other": 1e-3}


def reference_run(
    config: TrainConfig, settings: CoMERASettings, batches: list, epochs_early: int, epochs_late: int
) -> nn.Module:
    """CoMERA written out by hand: early epochs, prune, late stage, prune after every late epoch."""
    model = make_model()
    torch.manual_seed(config.seed)
    rank = RankAdaptation(model, gamma=settings.gamma, surrogate=settings.surrogate)
    optimizer = trainer_optimizer(model, config, settings)
    step = 0
    for epoch in range(epochs_early + epochs_late):
        if epoch == epochs_early:
            prune_(model, optimizer)
            late_steps = epochs_late * len(batches)
            rank.begin_late_stage(
                settings.target_ratio,
                settings.target_loss,
                settings.rho,
                settings.ema,
                late_steps=late_steps,
                recovery=settings.recovery,
            )
        for inputs, labels in batches:
            rank.loss(loss_fn(model, (inputs, labels))).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            rank.after_step(step)  # the late-stage controller's host-side step, as the Trainer calls it
        if epoch >= epochs_early:
            prune_(model, optimizer)
    return model


def batches_of(dataset, size):
    inputs, labels = dataset.tensors
    return [(inputs[i : i + size], labels[i : i + size]) for i in range(0, len(inputs), size)]


@pytest.mark.parametrize("recovery", [0.3, 0.75])
def test_two_stages_with_pruning_match_a_hand_written_loop(recovery):
    config, settings = run_settings(
        early=2, late=2, batch_size=8, shuffle=False, target_ratio=0.5, recovery=recovery, **FAST_GATES
    )
    data = make_data()
    model = make_model()
    ranks_before = [layer.max_ranks for layer in (model[0], model[3])]
    trainer = Trainer(model, loss_fn, data, config=config, objective=CoMERAObjective(model, settings))
    result = trainer.fit()
    expected = reference_run(config, settings, batches_of(data, 8), 2, 2)
    assert result.step == 24 and result.stage == "late"
    assert [layer.max_ranks for layer in (model[0], model[3])] != ranks_before, "nothing was pruned"
    got, want = parameters_of(model), parameters_of(expected)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_late_stage_target_is_a_fraction_of_the_size_at_the_switch(tmp_path):
    config, settings = run_settings(
        early=5, late=3, unit="step", batch_size=8, target_ratio=0.4, run_dir=str(tmp_path), **FAST_GATES
    )
    sizes = {}
    model = make_model()
    trainer = Trainer(
        model,
        loss_fn,
        make_data(),
        config=config,
        objective=CoMERAObjective(model, settings),
        callbacks=[lambda t: sizes.setdefault(t.step, t.objective.size())],
    )
    trainer.fit()
    assert trainer.step == 8 and trainer.objective.stage == "late"
    assert trainer.objective.adaptation.target_size == pytest.approx(0.4 * sizes[5])
    events = [r for r in read_metrics(tmp_path) if r["kind"] == "event" and r["event"] == "late_stage"]
    assert [event["step"] for event in events] == [5]


def test_no_late_stage_and_no_pruning_when_not_configured():
    config, settings = run_settings(early=1, late=0, batch_size=8, prune_at=(), **FAST_GATES)
    model = make_model()
    shapes = [p.shape for p in model.parameters()]
    trainer = Trainer(model, loss_fn, make_data(), config=config, objective=CoMERAObjective(model, settings))
    assert trainer.fit().stage == "early"
    assert [p.shape for p in model.parameters()] == shapes


def test_evaluation_interval_and_values(tmp_path):
    eval_data = make_data(20, seed=5)
    config = TrainConfig(early=2, batch_size=8, eval_every=4, run_dir=str(tmp_path), plot=False)
    model = make_model()
    result = Trainer(
        model, loss_fn, make_data(), eval_data=eval_data, eval_fn=accuracy_fn, config=config
    ).fit()
    evals = [r for r in read_metrics(tmp_path) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12]
    model.eval()
    for module in model.modules():  # the reference must not reuse what the Trainer's evaluations cached
        if hasattr(module, "clear_cache"):
            module.clear_cache()
    with torch.no_grad():
        parts = [accuracy_fn(model, batch) for batch in batches_of(eval_data, 8)]
    expected = {name: sum(p[name] for p in parts) / len(parts) for name in ("loss", "accuracy")}
    assert result.eval == pytest.approx(expected)
    assert evals[-1]["metrics"] == pytest.approx(expected)


def test_resume_from_a_pruned_late_stage_checkpoint_in_process(tmp_path):
    def config(run):
        return run_settings(
            early=2,
            late=2,
            batch_size=8,
            checkpoint_every=5,
            keep_checkpoints=20,
            run_dir=str(tmp_path / run),
            plot=False,
            **FAST_GATES,
        )

    def make_trainer(model, run):
        run_config, settings = config(run)
        objective = CoMERAObjective(model, settings)
        return Trainer(model, loss_fn, make_data(), config=run_config, objective=objective)

    full_model = make_model()
    make_trainer(full_model, "full").fit()
    first = make_model()
    make_trainer(first, "part").fit()
    checkpoint = tmp_path / "part" / "checkpoints" / "step-00000015.pt"
    resumed = make_model()
    trainer = make_trainer(resumed, "part")
    assert trainer.fit(resume=str(checkpoint)).step == 24
    assert resumed[0].max_ranks == full_model[0].max_ranks
    got, want = parameters_of(resumed), parameters_of(full_model)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bad_arguments_raise_clear_errors():
    data = make_data()
    with pytest.raises(ValueError, match="no gated layers"):
        Trainer(nn.Linear(12, 3), loss_fn, data, objective=CoMERAObjective(nn.Linear(12, 3)))
    with pytest.raises(TypeError, match="objective must be"):
        Trainer(make_model(), loss_fn, data, objective="comera")
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        Trainer(make_model(), "cross_entropy", data)
    with pytest.raises(TypeError, match="config must be a TrainConfig"):
        Trainer(make_model(), loss_fn, data, config={"early": 1})
    with pytest.raises(ValueError, match="train_data yields no batches"):
        Trainer(make_model(), loss_fn, make_data(4), config=TrainConfig(batch_size=8, drop_last=True))
    with pytest.raises(ValueError, match="must have a len"):
        Trainer(make_model(), loss_fn, (batch for batch in batches_of(data, 8)))


class Unsized:
    """A re-iterable of batches without ``len``."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def test_unsized_iterable_counts_steps_and_wraps_epochs(tmp_path):
    config = TrainConfig(early=8, unit="step", log_every=1, run_dir=str(tmp_path), plot=False)
    trainer = Trainer(make_model(), loss_fn, Unsized(batches_of(make_data(), 16)), config=config)
    assert trainer.fit().step == 8
    epochs = [r["epoch"] for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert epochs == [0, 0, 0, 1, 1, 1, 2, 2]  # 3 batches per pass


@pytest.mark.parametrize("reuse", [True, False])
def test_cpu_trainer_applies_the_allocation_setting_when_asked(monkeypatch, reuse):
    calls = []
    monkeypatch.setattr(trainer_module, "reuse_freed_memory", lambda: calls.append(True))
    Trainer(make_model(), loss_fn, make_data(), config=TrainConfig(reuse_cpu_memory=reuse, plot=False))
    assert calls == ([True] if reuse else [])
