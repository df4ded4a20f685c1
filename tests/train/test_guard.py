"""Non-finite guard: NaN/Inf steps are skipped without a trace, counted, rolled back, or stop the run."""

import pytest
import torch
from tiny import loss_fn, make_data, make_model, parameters_of, trainer_optimizer

from comera import RankAdaptation
from comera.methods.comera import CoMERAObjective, CoMERASettings
from comera.train import NonFiniteError, TrainConfig, Trainer, read_metrics

RATES = {"lr_other": 1e-3}
GATED_RATES = CoMERASettings(lr_cores=1e-3, lr_gates=1e-2, prune_at=())  # the reference never prunes


class Poisoned:
    """``loss_fn`` making the loss (``"loss"``) or the gradient (``"grad"``) non-finite on chosen calls."""

    def __init__(self, bad_calls, kind="loss"):
        self.bad_calls = set(bad_calls)
        self.kind = kind
        self.calls = 0

    def is_bad(self) -> bool:
        return self.calls in self.bad_calls

    def __call__(self, model, batch):
        self.calls += 1
        loss = loss_fn(model, batch)
        if not self.is_bad():
            return loss
        if self.kind == "loss":
            return loss * float("nan")
        weight = model[5].weight
        return loss + torch.sqrt(weight - weight.detach()).sum()  # value 0, gradient +inf


def reference_skipping(bad_calls, steps, config):
    """Hand-written loop that runs the forward of a bad step (same dropout draws) and applies nothing."""
    model = make_model()
    torch.manual_seed(0)
    rank = RankAdaptation(model)
    optimizer = trainer_optimizer(model, config, GATED_RATES)
    batch_size = config.batch_size
    inputs, labels = make_data().tensors
    batches = [
        (inputs[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(inputs), batch_size)
    ]
    for call in range(1, steps + 1):
        batch = batches[(call - 1) % len(batches)]
        loss = loss_fn(model, batch)
        if call in bad_calls:
            continue
        rank.loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, rank


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_non_finite_steps_are_skipped_and_counted(kind, tmp_path, capsys):
    bad = {3, 7}
    config = TrainConfig(
        early=2,
        batch_size=8,
        shuffle=False,
        log_every=1,
        run_dir=str(tmp_path),
        plot=False,
        progress=True,
        **RATES,
    )
    model = make_model()
    objective = CoMERAObjective(model, GATED_RATES)
    trainer = Trainer(model, Poisoned(bad, kind), make_data(), config=config, objective=objective)
    result = trainer.fit()
    expected, expected_rank = reference_skipping(bad, 12, config)
    assert result.nonfinite == 2 and result.rollbacks == 0
    got, want = parameters_of(model), parameters_of(expected)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert trainer.objective.adaptation.smoothed_loss() == expected_rank.smoothed_loss(), (
        "the loss average saw a NaN"
    )
    counts = [record["nonfinite"] for record in read_metrics(tmp_path) if record["kind"] == "train"]
    assert counts == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert "skipped=2" in capsys.readouterr().err


def test_rollback_after_consecutive_failures_recovers_the_clean_run(tmp_path):
    def config(run):
        return TrainConfig(
            early=3,
            batch_size=8,
            checkpoint_every=3,
            max_nonfinite=3,
            log_every=1,
            run_dir=str(tmp_path / run),
            plot=False,
            **RATES,
        )

    clean = make_model()
    Trainer(clean, loss_fn, make_data(), config=config("clean")).fit()
    model = make_model()
    result = Trainer(model, Poisoned({10, 11, 12}), make_data(), config=config("poisoned")).fit()
    assert (result.rollbacks, result.nonfinite, result.step) == (1, 3, 18)
    got, want = parameters_of(model), parameters_of(clean)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    records = read_metrics(tmp_path / "poisoned")
    rollbacks = [r for r in records if r["kind"] == "event" and r["event"] == "rollback"]
    assert [(r["failed_at"], r["step"]) for r in rollbacks] == [(12, 9)]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 19))


