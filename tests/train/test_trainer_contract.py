"""Trainer contracts pinned by hand-built expectations: records and events read back, checkpoint contents,
resume and rollback bookkeeping, the non-finite guard, and the sharded/DDP wiring exercised in one process."""

import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny import loss_fn, make_data, make_model, quiet_config
from torch import nn

import comera
import comera.train.trainer as trainer_module
from comera.train import TrainConfig, Trainer, read_metrics
from comera.train.checkpoint import (
    CHECKPOINT_VERSION,
    capture_rng,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from comera.train.data import epoch_seed
from comera.train.evaluation import Evaluator, cuda_devices_of
from comera.train.guard import NonFiniteError
from comera.train.objective import Objective, TaskObjective

STEPS_PER_EPOCH = 6  # make_data() has 48 samples, batches of 8


def task_trainer(tmp_path=None, loss=loss_fn, **values) -> Trainer:
    model = make_model(dropout=0.0)
    return Trainer(
        model, loss, make_data(), config=quiet_config(tmp_path, **values), objective=TaskObjective(model)
    )


def events(tmp_path, name: str) -> list[dict]:
    return [r for r in read_metrics(tmp_path) if r["kind"] == "event" and r["event"] == name]


def checkpoint_steps(tmp_path) -> list[int]:
    return [step for step, _ in list_checkpoints(Path(tmp_path) / "checkpoints")]


class Scripted(Objective):
    """A staged objective whose prune decisions and details are fixed in advance."""

    name = "scripted"
    has_stages = True
    prunes = True

    def __init__(self, model, points=(), details=None, on_prune=None):
        super().__init__(model)
        self._stage = "early"
        self.points = points
        self.details = details
        self.on_prune = on_prune

    @property
    def stage(self) -> str:
        return self._stage

    def begin_late_stage(self, *, late_steps=None):
        self._stage = "late"
        return {"late_steps": late_steps, "marker": 7}

    def prunes_at(self, point):
        return point in self.points

    def prune(self, optimizer):
        if self.on_prune is not None:
            self.on_prune()
        return None if self.details is None else dict(self.details)

    def apply_structure(self, structure, optimizer):
        if self.on_prune is not None:
            self.on_prune()
        self.structure_optimizer = optimizer


def scripted_trainer(tmp_path, objective_args=(), **values):
    model = make_model(dropout=0.0)
    objective = Scripted(model, *objective_args)
    config = quiet_config(tmp_path, **values)
    return Trainer(model, loss_fn, make_data(), config=config, objective=objective)


# ---------------------------------------------------------------- config and objective


def test_graph_pad_accepts_tuple_index_zero():
    """graph_pad keys are str or tuple indices int >= 0: index 0 is valid."""
    config = TrainConfig(cuda_graph=True, graph_buckets=(8,), graph_pad={0: -1.0})
    assert config.graph_pad == {0: -1.0}


def test_to_dict_turns_tuples_into_lists():
    """to_dict is plain Python with lists for tuples (graph_buckets)."""
    values = TrainConfig(cuda_graph=True, graph_buckets=(8, 16), graph_pad={"ids": 0}).to_dict()
    assert type(values["graph_buckets"]) is list and values["graph_buckets"] == [8, 16]


def test_objective_state_dict_names_objective_and_initial_size():
    """Objective.state_dict holds the name and initial size; another objective refuses it."""
    model = make_model()
    expected = sum(p.numel() for p in model.parameters())
    state = TaskObjective(model).state_dict()
    assert state == {"name": "task", "initial_size": expected}
    other = Scripted(model)
    with pytest.raises(ValueError, match="written with the 'task' objective"):
        other.load_state_dict(state)
    other.name = "task"
    other.initial_size = 1
    other.load_state_dict(state)
    assert other.initial_size == expected


def test_cuda_devices_lists_each_cuda_index_once():
    """cuda_devices_of: the sorted CUDA indices of the parameters, bare 'cuda' as 0, CPU ignored."""
    params = [torch.device("cuda", 1), torch.device("cuda"), torch.device("cuda", 1), torch.device("cpu")]
    fake = SimpleNamespace(parameters=lambda: [SimpleNamespace(device=d) for d in params])
    assert cuda_devices_of(fake) == [0, 1]
    only_zero = SimpleNamespace(parameters=lambda: [SimpleNamespace(device=torch.device("cuda", 0))])
    assert cuda_devices_of(only_zero) == [0]


# ---------------------------------------------------------------- one step


def test_step_with_non_finite_objective_but_finite_gradients_is_skipped():
    """The guard checks objective + gradient norm: an infinite objective skips the step even at zero grads."""

    def infinite(model, batch):
        return model(batch[0]).sum() * 0.0 + math.inf

    trainer = task_trainer(loss=infinite)
    batch = next(iter(trainer.train_data.epoch(0)))
    assert trainer.train_step(batch) is False


def test_gradients_are_set_to_none_after_an_eager_step():
    """An eager step leaves every gradient None (zero_grad(set_to_none=True))."""
    trainer = task_trainer()
    batch = next(iter(trainer.train_data.epoch(0)))
    assert trainer.train_step(batch) is True
    assert all(p.grad is None for p in trainer.module.parameters())


def test_detached_loss_is_refused_with_its_message():
    """A loss no parameter reaches raises ValueError naming loss_fn and what was returned."""
    trainer = task_trainer(loss=lambda model, batch: torch.tensor(1.0))
    batch = next(iter(trainer.train_data.epoch(0)))
    with pytest.raises(
        ValueError,
        match=r"^loss_fn returned a loss that no trainable parameter reaches \(a detached tensor or a number",
    ):
        trainer.train_step(batch)


def test_bf16_precision_autocasts_to_bfloat16_whatever_the_default():
    """precision='bf16' autocasts to bfloat16 even when the device's default autocast dtype is float16."""
    seen = []

    def loss(model, batch):
        out = model(batch[0])
        seen.append(out.dtype)
        return nn.functional.cross_entropy(out.float(), batch[1])

    model = nn.Linear(12, 3)
    data = make_data()
    config = quiet_config(precision="bf16")
    trainer = Trainer(model, loss, data, config=config, objective=TaskObjective(model))
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        trainer.train_step(next(iter(trainer.train_data.epoch(0))))
    finally:
        torch.set_autocast_dtype("cpu", before)
    assert seen == [torch.bfloat16]


# ---------------------------------------------------------------- records and events


def test_eval_records_carry_epoch_stage_and_train_time(tmp_path):
    """Each eval record names its step, epoch, stage and the train time so far."""
    model = make_model(dropout=0.0)
    config = quiet_config(tmp_path, early=2, eval_every=3)
    Trainer(
        model, loss_fn, make_data(), eval_data=make_data(16), config=config, objective=TaskObjective(model)
    ).fit()
    evals = [r for r in read_metrics(tmp_path) if r["kind"] == "eval"]
    assert [(r["step"], r["epoch"], r["stage"]) for r in evals] == [
        (3, 0, "train"),
        (6, 1, "train"),
        (9, 1, "train"),
        (12, 2, "train"),
    ]
    times = [r["train_time_s"] for r in evals]
    assert all(isinstance(t, float) and t >= 0 for t in times) and times == sorted(times)


def test_late_stage_event_carries_the_objective_details(tmp_path):
    """The late_stage event logs the details begin_late_stage returned."""
    scripted_trainer(tmp_path, early=1, late=1).fit()
    (event,) = events(tmp_path, "late_stage")
    assert event["step"] == STEPS_PER_EPOCH and event["late_steps"] == STEPS_PER_EPOCH
    assert event["marker"] == 7


def test_a_prune_that_changes_shapes_is_logged_and_checkpointed(tmp_path):
    """A prune with details logs a prune event naming its point and forces a checkpoint."""
    trainer = scripted_trainer(
        tmp_path, (("early_end",), {"removed": 3}), early=1, late=1, checkpoint_every=1000, keep_checkpoints=9
    )
    trainer.fit()
    (event,) = events(tmp_path, "prune")
    assert event["point"] == "early_end" and event["removed"] == 3 and event["step"] == STEPS_PER_EPOCH
    assert checkpoint_steps(tmp_path) == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]


