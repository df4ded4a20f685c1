"""Contracts of the Trainer's loop pinned by hand-built expectations: the epoch loop and its empty-epoch
error, the progress bar, what happens between steps (evaluations, checkpoints, prunes forcing checkpoints),
the objective's after_step events, train records under a process group, the torn-record report, resuming
from a path, a run that starts in the late stage, and the gradient norm the non-finite guard checks."""

import functools
import io
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tiny import loss_fn, make_data, make_model, quiet_config
from torch import nn

from comera.train import Trainer, read_metrics
from comera.train import trainer as trainer_module
from comera.train.checkpoint import checkpoint_path, list_checkpoints, load_checkpoint, save_checkpoint
from comera.train.guard import total_grad_norm
from comera.train.objective import Objective, TaskObjective

STEPS_PER_EPOCH = 6  # make_data() has 48 samples, batches of 8


def task_trainer(tmp_path=None, data=None, objective=None, **values) -> Trainer:
    model = make_model(dropout=0.0)
    return Trainer(
        model,
        loss_fn,
        make_data() if data is None else data,
        config=quiet_config(tmp_path, **values),
        objective=TaskObjective(model) if objective is None else objective(model),
    )


def records(tmp_path, kind: str) -> list[dict]:
    return [r for r in read_metrics(tmp_path) if r["kind"] == kind]


def events(tmp_path, name: str) -> list[dict]:
    return [r for r in records(tmp_path, "event") if r["event"] == name]


def checkpoint_steps(tmp_path) -> list[int]:
    return [step for step, _ in list_checkpoints(Path(tmp_path) / "checkpoints")]


# ---------------------------------------------------------------- total_grad_norm


def test_total_grad_norm_without_gradients_is_a_zero_scalar():
    """total_grad_norm of parameters without gradients is a 0-dim zero."""
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
    norm = total_grad_norm(params)
    assert norm.shape == () and float(norm) == 0.0
    assert total_grad_norm([]).shape == ()


def test_total_grad_norm_is_the_norm_of_all_gradients_together():
    """total_grad_norm is the 2-norm over every gradient (one or several; those without one skipped)."""
    one = nn.Parameter(torch.zeros(2))
    one.grad = torch.tensor([3.0, 4.0])
    assert float(total_grad_norm([one])) == pytest.approx(5.0)
    other = nn.Parameter(torch.zeros(1))
    other.grad = torch.tensor([12.0])
    assert float(total_grad_norm([one, nn.Parameter(torch.ones(4)), other])) == pytest.approx(13.0)


def test_total_grad_norm_gathers_every_norm_on_the_first_gradient_device():
    """Gradients on several devices: every per-tensor norm goes to the first gradient's device."""
    first = nn.Parameter(torch.zeros(3, device="meta"))
    first.grad = torch.ones(3, device="meta")
    second = nn.Parameter(torch.zeros(2))
    second.grad = torch.ones(2)
    norm = total_grad_norm([first, second])
    assert norm.device.type == "meta" and norm.shape == ()


# ---------------------------------------------------------------- the epoch loop


class Exhausted(Exception):
    """Raised when train data is iterated once more than the test allows."""


class TwoThenNothing:
    """Re-iterable batches without a len(): two batches in epoch 0, none in epoch 1, then refuses."""

    def __init__(self):
        data = make_data(16)
        self.batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in (0, 8)]
        self.epochs = 0

    def __iter__(self):
        self.epochs += 1
        if self.epochs == 1:
            return iter(self.batches)
        if self.epochs == 2:
            return iter(())
        raise Exhausted("the trainer iterated train_data after an empty epoch")


def test_an_empty_epoch_raises_naming_the_epoch_and_batch():
    """An epoch that yields no batch raises ValueError naming its epoch and starting batch, at once."""
    trainer = task_trainer(data=TwoThenNothing(), unit="step", early=5)
    with pytest.raises(ValueError, match=r"^train_data yielded no batches in epoch 1 from batch 0$"):
        trainer.fit()
    assert trainer.step == 2 and trainer.epoch == 1


def test_progress_bar_advances_one_per_step(capsys, monkeypatch):
    """The progress bar counts the steps done: after every step the bar last printed (redrawn at every
    update) shows ``step/total``, and ``total/total`` at the end."""
    monkeypatch.setattr(
        trainer_module, "tqdm", functools.partial(trainer_module.tqdm, mininterval=0, miniters=1)
    )
    seen = []

    def shown_count(t):
        printed = capsys.readouterr().err
        seen.append((t.step, re.findall(r"(\d+)/" + str(STEPS_PER_EPOCH), printed)[-1]))

    trainer = task_trainer(early=1, progress=True)
    trainer.callbacks.append(shown_count)
    trainer.fit()
    assert seen == [(step, str(step)) for step in range(1, STEPS_PER_EPOCH + 1)]


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


