"""``comera train llm`` end to end at smoke size, its perplexity against a hand computation, its memory
estimate, and its errors."""

import json
import math
import re

import pytest
import torch
from tokenizers import Tokenizer

import comera
from comera.cli import main
from comera.data.tokenize import tokenizer_digest
from comera.measure import weights_optimizer_mib
from comera.recipes.run import SetupError, run
from comera.recipes.saved import load_run_model
from comera.workloads import load_recipe
from comera.workloads.llm.data import build_lm_data
from comera.workloads.llm.model import LlamaLM
from comera.workloads.llm.recipe import NextTokenEvaluator

COMMON_KEYS = {
    "recipe",
    "method",
    "preset",
    "evaluation",
    "data",
    "params",
    "dense_params",
    "compression",
    "step_time_s",
    "peak_memory_mib",
    "wall_time_s",
    "steps",
}
LM_KEYS = {"perplexity", "loss", "tokens_seen", "tokens_per_s", "validation_tokens", "weights_optimizer_mib"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenizer cache for the runs of this module."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("method", ["dense", "comera", "cola", "lte"])
def test_smoke_run_reports_perplexity_tokens_and_memory(tmp_path, cache, method):
    out = tmp_path / "run"
    command = ["train", "llm", "--method", method, "--preset", "smoke", "--out", str(out)]
    assert main([*command, "--cache", str(cache), "--set", "train.plot=false"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results) >= COMMON_KEYS | LM_KEYS
    validation = results["evaluation"]["validation"]
    assert results["loss"] == validation["loss"]
    assert math.isclose(results["perplexity"], math.exp(results["loss"]), rel_tol=1e-12)
    assert results["validation_tokens"] == validation["tokens"] == results["data"]["validation_tokens"] > 0
    assert results["tokens_seen"] == 6 * 8 * 32  # steps x batch x seq_len
    assert results["tokens_per_s"] == pytest.approx(8 * 32 / results["step_time_s"])
    assert results["weights_optimizer_mib"] > 0 and results["peak_memory_mib"] > 0

    # the saved model and tokenizer, evaluated again by hand: token-weighted mean cross entropy
    tokenizer = Tokenizer.from_file(str(out / "model" / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == results["data"]["vocab_size"]
    model = load_run_model(out)  # CoLA's and LTE's own layers rebuilt through the run's settings
    if method in ("dense", "comera"):
        torch.testing.assert_close(comera.load_pretrained(out / "model").state_dict(), model.state_dict())
    if method == "comera":
        assert isinstance(model.embed, comera.TTMEmbedding) and results["compression"]["tensorized"] > 1
    data = build_lm_data(None, cache_dir=cache, seq_len=32, vocab_size=300, max_bytes=100_000,
                         validation_fraction=0.1, max_validation_blocks=16)  # fmt: skip
    pad = data.ids.pad
    total, count = 0.0, 0
    with torch.no_grad():
        for block in data.validation.tokens.long():
            logits = model(block[None]).double()[0]
            for position in range(len(block) - 1):
                target = int(block[position + 1])
                if target != pad:
                    total -= float(torch.log_softmax(logits[position], -1)[target])
                    count += 1
    assert count == results["validation_tokens"]
    assert results["loss"] == pytest.approx(total / count, rel=1e-9)
    assert results["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-9)


def test_the_evaluator_weights_tokens_not_blocks():
    model = LlamaLM.from_preset("smoke", pad_token_id=1).eval()
    first = torch.tensor([[5, 6, 7, 8, 9, 10]])
    second = torch.tensor([[11, 12, 1, 1, 1, 1]])  # one real target, then padding
    evaluator = NextTokenEvaluator()
    evaluator.reset()
    with torch.no_grad():
        evaluator.update(model, first)
        evaluator.update(model, second)
        losses = []
        for block in (first, second):
            logits = model(block)[0, :-1].double()
            for position, target in enumerate(block[0, 1:].tolist()):
                if target != 1:
                    losses.append(-float(torch.log_softmax(logits[position], -1)[target]))
    metrics = evaluator.compute()
    assert metrics["tokens"] == len(losses) == 6
    assert metrics["loss"] == pytest.approx(sum(losses) / 6, rel=1e-12)
    assert metrics["perplexity"] == pytest.approx(math.exp(sum(losses) / 6), rel=1e-12)


def test_weights_optimizer_memory_counts_every_tensor_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    optimizer = torch.optim.AdamW(model.parameters())
    assert weights_optimizer_mib(model, optimizer) * 2**20 == (12 + 3 + 6) * 4  # no state before a step
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    # two moments per parameter (float32) and a float32 step counter per parameter (3 parameters)
    assert weights_optimizer_mib(model, optimizer) * 2**20 == 3 * (12 + 3 + 6) * 4 + 3 * 4


def test_the_workload_is_registered_with_its_presets():
    recipe = load_recipe("llm")
    assert set(recipe.presets) == {"paper", "small", "smoke"}
    for preset in recipe.presets.values():
        assert preset["train"]["lr_schedule"] == "cosine"
        assert preset["train"]["warmup"] == 0.1 and preset["train"]["min_lr_ratio"] == 0.1


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--preset", "huge"], "unknown --preset 'huge'; choose one of \\['paper', 'small', 'smoke'\\]"),
        (["--method", "sgd"], r"invalid choice: 'sgd' \(choose from .*'cola', 'comera', 'dense'"),
        (["--data", "MISSING"], "--data .*missing: no such file or folder"),
    ],
)
def test_bad_preset_method_and_data_path_give_clear_errors(tmp_path, capsys, arguments, message):
    arguments = [a.replace("MISSING", str(tmp_path / "missing")) for a in arguments]
    try:
        code = main(["train", "llm", "--out", str(tmp_path / "run"), *arguments])
    except SystemExit as stopped:  # argparse's own choices
        code = stopped.code
    assert code != 0
    assert re.search(message, capsys.readouterr().err)


def test_a_folder_without_documents_is_refused_before_training(tmp_path):
    (tmp_path / "data").mkdir()
    with pytest.raises(SetupError, match=r"data: no \.txt, .*\.parquet file found") as refused:
        run("llm", method="dense", preset="smoke", data=tmp_path / "data", out=tmp_path / "run")
    for ending in (".jsonl,", ".jsonl.gz,", ".jsonl.zst,"):
        assert ending in str(refused.value)


def test_a_cola_run_generates_and_a_wrong_method_in_its_config_is_named(tmp_path, cache, capsys):
    out = tmp_path / "run"
    command = [
        "train",
        "llm",
        "--method",
        "cola",
        "--preset",
        "smoke",
        "--out",
        str(out),
        "--cache",
        str(cache),
    ]
    assert main([*command, "--set", "train.plot=false"]) == 0
    capsys.readouterr()
    recorded = json.loads((out / "results.json").read_text())["data"]["identity"]["tokenizer"]
    saved = Tokenizer.from_file(str(out / "model" / "tokenizer.json"))
    assert recorded == tokenizer_digest(saved)  # what generate checks the saved tokenizer against
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip() != ""
    with pytest.raises(ValueError, match="missing key"):
        comera.load_pretrained(out / "model")  # CoLA's factors are not comera layers
    header = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**header, "method": "dense"}))
    with pytest.raises(ValueError, match=r"rebuilding it as its run did \(.*config.json\) failed too"):
        load_run_model(out)