@pytest.mark.parametrize("prunes", [False, True])
def test_no_prune_or_a_prune_without_changes_forces_no_checkpoint(tmp_path, prunes):
    """Only a prune that changed shapes forces a checkpoint: none at an epoch end otherwise."""
    if prunes:
        model = make_model(dropout=0.0)
        objective = Scripted(model, ("epoch_end", "end"), None)
        objective.has_stages = False
        config = quiet_config(tmp_path, early=2, checkpoint_every=1000, keep_checkpoints=9)
        Trainer(model, loss_fn, make_data(), config=config, objective=objective).fit()
    else:
        task_trainer(tmp_path, early=2, checkpoint_every=1000, keep_checkpoints=9).fit()
    assert checkpoint_steps(tmp_path) == [2 * STEPS_PER_EPOCH]
    assert events(tmp_path, "prune") == []


def test_fit_seeds_python_and_numpy_random_with_the_config_seed():
    """fit() seeds random and numpy (rank 0: with config.seed itself) before the first step."""
    drawn = []

    def loss(model, batch):
        if not drawn:
            drawn.append((random.random(), float(np.random.rand())))
        return loss_fn(model, batch)

    random.seed(99)
    np.random.seed(99)
    task_trainer(loss=loss, early=1, seed=5).fit()
    assert drawn == [(random.Random(5).random(), float(np.random.RandomState(5).rand()))]