@pytest.mark.parametrize("tty", [False, True])
def test_progress_none_shows_the_bar_only_on_a_terminal(monkeypatch, tty):
    """progress=None shows the bar exactly when stderr is a terminal: its ``total/total`` is printed there."""
    stream = Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    trainer = task_trainer(early=1, progress=None)
    trainer.fit()
    assert (f"{STEPS_PER_EPOCH}/{STEPS_PER_EPOCH} [" in stream.getvalue()) == tty


# ---------------------------------------------------------------- between steps


def test_evaluation_runs_at_a_last_step_off_the_interval(tmp_path):
    """eval_every: evaluations at its multiples and at the last step, even off the interval."""
    model = make_model(dropout=0.0)
    config = quiet_config(tmp_path, unit="step", early=4, eval_every=3)
    Trainer(
        model, loss_fn, make_data(), eval_data=make_data(16), config=config, objective=TaskObjective(model)
    ).fit()
    assert [r["step"] for r in records(tmp_path, "eval")] == [3, 4]


def test_checkpoint_at_a_last_step_off_the_interval(tmp_path):
    """checkpoint_every: checkpoints at its multiples and at the last step, even off the interval."""
    task_trainer(tmp_path, unit="step", early=4, checkpoint_every=3, keep_checkpoints=9).fit()
    assert checkpoint_steps(tmp_path) == [3, 4]


def test_checkpoint_every_none_checkpoints_each_epoch_end(tmp_path):
    """checkpoint_every=None writes a checkpoint at every epoch end."""
    task_trainer(tmp_path, early=3, keep_checkpoints=9).fit()
    assert checkpoint_steps(tmp_path) == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH, 3 * STEPS_PER_EPOCH]


class PerPoint(Objective):
    """A staged objective pruning at the points of ``changes``; a point's value is its prune details (None:
    the prune changed nothing)."""

    name = "per-point"
    has_stages = True
    prunes = True
    changes: dict = {}

    def __init__(self, model):
        super().__init__(model)
        self._stage = "early"
        self.point = None

    @property
    def stage(self) -> str:
        return self._stage

    def begin_late_stage(self, *, late_steps=None):
        self._stage = "late"
        return {}

    def prunes_at(self, point):
        self.point = point
        return point in self.changes

    def prune(self, optimizer):
        details = self.changes[self.point]
        return None if details is None else dict(details)


@pytest.mark.parametrize(
    "changes",
    [
        {"epoch_end": {"removed": 1}},
        {"early_end": {"removed": 1}},
        {"epoch_end": {"removed": 1}, "early_end": None},
        {"epoch_end": None, "early_end": {"removed": 1}},
    ],
)
def test_any_changing_prune_at_a_step_forces_its_checkpoint(tmp_path, changes):
    """A step where any prune (epoch end or early end) changed the model gets a checkpoint, whatever the
    other prune point of that step did."""
    objective = type("Scripted", (PerPoint,), {"changes": changes})
    task_trainer(
        tmp_path, objective=objective, early=1, late=1, checkpoint_every=1000, keep_checkpoints=9
    ).fit()
    assert checkpoint_steps(tmp_path) == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    changed = [point for point, details in changes.items() if details is not None]
    assert [(e["step"], e["point"]) for e in events(tmp_path, "prune")] == [
        (STEPS_PER_EPOCH, point) for point in changed
    ] + ([(2 * STEPS_PER_EPOCH, "epoch_end")] if "epoch_end" in changed else [])


class AfterStepEvents(TaskObjective):
    """The task loss, with scripted after_step events: step 1 changes nothing, step 2 does not say, step 3
    changed the model."""

    SCRIPT = {1: {"changed": False, "n": 1}, 2: {"n": 2}, 3: {"changed": True, "n": 3}}

    def after_step(self, step):
        event = self.SCRIPT.get(step)
        return None if event is None else dict(event)


