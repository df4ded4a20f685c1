"""Preparing at scale: worker processes write the shards one process writes, the preparation's memory does not
grow with the corpus, training reads stay memory-mapped and bounded, the phases are reported one line each
off a terminal, and the embedded corpora, prepared into the cache, give the blocks of the in-memory packing
(so run folders started before still resume over the same tokens)."""

import json
import random
import subprocess
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from comera.data import prepare as prepare_module
from comera.data.bpe import train_tokenizer
from comera.data.encode_pool import EncodePool
from comera.data.prepare import PrepareSettings, prepare_corpus
from comera.data.progress import Progress
from comera.train.data import EpochData
from comera.workloads.llm.data import build_lm_data
from comera.workloads.llm.prepared import build_embedded_lm_data, build_prepared_lm_data
from comera.workloads.mlm.data import build_code_data
from comera.workloads.mlm.prepared import build_embedded_code_data

WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":"]


def write_corpus(root, files=2, lines=200, seed=0, words=(4, 60)):
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(files):
        with (root / f"part{number}.jsonl").open("w") as file:
            for _ in range(lines):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
                file.write(json.dumps({"text": text}) + "\n")
    return root


@pytest.fixture
def tokenizer_file(tmp_path):
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(200)]
    path = tmp_path / "tokenizer.json"
    train_tokenizer(texts, 300).save(str(path))
    return path


def settings(tokenizer_file, **changes):
    values = {
        "vocab_size": 300,
        "validation_fraction": 0.1,
        "shard_tokens": 3000,
        "tokenizer_file": tokenizer_file,
    }
    return PrepareSettings(**{**values, **changes})


def test_worker_processes_write_the_shards_and_index_of_one_process(tmp_path, tokenizer_file):
    source = write_corpus(tmp_path / "corpus")
    one = prepare_corpus(source, tmp_path / "one", settings(tokenizer_file), workers=0)
    two = prepare_corpus(source, tmp_path / "two", settings(tokenizer_file), workers=2)
    assert len(one.written) > 2
    names = sorted(path.name for path in (tmp_path / "one").glob("*.bin"))
    assert names == sorted(path.name for path in (tmp_path / "two").glob("*.bin"))
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert one.index["splits"] == two.index["splits"]