def test_evaluate_reads_a_list_of_batches():
    """evaluate() over an iterable of batches gives the mean task loss over those batches."""
    model = make_model(dropout=0.0)
    data = make_data(16, seed=3)
    batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in (0, 8)]
    trainer = Trainer(
        model, loss_fn, make_data(), eval_data=batches, config=quiet_config(), objective=TaskObjective(model)
    )
    with torch.no_grad():
        expected = sum(float(loss_fn(model, b)) for b in batches) / 2
    assert trainer.evaluate()["loss"] == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- checkpoints


def test_save_checkpoint_without_folder_names_the_settings():
    """save_checkpoint without a folder raises ValueError naming config.run_dir and checkpoint_dir."""
    with pytest.raises(
        ValueError, match=r"^no checkpoint folder: set config.run_dir or config.checkpoint_dir$"
    ):
        task_trainer().save_checkpoint()


def test_checkpoint_records_versions_and_every_rank_rng(tmp_path):
    """A checkpoint holds format_version, library_version and rng_per_rank (one entry: this rank's rng)."""
    trainer = task_trainer(tmp_path, early=1)
    trainer.fit()
    payload = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", STEPS_PER_EPOCH))
    assert payload["format_version"] == CHECKPOINT_VERSION
    assert payload["library_version"] == comera.__version__
    (only,) = payload["rng_per_rank"]
    assert torch.equal(only["torch"], payload["rng"]["torch"])


def fitted_checkpoint(tmp_path) -> tuple[Trainer, Path]:
    """A task run of one epoch with its end-of-epoch checkpoint file."""
    trainer = task_trainer(tmp_path, early=1)
    trainer.fit()
    return trainer, checkpoint_path(tmp_path / "checkpoints", STEPS_PER_EPOCH)


def assert_same_state(got: Trainer, want: Trainer) -> None:
    for name, tensor in want.module.state_dict().items():
        assert torch.equal(got.module.state_dict()[name], tensor), name
    got_state, want_state = got.optimizer.state_dict()["state"], want.optimizer.state_dict()["state"]
    assert got_state.keys() == want_state.keys() and got_state
    for index, entries in want_state.items():
        for key, value in entries.items():
            assert torch.equal(got_state[index][key], value), (index, key)
    assert got.step == want.step and got.epoch == want.epoch and got.batch_in_epoch == want.batch_in_epoch


