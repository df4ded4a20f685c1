"""A run folder always resumes, or says why not: a killed run's leftovers, missing or unreadable checkpoints,
edited data; and results.json describes the saved model in strict JSON."""

import json
import shutil

import pytest
import torch
import toy
from safetensors.torch import load_file

import comera
from comera.cli.commands.train import main
from comera.recipes.run import SetupError, run
from comera.recipes.run_records import strict_json
from comera.train import read_metrics

LATE_STAGE_MID_EPOCH = ['train.unit="step"', "train.early=4", "train.late=3", "method.target_ratio=0.3"]


def _strict_load(path):
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _run(tmp_path, out, assignments=(), **kwargs):
    settings = ["train.plot=false", *assignments]
    return run("toy", preset="smoke", out=out, cache_dir=tmp_path / "cache", assignments=settings, **kwargs)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished toy run's folder and results (copy it before changing it)."""
    folder = tmp_path_factory.mktemp("finished")
    return folder / "run", _run(folder, folder / "run")


@pytest.fixture
def killed_run(finished_run, tmp_path):
    """A copy of the finished run without its results.json, as a run killed after its last checkpoint."""
    source, results = finished_run
    out = tmp_path / "run"
    shutil.copytree(source, out)
    (out / "results.json").unlink()
    return out, results


def test_resume_without_a_checkpoint_says_so_and_keeps_only_the_records_it_recomputes(killed_run, tmp_path):
    out, results = killed_run
    shutil.rmtree(out / "checkpoints")
    shutil.rmtree(out / "model")
    with pytest.raises(SetupError, match="already holds a run; continue it with --resume"):
        _run(tmp_path, out)
    with pytest.warns(RuntimeWarning, match="no checkpoint in .*training starts from step 0"):
        resumed = _run(tmp_path, out, resume=True)
    steps = [record["step"] for record in read_metrics(out) if record["kind"] == "train"]
    assert steps == list(range(1, results["steps"] + 1)), "every step logged once"
    events = [record["event"] for record in read_metrics(out) if record["kind"] == "event"]
    assert events.count("late_stage") == 1 and "resume" in events
    assert resumed["evaluation"] == results["evaluation"]


def test_a_resume_may_keep_its_checkpoints_otherwise_and_trains_the_same_run(killed_run, tmp_path):
    """``train.keep_checkpoints`` and ``train.checkpoint_every`` decide only what is kept on disk: a resume
    with other values is accepted, they hold from then on (``config.json`` says so), and the run ends as
    it would have; a changed setting that does matter is still refused, its default shown when the run did
    not name it."""
    out, results = killed_run
    shutil.rmtree(out / "checkpoints")
    keeping = ["train.keep_checkpoints=1", "train.checkpoint_every=1"]
    with pytest.raises(SetupError, match=r"\(train.seed: unset \(the default, 0\) then, 3 now\)"):
        _run(tmp_path, out, [*keeping, "train.seed=3"], resume=True)
    with pytest.warns(RuntimeWarning, match="no checkpoint in"):
        resumed = _run(tmp_path, out, keeping, resume=True)
    assert resumed["evaluation"] == results["evaluation"]
    assert len(list((out / "checkpoints").glob("step-*.pt"))) == 1
    recorded = json.loads((out / "config.json").read_text())["settings"]["train"]
    assert (recorded["keep_checkpoints"], recorded["checkpoint_every"]) == (1, 1)