def test_persistent_failure_stops_the_run_without_corrupting_the_model(tmp_path):
    model = make_model()
    config = TrainConfig(early=10, unit="step", batch_size=8, max_nonfinite=2, **RATES)
    with pytest.raises(NonFiniteError, match="no checkpoint to roll back to"):
        Trainer(model, Poisoned(range(4, 100)), make_data(), config=config).fit()
    clean = make_model()
    Trainer(
        clean, loss_fn, make_data(), config=TrainConfig(early=3, unit="step", batch_size=8, **RATES)
    ).fit()
    got, want = parameters_of(model), parameters_of(clean)
    for name in want:
        assert torch.equal(got[name], want[name]), name

    with_checkpoints = TrainConfig(
        early=10,
        unit="step",
        batch_size=8,
        max_nonfinite=2,
        max_rollbacks=1,
        checkpoint_every=2,
        run_dir=str(tmp_path),
        plot=False,
        **RATES,
    )
    with pytest.raises(NonFiniteError, match="after 1 rollbacks"):
        Trainer(make_model(), Poisoned(range(4, 100)), make_data(), config=with_checkpoints).fit()


def _ending_in_bad_steps(final_loss, eval_data=True, **settings):
    """A Trainer of 6 steps whose last 3 are non-finite (skipped, no rollback: ``max_nonfinite=5``), with an
    evaluation at its last step that reports ``final_loss``."""
    config = TrainConfig(early=6, unit="step", batch_size=8, max_nonfinite=5, **RATES, **settings)

    def eval_fn(model, batch):
        return {"loss": final_loss, "accuracy": 0.5}

    extra = {"eval_data": make_data(16), "eval_fn": eval_fn} if eval_data else {}
    return Trainer(make_model(), Poisoned(range(4, 100)), make_data(), config=config, **extra)


def test_a_run_that_ends_diverging_with_a_non_finite_evaluation_is_refused():
    """Out of steps before its rollbacks ran out: the last steps skipped and the final evaluation not finite
    is a diverged run (``NonFiniteError`` naming the streak and the metric), not a success."""
    message = r"ended in 3 non-finite steps in a row at step 6 \(3 in all, 0 rollbacks\).*not finite \(loss\)"
    with pytest.raises(NonFiniteError, match=message):
        _ending_in_bad_steps(float("nan")).fit()


def test_resuming_a_run_that_ended_diverging_is_refused_as_well(tmp_path):
    """Resumed at its last step, a diverged run trains nothing and had no evaluation in this process: the
    final evaluation is made then, and the run is refused again instead of reported as a success."""
    settings = {"run_dir": str(tmp_path), "checkpoint_every": 1, "plot": False}
    with pytest.raises(NonFiniteError):
        _ending_in_bad_steps(float("nan"), **settings).fit()
    with pytest.raises(NonFiniteError, match=r"at step 6 .*not finite \(loss\)"):
        _ending_in_bad_steps(float("nan"), **settings).fit(resume=True)


def test_skipped_last_steps_with_a_sound_evaluation_or_none_end_the_run_with_a_warning():
    """Skipped last steps leave the parameters of the last applied step: with a finite final evaluation, or
    none, the run ends (no error) with a warning naming the streak, so a stage of skipped steps is seen."""
    with pytest.warns(
        RuntimeWarning, match="ended in 3 non-finite steps in a row at step 6.*evaluation is finite"
    ):
        result = _ending_in_bad_steps(0.7).fit()
    assert result.nonfinite == 3 and result.eval["loss"] == 0.7
    streak = "ended in 3 non-finite steps in a row at step 6.*nothing evaluated"
    with pytest.warns(RuntimeWarning, match=streak):
        _ending_in_bad_steps(0.7, eval_data=False).fit()


def test_an_early_stage_of_only_non_finite_steps_is_a_divergence_not_a_traceback():
    """Every early step skipped (the early stage no longer than ``max_nonfinite``): the late stage has no loss
    to start from, and the run stops with ``NonFiniteError`` saying so."""
    config = TrainConfig(early=2, late=2, unit="step", batch_size=8, max_nonfinite=5, **RATES)
    model = make_model()
    objective = CoMERAObjective(model, GATED_RATES)
    trainer = Trainer(model, Poisoned(range(1, 100)), make_data(), config=config, objective=objective)
    with pytest.raises(NonFiniteError, match="every one of the 2 steps of the early stage was non-finite"):
        trainer.fit()