def test_a_checkpoint_of_an_earlier_comera_is_refused_and_the_run_starts_nothing(tmp_path):
    """A checkpoint with 'rank_adaptation' for 'objective' (an earlier comera's) is not read: resuming from
    it raises one line naming the file and the way on, and the trainer is left at step 0."""
    _, path = fitted_checkpoint(tmp_path / "a")
    payload = load_checkpoint(path)
    payload["rank_adaptation"] = payload.pop("objective")
    save_checkpoint(payload, tmp_path / "earlier.pt")
    trainer = task_trainer(tmp_path / "b", early=1)
    with pytest.raises(ValueError, match=r"earlier\.pt: a checkpoint of an earlier comera .*--restart"):
        trainer.fit(resume=tmp_path / "earlier.pt")
    assert trainer.step == 0


def test_resume_takes_this_rank_rng_from_rng_per_rank(tmp_path):
    """On resume the process restores its own entry of rng_per_rank (not the top-level rng)."""
    _, path = fitted_checkpoint(tmp_path / "a")
    payload = load_checkpoint(path)
    torch.manual_seed(11)
    mine = capture_rng()
    torch.manual_seed(22)
    payload["rng"], payload["rng_per_rank"] = capture_rng(), [mine]
    save_checkpoint(payload, tmp_path / "ranks.pt")
    trainer = task_trainer(tmp_path / "b", early=1)
    trainer.fit(resume=tmp_path / "ranks.pt")
    assert torch.equal(torch.get_rng_state(), mine["torch"])


def test_resume_without_any_folder_warns_and_starts_fresh():
    """resume=True with no run_dir or checkpoint_dir warns, naming both settings, and trains from step 0."""
    trainer = task_trainer(early=1)
    with pytest.warns(RuntimeWarning) as caught:
        result = trainer.fit(resume=True)
    (warning,) = [w for w in caught if "resume:" in str(w.message)]
    assert str(warning.message) == (
        "resume: no checkpoint folder (config.run_dir and checkpoint_dir are None); training starts from "
        "step 0 (the records of the earlier attempt are dropped)"
    )
    assert result.step == STEPS_PER_EPOCH


def test_resume_with_an_empty_folder_logs_a_resume_from_nothing(tmp_path):
    """resume=True with no checkpoint logs a resume event with checkpoint None and nothing dropped."""
    trainer = task_trainer(tmp_path, early=1)
    with pytest.warns(RuntimeWarning, match="no checkpoint in"):
        trainer.fit(resume=True)
    (event,) = events(tmp_path, "resume")
    assert event["checkpoint"] is None and "unreadable_lines_dropped" not in event