def test_a_torn_metrics_line_is_dropped_with_a_warning_and_the_log_stays_valid(killed_run, tmp_path):
    """Killed mid-write before its first checkpoint: the resume trains from step 0 and appends."""
    out, results = killed_run
    shutil.rmtree(out / "checkpoints")
    with (out / "metrics.jsonl").open("a") as file:
        file.write('{"kind": "train", "step": 4, "lo')
    with pytest.warns(RuntimeWarning, match="dropped a torn last record"):
        _run(tmp_path, out, resume=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert any(record.get("event") == "torn_record_dropped" for record in records)
    assert _strict_load(out / "results.json")["evaluation"] == results["evaluation"]


def test_a_resume_refuses_edited_data_naming_the_file(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"label": "neutral"}\n')
    out = tmp_path / "run"
    _run(tmp_path, out, data=data)
    (out / "results.json").unlink()
    data.write_text('{"label": "entails"}\n')  # the same size, other content
    with pytest.raises(SetupError, match=r"the data changed since the run started \(pairs\.jsonl: 21 bytes"):
        _run(tmp_path, out, data=data, resume=True)


def test_stale_temporaries_of_a_killed_process_are_removed_and_others_kept(killed_run, tmp_path):
    out, _ = killed_run
    stale = [
        out / "checkpoints" / f".step-00000006.pt.{'a' * 32}.tmp",
        out / f".metrics.jsonl.{'b' * 32}.tmp",
        out / f".model.{'c' * 32}.tmp",
    ]
    for path in stale[:2]:
        path.write_bytes(b"half a file")
    stale[2].mkdir()
    (stale[2] / "model.safetensors").write_bytes(b"half a file")
    kept = [out / "notes.tmp", out / ".notes.tmp"]
    for path in kept:
        path.write_text("mine")
    _run(tmp_path, out, resume=True)
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)


def test_wall_time_counts_the_training_time_before_the_resumed_checkpoint(killed_run, tmp_path):
    out, _ = killed_run
    (newest,) = sorted((out / "checkpoints").glob("step-*.pt"))[-1:]
    payload = torch.load(newest, weights_only=True)
    payload["progress"]["train_time_s"] = 1000.0
    torch.save(payload, newest)
    assert _run(tmp_path, out, resume=True)["wall_time_s"] > 1000.0


def test_unreadable_checkpoints_are_one_line_and_restart_keeps_the_old_files(killed_run, tmp_path, capsys):
    out, _ = killed_run
    arguments = ["toy", "--preset", "smoke", "--out", str(out), "--cache", str(tmp_path / "cache")]
    arguments += ["--set", "train.plot=false"]
    checkpoints = sorted((out / "checkpoints").glob("step-*.pt"))
    for path in checkpoints:
        path.write_bytes(b"junk")
    capsys.readouterr()
    assert main([*arguments, "--resume"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("comera train: --resume: no readable checkpoint in")
    assert "start the run again with --restart" in error[-1]
    assert all(line.startswith("comera train: ") for line in error), "warnings in one line each"
    assert main([*arguments, "--restart"]) == 0
    aside = out.with_name("run.old-1")
    assert "the files of the run it replaced: " in capsys.readouterr().out
    assert (aside / "checkpoints" / checkpoints[-1].name).read_bytes() == b"junk"
    assert (aside / "config.json").is_file() and not (aside / "results.json").exists()
    assert _strict_load(out / "results.json")["earlier_run"] == str(aside)
    with pytest.raises(SystemExit):
        main([*arguments, "--resume", "--restart"])


@pytest.mark.parametrize("prune_at", [None, '["early_end"]'])
def test_the_saved_model_holds_the_reported_parameters_when_the_late_stage_ends_mid_epoch(tmp_path, prune_at):
    out = tmp_path / "run"
    extra = [] if prune_at is None else [f"method.prune_at={prune_at}"]
    results = _run(tmp_path, out, assignments=[*LATE_STAGE_MID_EPOCH, *extra])
    base = toy.ToyRecipe().build_model({"hidden": 32}, None)
    saved = comera.load_pretrained(out / "model", base_model=base)
    trains = [module for module in saved.modules() if isinstance(module, comera.GatedTrain)]
    assert trains and all(train.ranks == train.max_ranks for train in trains), "stored ranks are active"
    assert results["params"] == comera.compression_report(saved).model_params
    stored = load_file(str(out / "model" / "model.safetensors"))
    core_entries = sum(tensor.numel() for key, tensor in stored.items() if ".cores." in key)
    assert core_entries == comera.compression_report(saved).tensorized_params


def test_an_evaluation_split_without_examples_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SetupError, match=r"the validation split has no examples \(0 read, 0 skipped\)"):
        _run(tmp_path, out, assignments=["data.eval_samples=0"])
    assert not (out / "checkpoints").exists()


def test_results_json_is_strict_json_when_a_metric_is_undefined(tmp_path, monkeypatch):
    """As the AUC of a split with one class: the metric is null, the file strict JSON."""
    compute = toy.AccuracyEvaluator.compute
    monkeypatch.setattr(toy.AccuracyEvaluator, "compute", lambda self: {**compute(self), "auc": float("nan")})
    out = tmp_path / "run"
    results = _run(tmp_path, out)
    assert _strict_load(out / "results.json") == results
    assert results["evaluation"]["test"]["auc"] is None and results["evaluation"]["test"]["accuracy"] > 0
    text = strict_json({"a": [float("nan"), float("-inf"), 1.5]})
    assert json.loads(text) == {"a": [None, None, 1.5]}


@pytest.mark.parametrize(
    ("name", "make", "found"),
    [
        ("metrics.jsonl", "folder", "a folder"),
        ("metrics.jsonl", "fifo", "neither a file nor a folder"),
        ("checkpoints", "file", "a file"),
        ("checkpoints", "dangling link", "a symbolic link that leads nowhere"),
        ("plots", "file", "a file"),
        ("report.txt", "folder", "a folder"),
    ],
)
def test_a_run_entry_of_the_wrong_kind_is_refused_before_the_data_is_read(
    killed_run, tmp_path, name, make, found
):
    """metrics.jsonl a folder or a pipe, checkpoints a file or a dangling link, plots a file, report.txt a
    folder: --resume refuses in one line naming the entry, before the data is built (no cache is written)."""
    import os

    out, _ = killed_run
    path = out / name
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    if make == "folder":
        path.mkdir()
    elif make == "file":
        path.write_text("x")
    elif make == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "nowhere")
    wanted = "a folder" if name in ("checkpoints", "plots") else "a file"
    with pytest.raises(
        SetupError, match=f"^{path} should be {wanted} of the run but is {found}: move it away$"
    ):
        _run(tmp_path / "fresh", out, resume=True)
    assert not (tmp_path / "fresh" / "cache").exists(), "refused before the data was built"


