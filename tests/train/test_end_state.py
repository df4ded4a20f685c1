"""What a finished or resumed Trainer run leaves: a model at its active ranks, a log without torn lines, the
training time carried through checkpoints."""

import json
import shutil

import pytest
from tiny import loss_fn, make_data, make_model

from comera import GatedTrain
from comera.methods.comera import CoMERAObjective
from comera.train import TrainConfig, Trainer, read_metrics
from comera.train.checkpoint import NoReadableCheckpointError
from comera.train.metrics import carries_ranks, record_problem


def _trains(model):
    return [module for module in model.modules() if isinstance(module, GatedTrain)]


def test_a_late_stage_ending_mid_epoch_leaves_the_model_at_its_active_ranks():
    # 48 samples in batches of 8: 6 steps per epoch; the late stage trims to its target at its last step
    config = TrainConfig(early=4, late=3, unit="step", batch_size=8, plot=False)
    model = make_model()
    objective = CoMERAObjective(model, target_ratio=0.3)
    Trainer(model, loss_fn, make_data(), config=config, objective=objective).fit()
    trains = _trains(model)
    assert [train.max_ranks for train in trains] != [train.max_ranks for train in _trains(make_model())]
    assert all(train.ranks == train.max_ranks for train in trains), "pruned at the end of training"


def test_training_after_a_torn_line_without_a_checkpoint_keeps_every_line_valid(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n{"kind": "train", "st')
    config = TrainConfig(early=1, batch_size=8, log_every=1, run_dir=str(tmp_path), plot=False)
    with pytest.warns(RuntimeWarning, match="dropped a torn last record"):
        Trainer(make_model(), loss_fn, make_data(), config=config).fit(resume=True)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 7))


def test_train_time_is_carried_through_a_checkpoint_and_all_unreadable_is_its_own_error(tmp_path):
    config = TrainConfig(early=1, batch_size=8, checkpoint_every=3, run_dir=str(tmp_path), plot=False)
    first = Trainer(make_model(), loss_fn, make_data(), config=config)
    first.fit()
    payload = first.state_dict()
    assert payload["progress"]["train_time_s"] > 0
    payload["progress"]["train_time_s"] = 500.0
    resumed = Trainer(make_model(), loss_fn, make_data(), config=config)
    resumed.checkpoints.restore(payload, rollback=False)
    assert resumed.state_dict()["progress"]["train_time_s"] >= 500.0
    for path in (tmp_path / "checkpoints").glob("step-*.pt"):
        path.write_bytes(b"junk")
    with pytest.warns(RuntimeWarning), pytest.raises(NoReadableCheckpointError, match="all 2 are truncated"):
        Trainer(make_model(), loss_fn, make_data(), config=config).fit(resume=True)


def test_a_resume_at_the_last_step_with_an_emptied_log_warns_that_it_drew_no_plot(tmp_path):
    """The plots are a by-product: a run resumed at its last step whose ``metrics.jsonl`` was emptied has
    no training record to plot, which is said in a warning, not raised out of ``fit``."""
    config = TrainConfig(early=2, unit="step", batch_size=8, checkpoint_every=1, run_dir=str(tmp_path))
    Trainer(make_model(), loss_fn, make_data(), config=config).fit()
    assert (tmp_path / "plots").is_dir()
    shutil.rmtree(tmp_path / "plots")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.warns(RuntimeWarning, match="metrics.jsonl holds no training record, so no plot was drawn"):
        result = Trainer(make_model(), loss_fn, make_data(), config=config).fit(resume=True)
    assert result.step == 2 and not (tmp_path / "plots").exists()


def test_a_record_the_plots_cannot_read_is_dropped_on_resume_and_a_plot_path_in_the_way_warns(tmp_path):
    """A train record without a key a plot needs is dropped when the run resumes (with a warning), so the
    finished run is plotted and ``comera plot`` can read it; a folder where a plot file goes: the run
    finishes (it is trained and saved) and a warning says why no plot was drawn."""
    config = TrainConfig(early=2, unit="step", batch_size=8, checkpoint_every=1, run_dir=str(tmp_path / "a"))
    Trainer(make_model(), loss_fn, make_data(), config=config).fit()
    metrics = tmp_path / "a" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if json.loads(line).get("kind") == "train")
    lines[first] = json.dumps({**json.loads(lines[first]), "ratio": None}) + "\n"
    lines.insert(first, json.dumps({"kind": "eval", "step": 1}) + "\n")
    metrics.write_text("".join(lines))
    shutil.rmtree(tmp_path / "a" / "plots")
    (tmp_path / "a" / "checkpoints" / "step-00000002.pt").unlink()
    with pytest.warns(RuntimeWarning, match=r"dropped 2 line\(s\) that hold no readable record"):
        assert Trainer(make_model(), loss_fn, make_data(), config=config).fit(resume=True).step == 2
    assert (tmp_path / "a" / "plots" / "loss.png").is_file()
    kept = read_metrics(metrics)
    assert all(record_problem(record, carries_ranks(kept)) is None for record in kept)
    assert [r["step"] for r in kept if r.get("kind") == "train"] == [2]
    other = TrainConfig(early=2, unit="step", batch_size=8, run_dir=str(tmp_path / "b"))
    (tmp_path / "b" / "plots" / "loss.png").mkdir(parents=True)
    with pytest.warns(RuntimeWarning, match=r"not every plot was drawn: .*loss.png: cannot write the plot"):
        assert Trainer(make_model(), loss_fn, make_data(), config=other).fit().step == 2


