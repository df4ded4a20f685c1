"""``comera train llm --data DIR`` over a corpus prepared by ``comera prepare llm``: the blocks read through
the memory maps equal the reference token stream, the validation blocks equal the packer's for the same
documents, a damaged shard is named and never read, an unfinished preparation is refused, and the commands
work end to end (a run killed mid-way resumes to the same model)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.torch import load_file
from tokenizers import Tokenizer

from comera.cli import main
from comera.data.bpe import special_ids
from comera.data.prepare import PrepareSettings, prepare_corpus
from comera.data.shard_check import WRITTEN_RECORD, record_written_shards
from comera.data.sources import read_code, split_of
from comera.data.token_shards import read_index
from comera.workloads.llm import prepared as prepared_module
from comera.workloads.llm.data import pack_stream
from comera.workloads.llm.prepared import build_prepared_lm_data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, write_corpus):
    """A corpus and its preparation with shards of about 800 tokens."""
    root = tmp_path_factory.mktemp("lm-prepared")
    source = write_corpus(root / "corpus")
    out = root / "prepared"
    settings = PrepareSettings(vocab_size=300, validation_fraction=0.1, shard_tokens=800)
    prepare_corpus(source, out, settings)
    return source, out


def reference(source, out):
    """The token ids of each split's documents, in reading order, encoded one at a time."""
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    documents, _ = read_code(source, extensions=(".txt",), text_fields=("text",))
    encoded = {"train": [], "validation": []}
    for document in documents:
        encoded[split_of(document.key, 0.1)].append(tokenizer.encode(document.text).ids)
    return tokenizer, encoded


def test_blocks_read_through_the_memory_maps_equal_the_reference_stream(prepared, tmp_path):
    source, out = prepared
    data = build_prepared_lm_data(out, cache_dir=tmp_path, seq_len=16, max_validation_blocks=5)
    tokenizer, encoded = reference(source, out)
    ids = special_ids(tokenizer)
    stream = [token for document in encoded["train"] for token in [*document, ids.eos]]
    assert len(data.train.shards) > 3
    assert all(isinstance(shard, np.memmap) for shard in data.train.shards)
    assert len(data.train) == len(stream) // 16 and data.train.dropped_tokens == len(stream) % 16
    for number in range(len(data.train)):
        assert data.train[number].tolist() == stream[number * 16 : (number + 1) * 16]
    packed = pack_stream(encoded["validation"], 16, ids, tail="pad", max_blocks=5)
    assert len(data.validation) == 5
    assert [data.validation[i].tolist() for i in range(5)] == packed.tokens.long().tolist()
    assert data.info["validation_tokens"] == packed.targets
    assert data.info["train"]["read"] == len(encoded["train"])
    assert (
        data.info["identity"]["tokenizer"]
        == json.loads((out / "index.json").read_text())["tokenizer"]["sha256"]
    )


def test_a_damaged_shard_is_named_and_never_read(prepared, tmp_path, monkeypatch):
    _, clean = prepared
    out = tmp_path / "prepared"
    out.mkdir()
    for path in clean.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
        os.utime(out / path.name, (time.time() - 60, time.time() - 60))  # settled: its check is recorded
    cache = tmp_path / "cache"
    first = build_prepared_lm_data(out, cache_dir=cache, seq_len=16)
    assert first.info["prepared"]["shards_hashed"] == len(list(out.glob("*.bin")))
    again = build_prepared_lm_data(out, cache_dir=cache, seq_len=16)
    assert again.info["prepared"]["shards_hashed"] == 0  # checked once, recorded in the cache
    damaged = bytearray((out / "train-00002.bin").read_bytes())
    damaged[5] ^= 0x01
    (out / "train-00002.bin").write_bytes(bytes(damaged))
    opened = []
    monkeypatch.setattr(prepared_module, "open_shard", lambda *args: opened.append(args))
    with pytest.raises(ValueError, match=r"train-00002.bin's SHA-256 differs .* comera prepare llm --data"):
        build_prepared_lm_data(out, cache_dir=cache, seq_len=16)
    (out / "train-00002.bin").write_bytes(bytes(damaged[:-2]))
    with pytest.raises(ValueError, match=r"train-00002.bin holds [\d,]+ bytes, the index records"):
        build_prepared_lm_data(out, cache_dir=cache, seq_len=16)
    assert opened == []


def test_the_first_start_after_a_preparation_hashes_no_shard_it_wrote(prepared, tmp_path):
    """The preparation records the shards it wrote (size, time, inode, SHA-256): a start with an empty cache
    hashes none of them, and one whose bytes changed since is still hashed and named."""
    _, clean = prepared
    index = read_index(clean)
    entries = {entry["name"]: entry for split in index["splits"].values() for entry in split["shards"]}
    for name, seen in json.loads((clean / WRITTEN_RECORD).read_text()).items():  # those settled by the end
        stat = (clean / name).stat()
        assert seen == [stat.st_size, stat.st_mtime_ns, stat.st_ino, entries[name]["sha256"]], name
    out = tmp_path / "prepared"
    out.mkdir()
    for path in clean.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
        os.utime(out / path.name, (time.time() - 60, time.time() - 60))
    record_written_shards(out, read_index(out))
    shards = len(list(out.glob("*.bin")))
    assert len(json.loads((out / WRITTEN_RECORD).read_text())) == shards
    first = build_prepared_lm_data(out, cache_dir=tmp_path / "cache", seq_len=16)
    assert first.info["prepared"]["shards_hashed"] == 0
    damaged = bytearray((out / "validation-00000.bin").read_bytes())
    damaged[3] ^= 0x01
    (out / "validation-00000.bin").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"validation-00000.bin's SHA-256 differs"):
        build_prepared_lm_data(out, cache_dir=tmp_path / "other-cache", seq_len=16)


