"""``comera generate RUN_DIR``: on fake ``llm`` run folders (a BPE trained here, a smoke model saved with
save_pretrained), dense, tensorized and pruned, against a no-cache greedy reference; its one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

import comera
from comera.cli import main
from comera.cli.commands import generate as generate_module
from comera.cli.commands.generate import EOS_TOKEN, end_token_id
from comera.data.bpe import SPECIAL_TOKENS, train_tokenizer
from comera.workloads.llm.model import LlamaLM
from comera.workloads.llm.presets import llm_tensorize_config
from comera.workloads.nli.model import TransformerClassifier

VOCAB = 320  # 16 x 20 rows for the TTM embedding; the BPE below has at most this many tokens
LINES = [
    "def add(left, right):\n    return left + right\n",
    "the quick brown fox jumps over the lazy dog\n",
    "for index in range(10):\n    print(index, index * index)\n",
    "import torch\nimport comera\nmodel = comera.tensorize_(model)\n",
] * 8
PROMPT = "def add(left"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(LINES, VOCAB)


def smoke_model(kind: str) -> LlamaLM:
    torch.manual_seed(0)
    model = LlamaLM.from_preset("smoke", vocab_size=VOCAB, tie_embeddings=kind == "pruned")
    if kind != "dense":
        config = llm_tensorize_config(
            linear_rank=4, embedding_rank=4, width=(4, 8), mlp=(8, 11), rows=(16, 20)
        )
        comera.tensorize_(model, config)
    if kind == "pruned":
        with torch.no_grad():
            model.blocks[0].attention.v.gates[1][:3] = 0.0
            model.embed.gates[0][:2] = 0.0
        comera.prune_(model)
        assert model.blocks[0].attention.v.max_ranks[1] == 1
    return model.eval()


def write_run(run_dir: Path, model: nn.Module, tokenizer=None) -> Path:
    """A run folder as comera train llm leaves it (the parts generate reads)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"recipe": "llm"}))
    comera.save_pretrained(model, run_dir / "model")
    if tokenizer is not None:
        (run_dir / "model" / "tokenizer.json").write_text(tokenizer.to_str())
    return run_dir


def reference_continuation(model: LlamaLM, tokenizer, prompt: str, new_tokens: int) -> str:
    """Greedy decoding that re-runs the whole prefix each step, stopped after the end token."""
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    start, eos = ids.shape[1], tokenizer.token_to_id(EOS_TOKEN)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
            if int(ids[0, -1]) == eos:
                break
    return tokenizer.decode(ids[0, start:].tolist(), skip_special_tokens=True)