def test_resume_reports_the_unreadable_metrics_lines_it_dropped(tmp_path):
    """A resume drops invalid metrics lines and logs how many, with the checkpoint it used."""
    _, path = fitted_checkpoint(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as file:
        file.write("not json\n{broken\n")
    task_trainer(tmp_path, early=1).fit(resume=True)
    (event,) = events(tmp_path, "resume")
    assert event["checkpoint"] == str(path) and event["unreadable_lines_dropped"] == 2


def test_unreadable_newest_checkpoint_is_reported_and_skipped(tmp_path):
    """A corrupt newest checkpoint warns, logs its path and error as an event; the previous one is used."""
    task_trainer(tmp_path, early=2).fit()
    newest = checkpoint_path(tmp_path / "checkpoints", 2 * STEPS_PER_EPOCH)
    newest.write_bytes(b"garbage")
    with pytest.raises(ValueError) as expected:
        load_checkpoint(newest)
    with pytest.warns(RuntimeWarning) as caught:
        task_trainer(tmp_path, early=2).fit(resume=True)
    assert [w for w in caught if "skipping an unreadable checkpoint" in str(w.message)]
    (event,) = events(tmp_path, "unreadable_checkpoint")
    assert event["checkpoint"] == str(newest) and event["error"] == str(expected.value)
    (resume,) = events(tmp_path, "resume")
    assert resume["checkpoint"] == str(checkpoint_path(tmp_path / "checkpoints", STEPS_PER_EPOCH))
    assert event["step"] == resume["step"] == STEPS_PER_EPOCH  # logged at the step the run resumed from


def test_a_resume_at_the_last_step_logs_the_final_evaluation_its_log_lost(tmp_path):
    """The last step's eval record torn off: a resume at that step evaluates again and logs the record, with
    the same metrics; with the record intact, it logs none twice."""

    def evaluated_trainer() -> Trainer:
        model = make_model(dropout=0.0)
        config = quiet_config(tmp_path, early=1, eval_every=2, checkpoint_every=3)
        return Trainer(
            model,
            loss_fn,
            make_data(),
            eval_data=make_data(16),
            config=config,
            objective=TaskObjective(model),
        )

    evaluated_trainer().fit()
    final = [r for r in read_metrics(tmp_path) if r["kind"] == "eval"][-1]
    assert final["step"] == STEPS_PER_EPOCH
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert '"kind": "eval"' in lines[-1], "the final eval record is the log's last line"
    (tmp_path / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][:30])
    with pytest.warns(RuntimeWarning, match="torn last record"):
        result = evaluated_trainer().fit(resume=True)
    again = [r for r in read_metrics(tmp_path) if r["kind"] == "eval" and r["step"] == STEPS_PER_EPOCH]
    assert len(again) == 1 and again[0]["metrics"] == pytest.approx(final["metrics"])
    assert result.eval == pytest.approx(final["metrics"])
    (torn,) = events(tmp_path, "torn_record_dropped")
    assert torn["step"] == STEPS_PER_EPOCH
    evaluated_trainer().fit(resume=True)
    assert (
        len([r for r in read_metrics(tmp_path) if r["kind"] == "eval" and r["step"] == STEPS_PER_EPOCH]) == 1
    )


def test_resume_warnings_point_at_the_caller_of_fit(tmp_path):
    """Both resume warnings (no checkpoint folder, unreadable checkpoint) point at fit's caller."""
    with pytest.warns(RuntimeWarning) as caught:
        task_trainer(early=1).fit(resume=True)
    assert [w.filename for w in caught if "resume: no checkpoint folder" in str(w.message)] == [__file__]
    task_trainer(tmp_path, early=2).fit()
    checkpoint_path(tmp_path / "checkpoints", 2 * STEPS_PER_EPOCH).write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning) as caught:
        task_trainer(tmp_path, early=2).fit(resume=True)
    assert [w.filename for w in caught if "skipping an unreadable" in str(w.message)] == [__file__]


def nan_at_call(number: int):
    calls = [0]

    def loss(model, batch):
        calls[0] += 1
        value = loss_fn(model, batch)
        return value * math.nan if calls[0] == number else value

    return loss


def test_rollback_is_logged_and_the_progress_bar_steps_back(tmp_path, capsys):
    """A rollback logs failed step, checkpoint and non-finite count; the bar restarts from the checkpoint."""
    trainer = task_trainer(tmp_path, loss=nan_at_call(9), early=2, max_nonfinite=1, progress=True)
    result = trainer.fit()
    (event,) = events(tmp_path, "rollback")
    assert event["failed_at"] == 9 and event["nonfinite"] == 1 and event["step"] == STEPS_PER_EPOCH
    assert event["checkpoint"] == str(checkpoint_path(tmp_path / "checkpoints", STEPS_PER_EPOCH))
    assert result.rollbacks == 1 and result.step == 2 * STEPS_PER_EPOCH
    err = capsys.readouterr().err
    assert "12/12" in err and "15/12" not in err