def test_an_unfinished_preparation_and_a_tokenizer_file_are_refused(prepared, tmp_path):
    _, clean = prepared
    out = tmp_path / "prepared"
    out.mkdir()
    for path in clean.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match="data.tokenizer_file does not apply"):
        build_prepared_lm_data(
            out, cache_dir=tmp_path, seq_len=16, tokenizer_file=str(out / "tokenizer.json")
        )
    index = json.loads((out / "index.json").read_text())
    (out / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.raises(ValueError, match="the preparation did not finish; complete it with comera prepare"):
        build_prepared_lm_data(out, cache_dir=tmp_path, seq_len=16)


def _train(out_dir, data, cache, *extra):
    command = [sys.executable, "-m", "comera", "train", "llm", "--method", "dense", "--preset", "smoke"]
    command += ["--data", str(data), "--out", str(out_dir), "--cache", str(cache), "--no-progress"]
    settings = ["train.early=60", "train.late=20", "train.checkpoint_every=5", "train.eval_every=40"]
    for assignment in [*settings, "train.plot=false"]:
        command += ["--set", assignment]
    return command + list(extra)


def test_prepare_then_train_end_to_end_and_a_killed_run_resumes_to_the_same_model(
    tmp_path, capsys, write_corpus
):
    source = write_corpus(tmp_path / "corpus", lines=300)
    data = tmp_path / "prepared"
    arguments = ["prepare", "llm", "--data", str(source), "--out", str(data), "--preset", "smoke"]
    assert main([*arguments, "--shard-tokens", "2000", "--set", "data.validation_fraction=0.1"]) == 0
    printed = capsys.readouterr().out
    assert "train-00000.bin: written" in printed and f"prepared corpus: {data}" in printed
    cache = tmp_path / "cache"
    full = tmp_path / "full"
    subprocess.run(_train(full, data, cache), check=True, capture_output=True)
    results = json.loads((full / "results.json").read_text())
    assert results["data"]["prepared"]["folder"] == str(data.resolve())
    assert results["tokens_seen"] == 80 * 8 * 32
    assert (full / "model" / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        _train(killed, data, cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and not list((killed / "checkpoints").glob("step-*.pt")):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "results.json").exists(), "the run finished before it could be killed"
    resumed = subprocess.run(_train(killed, data, cache, "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    events = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert any(event.get("event") == "resume" for event in events)
    got = load_file(str(killed / "model" / "model.safetensors"))
    want = load_file(str(full / "model" / "model.safetensors"))
    assert got.keys() == want.keys() and all((got[name] == want[name]).all() for name in want)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file or folder"),
        (["--preset", "huge"], "unknown --preset 'huge'"),
        (["--set", "data.vocab_sise=3"], "unknown key data.vocab_sise"),
        (["--shard-tokens", "0"], "--shard-tokens must be"),
        (["--sample-mb", "0"], "--sample-mb must be a number > 0"),
    ],
)
def test_bad_prepare_commands_fail_in_one_line_before_writing(tmp_path, capsys, extra, message, write_corpus):
    source = write_corpus(tmp_path / "corpus", files=1, lines=5)
    out = tmp_path / "prepared"
    assert main(["prepare", "llm", "--data", str(source), "--out", str(out), *extra]) == 2
    error = capsys.readouterr().err
    assert message in error and error.startswith("comera prepare: ") and len(error.strip().splitlines()) == 1
    assert not out.exists()


def test_prepare_names_a_looping_or_broken_data_link_and_a_bad_tokenizer_file_as_train_does(
    tmp_path, capsys, write_corpus
):
    """The refusals of ``comera train`` for the same inputs: a looping or dangling ``--data`` link is said to
    be one (not 'no such file'), and ``data.tokenizer_file`` that is not a path or names a folder without a
    tokenizer.json is named with its section, each in one line before anything is written."""
    source = write_corpus(tmp_path / "corpus", files=1, lines=5)
    first, second, dangling = tmp_path / "loop1", tmp_path / "loop2", tmp_path / "dangling"
    first.symlink_to(second)
    second.symlink_to(first)
    dangling.symlink_to(tmp_path / "nowhere")
    cases = [
        ([str(first)], f"--data {first}: a symbolic link that loops (it leads back to itself)"),
        ([str(dangling)], f"--data {dangling}: a broken symbolic link (to {tmp_path / 'nowhere'}"),
        (
            [str(source), "--set", "data.tokenizer_file=123"],
            "data.tokenizer_file must be the path of a tokenizer.json file (a string) or unset, got 123",
        ),
        (
            [str(source), "--set", f"data.tokenizer_file='{tmp_path}'"],
            f"data.tokenizer_file {tmp_path} is a folder without a tokenizer.json",
        ),
    ]
    out = tmp_path / "prepared"
    for arguments, message in cases:
        assert main(["prepare", "llm", "--out", str(out), "--data", *arguments]) == 2
        error = capsys.readouterr().err
        assert message in error and error.startswith("comera prepare: "), error
        assert len(error.strip().splitlines()) == 1
        assert not out.exists()
