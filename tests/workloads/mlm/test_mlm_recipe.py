"""``comera train mlm`` end to end at smoke size, and the exactness of its masked-LM metrics."""

import json
import math
from pathlib import Path

import pytest
import torch

import comera
import comera.workloads.mlm.recipe  # noqa: F401  (registers the recipe)
from comera.recipes.base import get_recipe
from comera.recipes.run import run
from comera.workloads.mlm.data import build_code_data
from comera.workloads.mlm.model import build_mlm_model
from comera.workloads.mlm.recipe import MaskedLMEvaluator

FOLDER = Path(__file__).resolve().parents[2] / "data" / "code_folder"
# the fixture's sources end in .src; with this fraction one of its four files is in validation
SETTINGS = ['data.extensions=[".src"]', "data.validation_fraction=0.25", "train.plot=false"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenizer cache for the runs of this module."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("method", ["comera", "dense"])
def test_smoke_run_writes_results_with_exact_masked_lm_metrics(tmp_path, cache, method):
    out = tmp_path / "run"
    results = run(
        "mlm", method=method, preset="smoke", data=FOLDER, assignments=SETTINGS, out=out, cache_dir=cache
    )
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(results))
    metrics = results["evaluation"]["validation"]
    assert set(metrics) == {"mlm_loss", "mlm_accuracy", "perplexity"}
    assert math.isclose(metrics["perplexity"], math.exp(metrics["mlm_loss"]), rel_tol=1e-12)
    assert results["data"]["splits"]["validation"]["read"] == 1
    assert results["data"]["splits"]["train"]["skipped_not_utf8"] == 1

    # recompute: the saved model, each validation block alone through the Hugging Face loss
    model = comera.load_pretrained(out / "model").eval()
    if method == "comera":
        assert isinstance(model.lm_head.decoder, comera.TTMTiedHead)
    data = build_code_data(
        FOLDER, cache_dir=tmp_path, seq_len=32, vocab_size=300, extensions=[".src"], validation_fraction=0.25
    )
    loss_sum, correct, count, near_ties = 0.0, 0, 0, 0
    with torch.no_grad():
        for index in range(len(data.validation)):
            batch = data.collator([data.validation[index]])
            masked = int((batch["labels"] != -100).sum())
            if masked == 0:
                continue
            output = model(**batch)
            loss_sum += float(output.loss) * masked
            chosen = batch["labels"] != -100
            logits = output.logits[chosen]
            correct += int((logits.argmax(-1) == batch["labels"][chosen]).sum())
            top_two = logits.topk(2, dim=-1).values
            near_ties += int((top_two[:, 0] - top_two[:, 1] < 1e-4).sum())
            count += masked
    assert math.isclose(metrics["mlm_loss"], loss_sum / count, rel_tol=1e-5)
    # the run batched the blocks, this loop takes one at a time: the logits agree to rounding, so exactly
    # the same tokens are right unless two top logits are within rounding of each other (none, in practice)
    assert abs(round(metrics["mlm_accuracy"] * count) - correct) <= near_ties


def test_evaluator_merges_shards_into_the_whole_split_values():
    logits = torch.randn(4, 6, 11, dtype=torch.float64)
    labels = torch.full((4, 6), -100)
    labels[:, 1] = torch.tensor([3, 7, 0, 10])
    labels[2, 4] = 5

    class Fixed(torch.nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.rows = rows
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask, labels, masked_only):
            # the contract of CodeMaskedLM: logits of the labelled positions only, in row-major order
            assert masked_only
            return type("Output", (), {"logits": logits[self.rows][labels != -100], "loss": None})()

    def batch(rows):
        return {
            "input_ids": torch.zeros(len(rows), 6, dtype=torch.long),
            "attention_mask": torch.ones(len(rows), 6),
            "labels": labels[rows],
        }

    shards = []
    for rows in ([0, 1], [2, 3]):
        evaluator = MaskedLMEvaluator()
        evaluator.reset()
        evaluator.update(Fixed(rows), batch(rows))
        shards.append(evaluator.state())
    merged = MaskedLMEvaluator()
    merged.merge(shards)
    chosen = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[chosen], labels[chosen])
    result = merged.compute()
    assert math.isclose(result["mlm_loss"], float(expected), rel_tol=1e-12)
    assert result["mlm_accuracy"] == float((logits[chosen].argmax(-1) == labels[chosen]).double().mean())
    assert math.isclose(result["perplexity"], math.exp(float(expected)), rel_tol=1e-12)


def test_loss_is_the_mean_over_masked_tokens_and_zero_without_any():
    recipe = get_recipe("mlm")
    torch.manual_seed(0)
    model = build_mlm_model("smoke", 300, dropout=0.0).eval()
    ids = torch.randint(5, 300, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7] = 17, 42
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    torch.testing.assert_close(recipe.loss_fn(model, batch), model(**batch).loss)
    batch["labels"] = torch.full_like(ids, -100)
    assert float(recipe.loss_fn(model, batch).detach()) == 0.0


def test_lte_trains_the_encoder_linears_and_leaves_the_masked_rows_head_plain(tmp_path, cache):
    from comera.methods import MethodContext, get_method
    from comera.methods.lte import LTELinear
    from comera.recipes.settings import tensorize_config
    from comera.recipes.spec import run_spec

    # the LM head's transform sees the masked positions of all sequences as rows, which LTE's heads cannot
    # split by sequence; the run must still train
    results = run(
        "mlm",
        method="lte",
        preset="smoke",
        data=FOLDER,
        assignments=[*SETTINGS, "method.heads=2"],
        out=tmp_path / "run",
        cache_dir=cache,
    )
    assert math.isfinite(results["evaluation"]["validation"]["mlm_loss"]) and results["steps"] == 6
    settings = run_spec("mlm", "lte", "smoke", data=FOLDER, assignments=SETTINGS).header()["settings"]
    context = MethodContext(tensorize=tensorize_config(settings), settings=settings["method"])
    model = get_method("lte").prepare(build_mlm_model("smoke", vocab_size=300), context)
    assert type(model.lm_head.dense) is torch.nn.Linear
    layer = model.roberta.encoder.layer[0]
    assert isinstance(layer.attention.self.query, LTELinear) and isinstance(layer.output.dense, LTELinear)