def generate_cli(capsys, *arguments: str) -> tuple[int, str, str]:
    status = main(["generate", *arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_end_token_is_the_bpe_tokenizers(tokenizer):
    assert EOS_TOKEN == "</s>" and EOS_TOKEN in SPECIAL_TOKENS
    assert tokenizer.token_to_id(EOS_TOKEN) is not None


@pytest.mark.parametrize("kind", ["dense", "tt", "pruned"])
def test_greedy_continuation_equals_the_no_cache_reference(tmp_path, capsys, tokenizer, kind):
    model = smoke_model(kind)
    run_dir = write_run(tmp_path / "run", model, tokenizer)
    status, out, err = generate_cli(capsys, str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "20")
    assert status == 0, err
    expected = reference_continuation(model, tokenizer, PROMPT, 20)
    assert expected and out == expected + "\n"


def test_the_default_length_stops_at_the_context(tmp_path, capsys, tokenizer):
    model = smoke_model("dense")
    run_dir = write_run(tmp_path / "run", model, tokenizer)
    status, out, err = generate_cli(capsys, str(run_dir), "--prompt", PROMPT)  # 64 > the 32-token context
    assert status == 0, err
    room = 32 - len(tokenizer.encode(PROMPT).ids)
    assert out == reference_continuation(model, tokenizer, PROMPT, room) + "\n"


def test_sampling_with_a_seed_repeats(tmp_path, capsys, tokenizer):
    run_dir = write_run(tmp_path / "run", smoke_model("tt"), tokenizer)
    command = [
        str(run_dir),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "20",
        "--temperature",
        "1",
        "--top-k",
        "50",
    ]
    command += ["--seed", "5"]
    first = generate_cli(capsys, *command)
    assert first[0] == 0 and first == generate_cli(capsys, *command)
    assert first != generate_cli(capsys, *command[:-1], "6")


def test_the_console_entry_point_runs_in_a_fresh_process(tmp_path, tokenizer):
    model = smoke_model("dense")
    run_dir = write_run(tmp_path / "run", model, tokenizer)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "comera",
            "generate",
            str(run_dir),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == reference_continuation(model, tokenizer, PROMPT, 8) + "\n"


def one_line_error(capsys, *arguments: str) -> str:
    status, out, err = generate_cli(capsys, *arguments)
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_missing_and_unfinished_run_folders_are_named(tmp_path, capsys):
    error = one_line_error(capsys, str(tmp_path / "nowhere"), "--prompt", "x")
    assert f"RUN_DIR {tmp_path / 'nowhere'} is not a folder" in error
    assert "comera train llm" in error
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "config.json").write_text("{}")
    error = one_line_error(capsys, str(unfinished), "--prompt", "x")
    assert "holds no model/ yet: the run has not finished" in error and "--resume" in error
    empty = tmp_path / "empty"
    empty.mkdir()
    error = one_line_error(capsys, str(empty), "--prompt", "x")
    assert "holds no model/ folder; comera generate works on the run folders of `comera train llm`" in error


def test_a_model_without_its_tokenizer_is_refused(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", smoke_model("dense"))
    error = one_line_error(capsys, str(run_dir), "--prompt", "x")
    assert f"{run_dir / 'model' / 'tokenizer.json'} not found" in error


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, capsys, tokenizer):
    torch.manual_seed(0)
    run_dir = write_run(tmp_path / "run", LlamaLM.from_preset("smoke"), tokenizer)  # 96 tokens
    error = one_line_error(capsys, str(run_dir), "--prompt", "x")
    assert f"has {tokenizer.get_vocab_size()} tokens but the model's vocabulary has 96" in error


def test_a_run_of_another_workload_is_refused(tmp_path, capsys, tokenizer):
    torch.manual_seed(0)
    nli = write_run(tmp_path / "nli", TransformerClassifier.from_preset("smoke"), tokenizer)
    error = one_line_error(capsys, str(nli), "--prompt", "x")
    assert "holds a TransformerClassifier, not a language model (LlamaLM)" in error
    assert "comera generate works on the run folders of `comera train llm`" in error
    unregistered = write_run(tmp_path / "plain", nn.Sequential(nn.Linear(4, 4)), tokenizer)
    error = one_line_error(capsys, str(unregistered), "--prompt", "x")
    assert "not a language model" in error and "`comera train llm`" in error


def test_prompt_and_options_are_checked(tmp_path, capsys, tokenizer):
    run_dir = str(write_run(tmp_path / "run", smoke_model("dense"), tokenizer))
    length = len(tokenizer.encode(PROMPT).ids)
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--max-new-tokens", "40")
    assert (
        f"the prompt's {length} tokens plus --max-new-tokens 40 exceed the model's context of 32 tokens; "
        f"use --max-new-tokens {32 - length} or fewer"
    ) in error
    error = one_line_error(capsys, run_dir, "--prompt", "")
    assert "--prompt must hold some text" in error
    long_prompt = " ".join(["quick brown fox"] * 20)
    error = one_line_error(capsys, run_dir, "--prompt", long_prompt)
    assert "fill the model's context of 32 tokens; use a shorter --prompt" in error
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--temperature", "1", "--top-k", "0")
    assert f"comera generate: --top-k must be an int in [1, {VOCAB}], got 0" in error
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--max-new-tokens", "0")
    assert "comera generate: --max-new-tokens must be an int >= 1, got 0" in error
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--temperature", "-1")
    assert "comera generate: --temperature must be a finite number in [0.0, inf), got -1.0" in error
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--temperature", "1", "--seed", "-3")
    assert "comera generate: --seed must be an int in [0, " in error


def test_a_tiny_temperature_continues_greedily(tmp_path, capsys, tokenizer):
    model = smoke_model("tt")
    run_dir = write_run(tmp_path / "run", model, tokenizer)
    arguments = [str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "1e-45"]
    status, out, err = generate_cli(capsys, *arguments, "--seed", "3")
    assert status == 0, err
    assert out == reference_continuation(model, tokenizer, PROMPT, 12) + "\n"


def test_top_k_without_temperature_is_refused_naming_both_options(tmp_path, capsys, tokenizer):
    run_dir = str(write_run(tmp_path / "run", smoke_model("dense"), tokenizer))
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--top-k", "5")
    assert "comera generate: --top-k 5 needs sampling: give --temperature above 0 with it" in error
    error = one_line_error(capsys, run_dir, "--prompt", PROMPT, "--top-k", "5", "--temperature", "0")
    assert "--top-k 5 needs sampling" in error


def test_a_swapped_tokenizer_is_refused_by_the_digest_the_run_recorded(tmp_path, capsys, tokenizer):
    """``results.json`` records the digest of the run's tokenizer (``data.identity.tokenizer``): the file
    itself passes, another tokenizer of no more tokens (which the size check lets through) is named."""
    from comera.data.tokenize import tokenizer_digest

    model = smoke_model("dense")
    run_dir = write_run(tmp_path / "run", model, tokenizer)
    results = {"data": {"identity": {"tokenizer": tokenizer_digest(tokenizer)}}}
    (run_dir / "results.json").write_text(json.dumps(results))
    status, out, err = generate_cli(capsys, str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "6")
    assert status == 0, err
    assert out == reference_continuation(model, tokenizer, PROMPT, 6) + "\n"
    other = train_tokenizer(["the lazy dog sleeps all day long\n"] * 8, VOCAB - 20)
    assert other.get_vocab_size() <= VOCAB and tokenizer_digest(other) != tokenizer_digest(tokenizer)
    (run_dir / "model" / "tokenizer.json").write_text(other.to_str())
    error = one_line_error(capsys, str(run_dir), "--prompt", PROMPT)
    assert f"{run_dir / 'model' / 'tokenizer.json'} is not the tokenizer the run trained with" in error
    assert f"sha256 {tokenizer_digest(tokenizer)[:12]} in {run_dir / 'results.json'}" in error


@pytest.mark.parametrize("name", ["model.safetensors", "comera_config.json"])
def test_a_damaged_model_file_is_named_as_damaged_not_as_another_model(tmp_path, capsys, tokenizer, name):
    run_dir = write_run(tmp_path / "run", smoke_model("tt"), tokenizer)
    damaged = run_dir / "model" / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    error = one_line_error(capsys, str(run_dir), "--prompt", PROMPT)
    assert f"comera generate: the run's saved model is damaged: {damaged}: " in error
    assert "truncated or corrupt" in error and "not a language model" not in error


def test_generation_stops_at_the_end_token_of_a_gpt2_style_tokenizer(tmp_path, capsys, monkeypatch):
    gpt2 = Tokenizer(models.BPE())
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    gpt2.train_from_iterator(LINES, trainer)
    assert gpt2.token_to_id(EOS_TOKEN) is None and end_token_id(gpt2) == gpt2.token_to_id("<|endoftext|>")
    assert end_token_id(train_tokenizer(LINES, VOCAB)) == 2  # comera's BPE: </s>
    passed = []
    monkeypatch.setattr(
        generate_module, "generate", lambda *args, eos_id, **kwargs: passed.append(eos_id) or args[1]
    )
    run_dir = write_run(tmp_path / "run", smoke_model("dense"), gpt2)
    status, _, err = generate_cli(capsys, str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "4")
    assert status == 0, err
    assert passed == [gpt2.token_to_id("<|endoftext|>")]