def test_the_pool_answers_in_order_and_names_a_dead_worker(tokenizer_file, monkeypatch):
    from tokenizers import Tokenizer

    started = []

    class RecordedPopen(subprocess.Popen):
        """A ``Popen`` that keeps every process it starts (the pool's workers), to kill one."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", RecordedPopen)
    reference = Tokenizer.from_file(str(tokenizer_file))
    batches = [(number, [f"def f{number}(x):", "return x " * number or "x"]) for number in range(9)]
    with EncodePool(tokenizer_file, np.dtype("<u2"), workers=2) as pool:
        for (tag, ids), (want_tag, texts) in zip(pool.encode(batches), batches, strict=True):
            assert tag == want_tag
            assert [list(each) for each in ids] == [reference.encode(text).ids for text in texts]
        assert len(started) == 2
        started[0].kill()
        with pytest.raises(RuntimeError, match="a tokenizing worker process ended with status"):
            list(pool.encode(batches))
        with pytest.raises(ValueError, match="at least one text"):
            list(pool.encode([("empty", [])]))
    with pytest.raises(ValueError, match="workers must be"):
        EncodePool(tokenizer_file, np.dtype("<u2"), workers=-1)


def _traced_peak(run):
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_preparations_memory_does_not_grow_with_the_corpus(tmp_path, tokenizer_file, monkeypatch):
    monkeypatch.setattr(prepare_module, "WORKER_BATCH", (32, 16 * 2**10))
    small = write_corpus(tmp_path / "small", files=1, lines=300, seed=1)
    large = write_corpus(tmp_path / "large", files=4, lines=1200, seed=2)
    peaks = {}
    for name, source in (("small", small), ("large", large)):
        out = tmp_path / f"{name}-prepared"
        peaks[name] = _traced_peak(
            lambda source=source, out=out: prepare_corpus(source, out, settings(tokenizer_file), workers=2)
        )
    corpus_bytes = sum(path.stat().st_size for path in large.glob("*.jsonl"))
    assert corpus_bytes > 16 * peaks["small"] / 10, "the large corpus must dwarf the small run's peak"
    # the index grows by one entry per shard; the batches, the shard being written and the reader do not
    assert peaks["large"] < 1.5 * peaks["small"] + 200_000, peaks


def test_training_reads_stay_memory_mapped_and_bounded(tmp_path, tokenizer_file):
    source = write_corpus(tmp_path / "corpus", files=3, lines=1500, words=(20, 120))
    out = tmp_path / "prepared"
    prepare_corpus(source, out, settings(tokenizer_file, shard_tokens=100_000), workers=0)
    data = build_prepared_lm_data(out, cache_dir=tmp_path / "cache", seq_len=32, max_validation_blocks=8)
    for split in (data.train, data.validation):
        assert split.shards and all(
            isinstance(shard, np.memmap) and shard.mode == "r" for shard in split.shards
        )
        assert all(Path(shard.filename).parent == out.resolve() for shard in split.shards)
    stream_bytes = data.train.stream_tokens * 2
    batches = EpochData(data.train, batch_size=8, shuffle=True, drop_last=True, seed=0)
    seen = []

    def one_pass():
        for batch in batches.epoch(0):
            seen.append(int(batch[:, 0].sum()))

    peak = _traced_peak(one_pass)
    assert len(seen) == len(data.train) // 8 and stream_bytes > 400_000
    # one pass reads every block; the heap holds the epoch's order (8 bytes a block) and one batch, not the
    # stream
    assert peak < 8 * len(data.train) + 64_000 < stream_bytes, (peak, stream_bytes)


def test_phases_are_one_line_each_off_a_terminal(tmp_path):
    source = write_corpus(tmp_path / "corpus", files=1, lines=200)
    lines = []
    progress = Progress(bar=False, write=lines.append)
    prepare_corpus(
        source, tmp_path / "out", PrepareSettings(vocab_size=300, shard_tokens=3000), progress=progress
    )
    phases = [line for line in lines if not line.startswith(("train-", "validation-"))]
    assert [line.split(":")[0] for line in phases] == [
        "reading the tokenizer's sample",
        "training the tokenizer",
        "encoding",
    ]
    size = (source / "part0.jsonl").stat().st_size
    reading = phases[0]
    assert f"{size / 1000:.1f} kB in " in reading and reading.endswith("/s)"), reading
    assert len([line for line in lines if line.startswith("train-")]) >= 1


LM = {"seq_len": 32, "vocab_size": 300, "max_bytes": 100_000, "validation_fraction": 0.1}


def test_the_embedded_lm_corpus_gives_the_in_memory_blocks_and_identity(tmp_path):
    cache = tmp_path / "cache"
    memory = build_lm_data(None, cache_dir=cache, max_validation_blocks=16, **LM)
    prepared = build_embedded_lm_data(cache_dir=cache, max_validation_blocks=16, **LM)
    assert prepared.info["prepared"]["prepared_now"] and prepared.info["tokenizer_cached"]
    assert (
        len(prepared.train) == len(memory.train) and len(prepared.validation) == len(memory.validation) == 16
    )
    assert torch.equal(
        torch.stack([prepared.train[i] for i in range(len(prepared.train))]), memory.train.tokens.long()
    )
    assert torch.equal(
        torch.stack([prepared.validation[i] for i in range(16)]), memory.validation.tokens.long()
    )
    expected = {key: value for key, value in memory.info.items() if key != "tokenizer_cached"}
    assert {key: prepared.info[key] for key in expected} == expected
    again = build_embedded_lm_data(cache_dir=cache, max_validation_blocks=16, **LM)
    assert not again.info["prepared"]["prepared_now"] and again.info["identity"] == memory.info["identity"]


def test_a_damaged_embedded_entry_is_prepared_again(tmp_path):
    cache = tmp_path / "cache"
    first = build_embedded_lm_data(cache_dir=cache, **LM)
    folder = first.info["prepared"]["folder"]
    blocks = torch.stack([first.train[i] for i in range(len(first.train))])  # before the shard changes
    shard = sorted((tmp_path / "cache").glob("lm-prepared-*/train-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="is damaged and is prepared again"):
        again = build_embedded_lm_data(cache_dir=cache, **LM)
    assert again.info["prepared"]["folder"] == folder and again.info["prepared"]["prepared_now"]
    assert torch.equal(torch.stack([again.train[i] for i in range(len(again.train))]), blocks)


def test_the_embedded_mlm_corpus_gives_the_in_memory_blocks_and_masks(tmp_path):
    cache = tmp_path / "cache"
    options = {"seq_len": 32, "vocab_size": 300, "max_bytes": 400_000, "validation_fraction": 0.3}
    memory = build_code_data(None, cache_dir=cache, **options)
    prepared = build_embedded_code_data(cache_dir=cache, **options)
    for split in ("train", "validation"):
        want, got = getattr(memory, split), getattr(prepared, split)
        assert len(got) == len(want) > 1
        for index in range(len(want)):
            assert torch.equal(got[index]["input_ids"], want[index]["input_ids"]), (split, index)
            assert got[index]["length"] == want[index]["length"] and got[index]["index"] == index
        masked_want = memory.collator([want[i] for i in range(len(want))])
        masked_got = prepared.collator([got[i] for i in range(len(got))])
        assert all(torch.equal(masked_got[key], masked_want[key]) for key in masked_want), split
    expected = {key: value for key, value in memory.info.items() if key != "tokenizer_cached"}
    assert {key: prepared.info[key] for key in expected} == expected