def test_refused_rollback_names_the_failed_step(tmp_path):
    """With max_rollbacks=0 the NonFiniteError names the step where the non-finite run ended."""
    trainer = task_trainer(tmp_path, loss=nan_at_call(9), early=2, max_nonfinite=1, max_rollbacks=0)
    with pytest.raises(NonFiniteError, match="in a row up to step 9 after 0 rollbacks"):
        trainer.fit()


# ---------------------------------------------------------------- sharded and DDP wiring, in one process
# A sharded (FSDP) or DDP run needs several processes; these tests flip the Trainer's own switches
# (``_sharded``, ``world_size``) in one process to check what it hands to the sharding helpers.


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_sharded_save_checkpoint_writes_a_folder_that_restores_the_state(tmp_path):
    """Sharded save_checkpoint writes step-N.dcp, which a sharded or plain Trainer restores exactly."""
    trainer, _ = fitted_checkpoint(tmp_path)
    trainer._sharded = True
    path = trainer.save_checkpoint()
    assert path == checkpoint_path(tmp_path / "checkpoints", STEPS_PER_EPOCH, sharded=True) and path.is_dir()
    payload = load_checkpoint(path)
    assert payload["shards"] == str(path) and "model" not in payload
    for sharded in (True, False):
        other = task_trainer(tmp_path / f"other{sharded}", early=1)
        other._sharded = sharded
        other.checkpoints.restore(payload, rollback=False)
        assert_same_state(other, trainer)


def test_sharded_state_dict_is_the_whole_model_and_optimizer_state(tmp_path):
    """Under sharding, state_dict still holds the whole model and the optimizer state by position."""
    trainer, _ = fitted_checkpoint(tmp_path)
    model_state, optimizer_state = trainer.module.state_dict(), trainer.optimizer.state_dict()
    trainer._sharded = True
    state = trainer.state_dict()
    assert state["model"].keys() == model_state.keys()
    for name, tensor in model_state.items():
        assert torch.equal(state["model"][name], tensor), name
    assert state["optimizer"]["state"].keys() == optimizer_state["state"].keys()
    for index, entries in optimizer_state["state"].items():
        for key, value in entries.items():
            assert torch.equal(state["optimizer"]["state"][index][key], value), (index, key)


def test_sharded_trainer_restores_a_single_file_checkpoint(tmp_path):
    """A sharded Trainer loads a one-file checkpoint's model and optimizer state exactly."""
    trainer, path = fitted_checkpoint(tmp_path)
    other = task_trainer(tmp_path / "other", early=1)
    other._sharded = True
    other.checkpoints.restore(load_checkpoint(path), rollback=False)
    assert_same_state(other, trainer)


def test_sharded_step_reduces_the_replicated_gradients(monkeypatch):
    """A sharded eager step hands every optimizer parameter, gradients set, to reduce_replicated_gradients."""
    trainer = task_trainer()
    seen = []
    monkeypatch.setattr(
        trainer_module,
        "reduce_replicated_gradients",
        lambda params: seen.append([(p, p.grad is not None) for p in params]),
    )
    trainer._sharded = True
    assert trainer.train_step(next(iter(trainer.train_data.epoch(0))))
    (call,) = seen
    trained = [param for group in trainer.optimizer.param_groups for param in group["params"]]
    assert [p for p, _ in call] == trained and all(has for _, has in call)


class FakeDDP:
    def __init__(self, module, find_unused_parameters=False):
        self.module = module
        self.find_unused_parameters = find_unused_parameters


def test_prune_under_ddp_drops_and_rebuilds_the_wrapper(monkeypatch):
    """Under DDP a prune runs on the bare module, then the model is a new DDP wrapper of the module."""
    monkeypatch.setattr(trainer_module, "DistributedDataParallel", FakeDDP)
    bare = []
    trainer = scripted_trainer(None, (("epoch_end",), {"removed": 1}, lambda: bare.append(trainer.model)))
    trainer.world_size = 2
    old = trainer.model = FakeDDP(trainer.module)
    assert trainer.prune("epoch_end") == {"removed": 1}
    assert bare == [trainer.module]
    assert isinstance(trainer.model, FakeDDP) and trainer.model is not old
    assert trainer.model.module is trainer.module