class RecordedGraphStep:
    """A stand-in for the Trainer's captured step (:class:`comera.train.cuda_graph.CudaGraphStep`, which needs
    CUDA): every step is applied with zero losses and norm, and the steps at which the graph was dropped are
    recorded."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.dropped = []

    def step(self, batch):
        return torch.tensor([0.0, 0.0, 0.0, 1.0])

    def invalidate(self):
        self.dropped.append(self.trainer.step)


def test_after_step_events_are_logged_and_drop_the_graph_unless_unchanged(tmp_path):
    """An after_step event is logged; the captured graph is dropped unless the event says changed=False
    (an event without "changed" counts as a change)."""
    trainer = task_trainer(tmp_path, objective=AfterStepEvents, unit="step", early=4)
    trainer.graph_step = RecordedGraphStep(trainer)
    trainer.fit()
    assert trainer.graph_step.dropped == [2, 3]
    assert [(e["step"], e["n"], e.get("changed")) for e in events(tmp_path, "objective")] == [
        (1, 1, False),
        (2, 2, None),
        (3, 3, True),
    ]


# ---------------------------------------------------------------- train records


def test_train_records_under_a_process_group_carry_per_rank_values(tmp_path):
    """With several ranks a train record holds step_time_per_rank and peak_memory_mib_per_rank: every
    rank's value in rank order (here a world size of 2 without a process group: the one process's values)."""
    trainer = task_trainer(tmp_path, unit="step", early=2, log_every=1)
    trainer.world_size = 2
    trainer.fit()
    logged = records(tmp_path, "train")
    assert [record["step"] for record in logged] == [1, 2]
    for record in logged:
        assert record["step_time_per_rank"] == [record["step_time"]]
        assert record["peak_memory_mib_per_rank"] == [record["peak_memory_mib"]]


def test_train_records_of_one_process_have_no_per_rank_values(tmp_path):
    """Without a process group a train record has no per-rank entries."""
    task_trainer(tmp_path, unit="step", early=2, log_every=1).fit()
    assert all("step_time_per_rank" not in r for r in records(tmp_path, "train"))


def test_progress_bar_shows_loss_ratio_and_stage(tmp_path, capsys):
    """At each record the bar shows the window's loss (4 digits), size ratio (3 decimals) and stage."""
    task_trainer(tmp_path, unit="step", early=2, log_every=1, progress=True).fit()
    shown = capsys.readouterr().err
    for record in records(tmp_path, "train"):
        assert f"loss={record['loss']:.4g}, ratio=1.000, stage=train" in shown, record["step"]


# ---------------------------------------------------------------- fit


def test_a_torn_record_is_reported_once_naming_file_and_bytes(tmp_path):
    """A torn last metrics line: fit warns naming the file and byte count, logs a torn_record_dropped event
    with the bytes, and does not report it again."""
    whole = '{"kind": "event", "step": 0, "event": "start"}\n'
    torn = '{"kind": "tr'
    (tmp_path / "metrics.jsonl").write_text(whole + torn)
    trainer = task_trainer(tmp_path, early=1)
    with pytest.warns(RuntimeWarning) as caught:
        trainer.fit()
    (warning,) = [w for w in caught if "torn" in str(w.message)]
    assert str(warning.message) == (
        f"{tmp_path / 'metrics.jsonl'}: dropped a torn last record ({len(torn)} bytes without a newline, "
        "left by a process killed mid-write)"
    )
    (event,) = events(tmp_path, "torn_record_dropped")
    assert event["bytes"] == len(torn) and event["step"] == 0
    assert trainer.metrics.torn_bytes == 0
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        trainer.fit(resume=True)
    assert not [w for w in again if "torn" in str(w.message)]
    assert len(events(tmp_path, "torn_record_dropped")) == 1


def test_resume_from_a_path_restores_guard_counters_and_train_time(tmp_path):
    """fit(resume=path) takes the guard counters and earlier train time from that file and logs a resume
    event naming it."""
    task_trainer(tmp_path / "a", early=1).fit()
    payload = load_checkpoint(checkpoint_path(tmp_path / "a" / "checkpoints", STEPS_PER_EPOCH))
    payload["guard"] = {"total": 3, "consecutive": 0, "rollbacks": 1}
    payload["progress"]["train_time_s"] = 1000.0
    path = tmp_path / "edited.pt"
    save_checkpoint(payload, path)
    result = task_trainer(tmp_path / "b", early=2).fit(resume=path)
    assert (result.step, result.nonfinite, result.rollbacks) == (2 * STEPS_PER_EPOCH, 3, 1)
    assert result.train_time_s >= 1000.0
    (event,) = events(tmp_path / "b", "resume")
    assert event["checkpoint"] == str(path) and event["step"] == STEPS_PER_EPOCH


def test_a_run_without_early_steps_starts_in_the_late_stage(tmp_path):
    """early=0: the late stage begins before the first step, so every step and record is late."""
    changes = {}
    objective = type("Scripted", (PerPoint,), {"changes": changes})
    trainer = task_trainer(tmp_path, objective=objective, early=0, late=1, log_every=1)
    stages = []
    trainer.callbacks.append(lambda t: stages.append(t.objective.stage))
    result = trainer.fit()
    assert result.stage == "late" and stages == ["late"] * STEPS_PER_EPOCH
    assert [e["step"] for e in events(tmp_path, "late_stage")] == [0]
    assert {r["stage"] for r in records(tmp_path, "train")} == {"late"}


def test_torn_record_warning_points_at_the_caller_of_fit(tmp_path):
    """The torn-record warning is attributed to the line calling fit (stacklevel 2)."""
    (tmp_path / "metrics.jsonl").write_text('{"kind": "tr')
    with pytest.warns(RuntimeWarning) as caught:
        task_trainer(tmp_path, early=1).fit()
    assert [w.filename for w in caught if "torn last record" in str(w.message)] == [__file__]
