"""Records: metrics.jsonl against the model, rank heat-map data, the PNG plots, the progress bar."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import accuracy_fn, loss_fn, make_data, make_model

from comera.cpu import reset_peak_resident
from comera.methods.comera import CoMERAObjective
from comera.train import TrainConfig, Trainer, plot_run, rank_history, read_metrics

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    config = TrainConfig(early=1, late=1, batch_size=8, log_every=2, run_dir=str(run_dir), plot=False)
    model = make_model(dead_gate=True)
    initial = sum(model[i].num_parameters() for i in (0, 3))
    trainer = Trainer(
        model,
        loss_fn,
        make_data(),
        eval_data=make_data(16, 3),
        eval_fn=accuracy_fn,
        config=config,
        objective=CoMERAObjective(model, gamma=1.0, lr_gates=0.05),
    )
    trainer.fit()
    return run_dir, model, initial


def test_metrics_records_match_the_model(finished_run):
    run_dir, model, initial = finished_run
    records = read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert [r["stage"] for r in train] == ["early"] * 3 + ["late"] * 3
    last = train[-1]
    size = sum(model[i].num_parameters() for i in (0, 3))
    assert last["ranks"] == {"0": list(model[0].ranks), "3": list(model[3].ranks)}
    assert last["size"] == size and last["ratio"] == pytest.approx(size / initial)
    assert last["lr"] == {"cores": 1e-4, "gates": 0.05, "other": 5e-5}
    assert last["step_time"] > 0 and last["peak_memory_mib"] > 0
    prunes = [r for r in records if r["kind"] == "event" and r["event"] == "prune"]
    assert prunes[0]["step"] == 6 and prunes[0]["layers"]["0"][1] < make_model()[0].max_ranks[1], (
        "dead gate kept"
    )
    assert prunes[0]["stored_after"] < prunes[0]["stored_before"]
    assert [p["layers"]["0"] for p in prunes if "0" in p["layers"]][-1] == list(model[0].max_ranks)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [6, 12] and set(evals[0]["metrics"]) == {"loss", "accuracy"}


def test_rank_history_fills_removed_layers_with_zero():
    records = [
        {"kind": "train", "step": 1, "ranks": {"a": [4, 3], "b": [2]}},
        {"kind": "event", "step": 1, "event": "prune"},
        {"kind": "train", "step": 2, "ranks": {"a": [3, 3]}},
    ]
    labels, steps, matrix = rank_history(records)
    assert labels == ["a[0]", "a[1]", "b[0]"] and steps == [1, 2]
    assert matrix.tolist() == [[4, 3], [3, 3], [2, 0]]


def test_plot_run_writes_three_pngs(finished_run, tmp_path):
    from matplotlib.image import imread

    run_dir, _, _ = finished_run
    paths = plot_run(run_dir, tmp_path)
    assert [p.name for p in paths] == ["loss.png", "ratio.png", "ranks.png"]
    shapes = {p.name: imread(p).shape for p in paths}
    assert shapes["loss.png"][:2] == (400, 1100)  # two panels: training loss and evaluation
    assert shapes["ratio.png"][:2] == (400, 600)
    assert imread(paths[2]).std() > 0.05, "blank heat map"


def test_plot_run_refuses_missing_or_empty_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"kind": "event", "step": 0, "event": "resume"}) + "\n"
    )
    with pytest.raises(ValueError, match="no training record"):
        plot_run(tmp_path)


def test_read_metrics_ignores_only_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tra')
    assert read_metrics(path) == [{"kind": "train", "step": 1}]
    path.write_text('{"kind": "tra\n{"kind": "train", "step": 1}\n')
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        read_metrics(path)


def test_progress_bar_shows_steps_loss_and_ratio(capsys):
    config = TrainConfig(early=1, batch_size=8, log_every=3, progress=True)
    Trainer(make_model(), loss_fn, make_data(), config=config).fit()
    shown = capsys.readouterr().err
    assert "6/6" in shown and "ratio=1.000" in shown and "loss=" in shown and "step/s" in shown


_PEAK_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from tiny import loss_fn, make_data, make_model
from comera.cpu import status_kib
from comera.train import TrainConfig, Trainer, read_metrics
block = np.ones(1000 * 2**20, dtype=np.uint8)  # 1000 MiB resident before training (a data build, say)
del block  # returned to the kernel: the resident set falls, its high-water mark stays
before = status_kib("VmHWM") / 1024
config = TrainConfig(early=1, batch_size=8, run_dir=sys.argv[2], plot=False, reuse_cpu_memory=False)
Trainer(make_model(), loss_fn, make_data(), config=config).fit()
peak = max(r["peak_memory_mib"] for r in read_metrics(sys.argv[2]) if r["kind"] == "train")
print(json.dumps({"record": peak, "before": before}))
"""


def test_the_recorded_peak_is_the_training_one_not_the_process_lifetime_one(tmp_path):
    if not reset_peak_resident():
        pytest.skip("the kernel's resident high-water mark cannot be reset here (not Linux)")
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, here, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        check=True,
    )
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["before"] - peaks["record"] > 700, peaks  # the 1000 MiB before fit() is not counted