def test_a_run_folder_that_another_process_writes_is_refused_naming_the_process(killed_run, tmp_path):
    """While another process holds the run folder (a run training there, or workers of a killed launcher),
    --resume refuses in one line naming that process; once it has ended, the resume goes ahead."""
    import subprocess
    import sys

    out, results = killed_run
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from comera.recipes.folders import lock_run_folder; "
            f"lock_run_folder(Path({str(out)!r})); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            SetupError, match=rf"^--out {out} is in use by another process \(pid {holder.pid}\)"
        ):
            _run(tmp_path, out, resume=True)
    finally:
        holder.kill()
        holder.wait()
    assert _run(tmp_path, out, resume=True)["steps"] == results["steps"]


def test_restart_takes_the_next_number_past_a_dangling_link(killed_run, tmp_path):
    """OUT.old-1 a symbolic link to nothing: --restart moves the run to OUT.old-2, leaving the link."""
    out, _ = killed_run
    dangling = out.with_name("run.old-1")
    dangling.symlink_to(tmp_path / "nowhere")
    results = _run(tmp_path, out, restart=True)
    assert dangling.is_symlink() and not dangling.exists()
    assert results["earlier_run"] == str(out.with_name("run.old-2").resolve())


def test_a_method_with_its_own_optimizer_is_refused_under_fsdp_before_anything_is_written(
    tmp_path, monkeypatch
):
    """--method galore (its own optimizer) with train.parallel=fsdp in several processes: one error naming
    the command-line setting, before the run folder or the data is touched."""
    import comera.recipes.run as run_module

    monkeypatch.setattr(run_module, "world", lambda: (0, 2))
    with pytest.raises(
        SetupError, match=r"^--method galore brings its own optimizer, .* --set train.parallel=ddp$"
    ):
        run(
            "toy",
            method="galore",
            preset="smoke",
            out=tmp_path / "run",
            cache_dir=tmp_path / "cache",
            assignments=["train.parallel=fsdp"],
        )
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