def test_restore_under_ddp_rebuilds_the_wrapper_and_passes_the_optimizer(tmp_path, monkeypatch):
    """Under DDP a restore re-applies the structure on the bare module with the Trainer's optimizer and
    wraps the module anew."""
    bare = []
    trainer = scripted_trainer(tmp_path, ((), None, lambda: bare.append(trainer.model)), early=1)
    trainer.fit()
    payload = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", STEPS_PER_EPOCH))
    monkeypatch.setattr(trainer_module, "DistributedDataParallel", FakeDDP)
    trainer.world_size = 2
    old = trainer.model = FakeDDP(trainer.module)
    trainer.checkpoints.restore(payload, rollback=False)
    assert bare == [trainer.module] and trainer.objective.structure_optimizer is trainer.optimizer
    assert isinstance(trainer.model, FakeDDP) and trainer.model is not old
    assert trainer.model.module is trainer.module


class BatchOrder(Evaluator):
    """Records the labels of every evaluated batch, in order."""

    def reset(self):
        self.seen = []

    def update(self, model, batch):
        self.seen.append(batch[1].tolist())

    def state(self):
        return self.seen

    def merge(self, states):
        self.seen = [batch for state in states for batch in state]

    def compute(self):
        return {"batches": float(len(self.seen))}


def test_evaluation_reads_a_shuffling_loader_in_its_epoch_zero_order():
    """Evaluation iterates a re-iterable with the global RNG seeded as for epoch 0 (data reproducibility)."""
    model = make_model(dropout=0.0)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=8, shuffle=True)
    evaluator = BatchOrder()
    trainer = Trainer(
        model,
        loss_fn,
        make_data(),
        eval_data=loader,
        evaluator=evaluator,
        config=quiet_config(seed=3),
        objective=TaskObjective(model),
    )
    trainer.evaluate()
    torch.manual_seed(epoch_seed(3, 0))
    assert evaluator.seen == [labels.tolist() for _, labels in loader]


def test_a_folder_with_a_checkpoint_files_name_is_reported_and_replaced_when_that_step_is_saved(tmp_path):
    """An empty folder named step-N.pt in the checkpoint folder: the resume warns that it is not a checkpoint
    and resumes from the one before; saving step N later replaces the folder by the checkpoint file."""
    task_trainer(tmp_path, early=1).fit()  # checkpoint at the end of the epoch
    blocker = checkpoint_path(tmp_path / "checkpoints", 2 * STEPS_PER_EPOCH)
    blocker.mkdir()
    with pytest.warns(RuntimeWarning, match="not a checkpoint, a folder with its name"):
        trainer = task_trainer(tmp_path, early=2)
        trainer.fit(resume=True)
    assert blocker.is_file() and load_checkpoint(blocker)["progress"]["step"] == 2 * STEPS_PER_EPOCH
    (event,) = events(tmp_path, "unreadable_checkpoint")
    assert event["checkpoint"] == str(blocker) and event["step"] == STEPS_PER_EPOCH


def test_a_pipe_with_a_checkpoint_files_name_is_reported_and_replaced_when_that_step_is_saved(tmp_path):
    """A named pipe called step-N.pt: reported at the resume, replaced by the checkpoint of step N."""
    import os

    task_trainer(tmp_path, early=1).fit()
    blocker = checkpoint_path(tmp_path / "checkpoints", 2 * STEPS_PER_EPOCH)
    os.mkfifo(blocker)
    with pytest.warns(RuntimeWarning, match="not a checkpoint, a special file with its name"):
        task_trainer(tmp_path, early=2).fit(resume=True)
    assert blocker.is_file() and load_checkpoint(blocker)["progress"]["step"] == 2 * STEPS_PER_EPOCH
