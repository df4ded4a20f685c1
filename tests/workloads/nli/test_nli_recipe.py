"""The nli recipe end to end at smoke size on the embedded task, and its evaluator against scikit-learn."""

import json

import pytest
import torch
from sklearn.metrics import accuracy_score, log_loss
from torch.utils.data import DataLoader

import comera
from comera.recipes.base import RecipeData
from comera.recipes.run import run
from comera.workloads.nli.data import build_nli_data
from comera.workloads.nli.recipe import NLIRecipe, PairAccuracy

SMOKE = NLIRecipe.presets["smoke"]


def test_smoke_run_reports_exact_accuracy_and_data_counts(tmp_path):
    out = tmp_path / "run"
    results = run(
        "nli", method="comera", preset="smoke", out=out, cache_dir=tmp_path / "cache", progress=False
    )
    assert json.loads((out / "results.json").read_text()) == results
    assert results["data"]["splits"]["train"]["read"] == SMOKE["data"]["train_pairs"]
    assert results["data"]["splits"]["validation"]["majority_accuracy"] == 0.5
    assert results["data"]["task"] == "docstring-code pairs"
    assert results["compression"]["tensorized"] > 1.0 and results["stage"] == "late"
    data = build_nli_data(None, tmp_path / "cache", **SMOKE["data"])
    model = comera.load_pretrained(out / "model").eval()
    batch = data.collate_fn([data.evals["validation"][i] for i in range(len(data.evals["validation"]))])
    with torch.no_grad():
        logits = model(
            batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["exact_match_ids"]
        ).double()
    labels = batch["labels"].numpy()
    want_accuracy = accuracy_score(labels, logits.argmax(-1).numpy())
    want_loss = log_loss(labels, logits.softmax(-1).numpy(), labels=[0, 1])
    assert results["evaluation"]["validation"]["accuracy"] == pytest.approx(want_accuracy)
    assert results["evaluation"]["validation"]["loss"] == pytest.approx(want_loss, rel=1e-5)


def test_evaluator_merges_batches_exactly(tmp_path):
    data = build_nli_data(None, tmp_path, **SMOKE["data"])
    recipe = NLIRecipe()
    model = recipe.build_model(SMOKE["model"], RecipeData(data.train, data.evals, data.collate_fn, data.info))
    model.eval()
    dataset = data.evals["validation"]
    states = []
    for batches in (DataLoader(dataset, batch_size=5, collate_fn=data.collate_fn),) * 2:
        evaluator = recipe.evaluator({})
        evaluator.reset()
        with torch.no_grad():
            for batch in batches:
                evaluator.update(model, batch)
        states.append(evaluator.state())
    whole = data.collate_fn([dataset[i] for i in range(len(dataset))])
    with torch.no_grad():
        logits = model(
            whole["input_ids"], whole["token_type_ids"], whole["attention_mask"], whole["exact_match_ids"]
        )
    merged = PairAccuracy()
    merged.merge(states)
    metrics = merged.compute()
    assert metrics["accuracy"] == pytest.approx(accuracy_score(whole["labels"], logits.argmax(-1)))
    want = torch.nn.functional.cross_entropy(logits, whole["labels"]).item()
    assert metrics["loss"] == pytest.approx(want, rel=1e-5)


def test_model_must_hold_the_longest_encoding(tmp_path):
    data = build_nli_data(None, tmp_path, **SMOKE["data"])
    recipe_data = RecipeData(data.train, data.evals, data.collate_fn, data.info)
    with pytest.raises(
        ValueError, match=r"model.max_positions \(16\) must be at least data.max_length \(32\)"
    ):
        NLIRecipe().build_model({**SMOKE["model"], "max_positions": 16}, recipe_data)
