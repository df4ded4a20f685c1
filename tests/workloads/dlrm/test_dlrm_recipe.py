"""``comera train dlrm`` end to end at smoke size; the reported metrics against scikit-learn on the saved
model's predictions."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

import comera.workloads.dlrm.recipe  # noqa: F401  (registers the recipe)
from comera import TTMEmbeddingBag, load_pretrained
from comera.recipes.run import SetupError, run
from comera.workloads.dlrm.synthetic import synthetic_criteo

FIXTURE = Path(__file__).parents[2] / "data" / "criteo_sample.txt"


@pytest.mark.parametrize("method", ["dense", "comera"])
def test_smoke_run_reports_exact_metrics(tmp_path, method):
    results = run(
        "dlrm", method=method, preset="smoke", out=tmp_path / "run", cache_dir=tmp_path, progress=False
    )
    assert (
        json.loads((tmp_path / "run" / "results.json").read_text(), parse_constant=float)["method"] == method
    )
    model = load_pretrained(tmp_path / "run" / "model").eval()
    assert any(isinstance(t, TTMEmbeddingBag) for t in model.tables) == (method == "comera")
    test = synthetic_criteo(2100, seed=0, max_table_rows=1000).splits()["test"]
    batch = test.gather(np.arange(len(test)))
    with torch.no_grad():
        logits = model(batch.dense, batch.ids).double().numpy()
    labels = batch.labels.numpy()
    probs = 1.0 / (1.0 + np.exp(-logits))
    reported = results["evaluation"]["test"]
    assert set(reported) == {"auc", "ne", "log_loss", "accuracy"}
    assert reported["auc"] == pytest.approx(roc_auc_score(labels, logits), abs=1e-9)
    assert reported["log_loss"] == pytest.approx(log_loss(labels, probs), rel=1e-5)
    assert reported["accuracy"] == pytest.approx(accuracy_score(labels, probs > 0.5))
    rate = labels.mean()
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert reported["ne"] == pytest.approx(log_loss(labels, probs) / entropy, rel=1e-5)
    assert results["data"]["splits"]["train"]["read"] == 1800
    if method == "comera":
        assert results["compression"]["tensorized"] > 5


def test_run_on_a_criteo_file(tmp_path):
    results = run(
        "dlrm",
        method="dense",
        preset="smoke",
        data=FIXTURE,
        out=tmp_path / "run",
        cache_dir=tmp_path,
        progress=False,
    )
    assert results["data"]["lines_read"] == 21
    assert [results["data"]["splits"][s]["read"] for s in ("train", "validation", "test")] == [18, 1, 2]
    assert len(results["data"]["cardinalities"]) == 26
    assert results["evaluation"]["validation"]["auc"] is None  # one sample: AUC undefined, null in JSON


def test_a_folder_or_a_malformed_file_is_refused(tmp_path):
    with pytest.raises(SetupError, match="got a folder"):
        run("dlrm", preset="smoke", data=tmp_path, out=tmp_path / "a", cache_dir=tmp_path)
    bad = FIXTURE.parent / "criteo_short_line.txt"
    with pytest.raises(SetupError, match=r"criteo_short_line\.txt:4"):
        run("dlrm", preset="smoke", data=bad, out=tmp_path / "b", cache_dir=tmp_path)


@pytest.mark.parametrize("lines", [0, 13])
def test_too_few_samples_name_the_file_and_the_minimum(tmp_path, lines):
    small = tmp_path / "small.txt"
    small.write_text("".join(FIXTURE.read_text().splitlines(keepends=True)[:lines]))
    message = rf"--data {small} has {lines} samples: too few for train, validation and test; .* at least 14 "
    with pytest.raises(SetupError, match=message):
        run("dlrm", preset="smoke", data=small, out=tmp_path / "run", cache_dir=tmp_path)


def test_too_few_synthetic_samples_name_data_rows_and_the_minimum_is_enough(tmp_path):
    too_few = ["data.rows=13"]
    with pytest.raises(
        SetupError, match=r"the synthetic data \(data.rows=13\) has 13 samples: .* at least 14"
    ):
        run("dlrm", preset="smoke", out=tmp_path / "s", cache_dir=tmp_path / "c", assignments=too_few)
    assert not any(path.is_file() for path in (tmp_path / "c").rglob("*"))  # refused before any row was made
    small = tmp_path / "small.txt"
    small.write_text("".join(FIXTURE.read_text().splitlines(keepends=True)[:14]))
    results = run("dlrm", preset="smoke", data=small, out=tmp_path / "ok", cache_dir=tmp_path, progress=False)
    assert [results["data"]["splits"][s]["read"] for s in ("train", "validation", "test")] == [12, 1, 1]


@pytest.mark.parametrize("method", ["galore", "apollo", "lte", "cola"])
def test_every_baseline_trains_dlrm_on_its_mlps(tmp_path, method):
    if method in ("galore", "apollo"):
        pytest.importorskip(f"{method}_torch")
    settings = ["method.heads=2"] if method == "lte" else []
    results = run(
        "dlrm",
        method=method,
        preset="smoke",
        out=tmp_path / "run",
        cache_dir=tmp_path,
        progress=False,
        assignments=settings,
    )
    assert results["method"] == method and results["nonfinite_steps"] == 0
    assert 0.0 < results["evaluation"]["test"]["auc"] < 1.0
    if method == "cola":
        assert results["params"] < results["dense_params"]
    elif method == "lte":
        assert results["params"] > results["dense_params"]
    else:
        assert results["params"] == results["dense_params"]


def test_data_that_is_not_a_regular_file_and_an_int_range_are_worded_right(tmp_path):
    with pytest.raises(SetupError, match="expected a Criteo train.txt or day file, got not a regular file"):
        run("dlrm", preset="smoke", data="/dev/null", out=tmp_path / "a", cache_dir=tmp_path)
    with pytest.raises(SetupError, match=r"data.max_table_rows must be an int in \[1, "):
        rows = ["data.max_table_rows=0"]
        run("dlrm", preset="smoke", out=tmp_path / "b", cache_dir=tmp_path, assignments=rows)