def test_a_readable_checkpoint_of_another_model_is_skipped_on_resume(tmp_path):
    """A checkpoint whose structure names layers this model lacks (copied from another run) is skipped with
    a warning and an event, and the run resumes from its own newest checkpoint."""
    from comera.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

    def trainer(early):
        model = make_model()
        config = TrainConfig(
            early=early, unit="step", batch_size=8, checkpoint_every=2, run_dir=str(tmp_path), plot=False
        )
        return Trainer(model, loss_fn, make_data(), config=config, objective=CoMERAObjective(model))

    trainer(4).fit()
    foreign = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4))
    foreign["structure"] = {"encoder.other": {"removed": False, "ranks": [2]}}
    save_checkpoint(foreign, checkpoint_path(tmp_path / "checkpoints", 6))
    with pytest.warns(
        RuntimeWarning, match=r"skipping a checkpoint of another model: .*step-00000006.pt: .*lacks"
    ):
        resumed = trainer(8)
        resumed.fit(resume=True)
    events = [record for record in read_metrics(tmp_path) if record.get("event") == "foreign_checkpoint"]
    assert len(events) == 1 and events[0]["checkpoint"].endswith("step-00000006.pt")
    assert events[0]["step"] == 4  # at the step the run resumed from; a history event, kept past step 4
    resume = [record for record in read_metrics(tmp_path) if record.get("event") == "resume"]
    assert resume[-1]["checkpoint"].endswith("step-00000004.pt") and resumed.step == 8
    assert resume[-1]["processes"] == 1


def test_train_records_lost_from_the_log_before_the_checkpoint_are_said_missing(tmp_path):
    """``metrics.jsonl`` cut at a line end after step 2 and the newest checkpoint gone: the resume from step
    4 warns that the train records of steps 3 and 4 are missing (they are not written again), logs a
    ``records_missing`` event, and the run goes on to log steps 5 and 6."""
    import os

    config = TrainConfig(
        early=6, unit="step", batch_size=8, log_every=1, checkpoint_every=2, run_dir=str(tmp_path), plot=False
    )
    Trainer(make_model(), loss_fn, make_data(), config=config).fit()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut = max(i for i, line in enumerate(lines) if '"kind": "train"' in line and '"step": 2,' in line)
    (tmp_path / "metrics.jsonl").write_text("".join(lines[: cut + 1]))
    os.remove(tmp_path / "checkpoints" / "step-00000006.pt")
    with pytest.warns(RuntimeWarning, match=r"train records of 2 logged step\(s\) up to step 4 are missing"):
        Trainer(make_model(), loss_fn, make_data(), config=config).fit(resume=True)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if r.get("kind") == "train"] == [1, 2, 5, 6]
    missing = [r for r in records if r.get("event") == "records_missing"]
    assert len(missing) == 1 and (missing[0]["steps"], missing[0]["first"]) == (2, 3)


def _comera_trainer(run_dir, **settings) -> Trainer:
    """The tiny CoMERA run of 8 steps, a checkpoint every 2 (all kept); ``settings`` override these."""
    model = make_model()
    config = TrainConfig(
        **{
            "early": 8,
            "unit": "step",
            "batch_size": 8,
            "checkpoint_every": 2,
            "keep_checkpoints": 10,
            "run_dir": str(run_dir),
            "plot": False,
            **settings,
        }
    )
    return Trainer(model, loss_fn, make_data(), config=config, objective=CoMERAObjective(model))


