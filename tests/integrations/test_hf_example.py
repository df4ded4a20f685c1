"""examples/hf_llama_pretrain.py at a smoke size: a folder of generated ``.txt`` files (in a fresh process, as
a user runs it) and the same text prepared by ``comera prepare llm`` (in this process): the run trains,
evaluates, prunes, saves, loads back with ``comera.from_pretrained`` to the same perplexity, and generates."""

import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it
pytest.importorskip("datasets")  # the example's training set is a datasets.Dataset

from comera.data.prepare import PrepareSettings, prepare_corpus  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "hf_llama_pretrain.py"
VOCAB = 300
SMOKE = [
    *("--hidden-size", "32", "--intermediate-size", "64", "--layers", "2", "--heads", "4"),
    *("--seq-len", "32", "--vocab-size", str(VOCAB), "--rank", "4", "--validation-fraction", "0.3"),
    *("--steps", "24", "--batch-size", "4", "--eval-steps", "12", "--eval-blocks", "8", "--new-tokens", "6"),
    *("--lr", "3e-3", "--lr-cores", "1e-2", "--lr-gates", "1e-2"),
]


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    """12 files of 150 short sentences over a 24-word vocabulary."""
    folder = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    subjects, verbs = ("the cat", "a dog", "the bird", "my friend"), ("sees", "likes", "finds", "helps")
    objects = ("the ball", "a tree", "the house", "the river", "a book", "the garden")
    for number in range(12):
        sentences = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(150)]
        (folder / f"doc{number}.txt").write_text(" ".join(sentences) + "\n")
    return folder


def check_run(summary: dict, out: Path) -> None:
    """What a run must show: it learned (perplexity under half the uniform guess's, the vocabulary size),
    the late stage and a prune happened, the loaded model scores the same and generated text."""
    assert summary["perplexity"] < VOCAB / 2
    assert summary["loaded_perplexity"] == pytest.approx(summary["perplexity"], rel=1e-6)
    events = [event for _, event in summary["events"]]
    assert "late_stage" in events and "prune" in events
    assert summary["compression"] > 1 and summary["generated"].strip()
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {"comera_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (out / "model").iterdir()
    }


def test_the_example_runs_on_a_folder_of_text_files(text_folder, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, str(SCRIPT), "--data", str(text_folder), "--out", str(out), "--threads", "1"]
    done = subprocess.run(command + SMOKE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check_run(json.loads(done.stdout.strip().splitlines()[-1]), out)


@pytest.fixture(scope="module")
def example():
    """The example script as a module (its ``main(argv)`` run in this process)."""
    spec = importlib.util.spec_from_file_location("hf_llama_pretrain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_runs_on_a_prepared_corpus(example, text_folder, tmp_path, capsys):
    prepared = tmp_path / "prepared"
    prepare_corpus(
        text_folder, prepared, PrepareSettings(vocab_size=VOCAB, validation_fraction=0.3), workers=0
    )
    out = tmp_path / "run"
    assert example.main(["--data", str(prepared), "--out", str(out), *SMOKE]) == 0
    check_run(json.loads(capsys.readouterr().out.strip().splitlines()[-1]), out)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--data", "nowhere", "--data .*nowhere does not exist"),
        ("--steps", "0", "--steps must be >= 1, got 0"),
    ],
)
def test_a_bad_argument_is_refused_naming_it(example, text_folder, tmp_path, capsys, option, value, message):
    argv = {"--data": str(text_folder), "--out": str(tmp_path)}
    argv[option] = str(tmp_path / value) if option == "--data" else value
    with pytest.raises(SystemExit) as stop:
        example.main([part for pair in argv.items() for part in pair])
    assert stop.value.code == 2
    assert re.search(message, capsys.readouterr().err.splitlines()[-1])