def _resumed_past_an_edited_checkpoint(tmp_path, edit, why) -> None:
    """Run to the end, keep only the step-4 checkpoint, save ``edit(payload)`` of it as step 6, resume: the
    edited one is skipped (its warning matches ``why``) and the run ends as the uninterrupted one."""
    import copy

    import torch

    from comera.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

    whole = _comera_trainer(tmp_path)
    whole.fit()
    expected = copy.deepcopy(whole.module.state_dict())
    for path in (tmp_path / "checkpoints").iterdir():
        if path.name != "step-00000004.pt":
            path.unlink()
    payload = load_checkpoint(checkpoint_path(tmp_path / "checkpoints", 4))
    save_checkpoint(edit(payload), checkpoint_path(tmp_path / "checkpoints", 6))
    with pytest.warns(RuntimeWarning, match=f"skipping a checkpoint of another model: .*{why}"):
        resumed = _comera_trainer(tmp_path)
        resumed.fit(resume=True)
    assert resumed.objective.structure() == whole.objective.structure()
    for name, value in expected.items():
        torch.testing.assert_close(resumed.module.state_dict()[name], value, msg=name)


def _wider_head(payload):
    import torch

    head = payload["model"]["5.weight"]
    payload["model"]["5.weight"] = torch.zeros(head.shape[0] + 1, head.shape[1])
    return payload


def _ranks_of_one(payload):
    payload["structure"] = {
        "0": {"removed": False, "ranks": [1, 1, 1]},
        "3": {"removed": False, "ranks": [1]},
    }
    return payload


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_wider_head, r"'5.weight' has shape"),
        (_ranks_of_one, r"'0.cores.0' has shape \[1, 3, 3\], its structure gives \[1, 3, 1\]"),
    ],
)
def test_a_checkpoint_of_a_model_of_other_widths_is_skipped_before_it_changes_the_model(tmp_path, edit, why):
    """The newest checkpoint comes from a model with the same layer names but other widths, or records
    ranks its tensors do not have (an edited file): it is refused by its shapes before its structure is
    applied, so the run's own older checkpoint (of larger ranks) still resumes, and the run ends as an
    uninterrupted one."""
    _resumed_past_an_edited_checkpoint(tmp_path, edit, why)


def _without_removed(payload):
    del payload["structure"]["0"]["removed"]
    return payload


def _rank_as_text(payload):
    payload["structure"]["0"]["ranks"][0] = "3"
    return payload


def _rank_below_one(payload):
    payload["structure"]["0"]["ranks"][0] = -1
    return payload


def _structure_as_a_list(payload):
    payload["structure"] = list(payload["structure"].items())
    return payload


def _removed_with_tensors(payload):
    payload["structure"]["0"]["removed"] = True
    return payload


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_without_removed, "structure record of layer '0' is malformed"),
        (_rank_as_text, "structure record of layer '0' is malformed"),
        (_rank_below_one, r"layer '0' holds ranks \[-1, .*every rank at least 1"),
        (_structure_as_a_list, "structure record is not a mapping of layers"),
        (_removed_with_tensors, "belongs to a layer its structure records as removed"),
    ],
)
def test_a_checkpoint_with_a_malformed_structure_record_is_skipped_before_it_changes_the_model(
    tmp_path, edit, why
):
    """The newest checkpoint's structure record edited (a key gone, a rank as text or below 1, not a mapping,
    a layer marked removed whose tensors it still holds): skipped with a warning before anything changes;
    the run resumes from its own older checkpoint and ends as an uninterrupted run."""
    _resumed_past_an_edited_checkpoint(tmp_path, edit, why)


def test_a_resume_between_two_records_logs_the_record_an_uninterrupted_run_logs(tmp_path):
    """Checkpoints every 3 steps, records every 2: the checkpoint at step 3 falls inside the window of
    the record of step 4. A run resumed there continues that window (saved in the checkpoint), so every
    train record after the resume holds the loss, objective and ratio of the uninterrupted run's."""
    settings = {"batch_size": 4, "checkpoint_every": 3, "log_every": 2}
    _comera_trainer(tmp_path / "whole", **settings).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for path in (tmp_path / "cut" / "checkpoints").iterdir():
        if path.name != "step-00000003.pt":
            path.unlink()
    assert _comera_trainer(tmp_path / "cut", **settings).fit(resume=True).step == 8

    def train_records(run_dir):
        return {
            record["step"]: (record["loss"], record["objective"], record["ratio"])
            for record in read_metrics(run_dir)
            if record.get("kind") == "train"
        }

    whole, cut = train_records(tmp_path / "whole"), train_records(tmp_path / "cut")
    assert sorted(cut) == sorted(whole) == [2, 4, 6, 8]
    assert cut == whole
