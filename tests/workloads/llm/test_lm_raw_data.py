"""``comera train llm --data RAW`` (text files that ``comera prepare`` has not seen): prepared once into the
cache, reused by the next run without encoding, trained on through memory maps; a run folder from
before (its ``--data`` read whole into memory) resumes over the same tokens."""

import fcntl
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from comera.cli import main
from comera.data.bpe import special_ids
from comera.data.cached_preparation import cache_key
from comera.data.corpus import SkipLog, corpus_files, read_corpus
from comera.data.prepare import PrepareSettings
from comera.data.sources import split_of
from comera.data.token_blocks import TokenBlocks
from comera.workloads.llm.data import build_lm_data
from comera.workloads.llm.prepared import build_raw_lm_data
from comera.workloads.llm.recipe import LLMRecipe


def _train(data, out, cache, *extra, resume=False):
    arguments = ["train", "llm", "--method", "dense", "--preset", "smoke", "--data", str(data)]
    arguments += ["--out", str(out), "--cache", str(cache), "--no-progress", *(["--resume"] * resume)]
    for assignment in ["train.early=6", "train.late=2", "train.plot=false", *extra]:
        arguments += ["--set", assignment]
    return main(arguments)


def _entry_files(folder):
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}


def test_a_raw_folder_is_prepared_once_into_the_cache_and_trained_on_through_memory_maps(
    tmp_path, monkeypatch, write_corpus
):
    data = write_corpus(tmp_path / "corpus", notes=True)
    cache = tmp_path / "cache"
    built, reads = [], []
    build_data, block = LLMRecipe.build_data, TokenBlocks.block

    def recorded_build(self, *args):
        built.append(build_data(self, *args))
        return built[-1]

    def recorded_block(self, number):
        reads.append((self, int(number)))
        return block(self, number)

    monkeypatch.setattr(LLMRecipe, "build_data", recorded_build)
    monkeypatch.setattr(TokenBlocks, "block", recorded_block)
    assert _train(data, tmp_path / "first", cache) == 0
    first = json.loads((tmp_path / "first" / "results.json").read_text())["data"]
    folder = cache / os.path.basename(first["prepared"]["folder"])
    assert folder.name.startswith("lm-data-") and first["prepared"]["prepared_now"] is True
    assert first["prepared"]["from_data"] == str(data.resolve())
    train = built[0].train
    assert isinstance(train, TokenBlocks) and all(isinstance(s, np.memmap) for s in train.shards)
    assert any(dataset is train for dataset, _ in reads)  # the training batches were read from the maps

    # the stream is the documents of the corpus in reading order, encoded one at a time with the tokenizer
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = special_ids(tokenizer).eos
    documents = read_corpus(data, corpus_files(data), SkipLog())
    stream = [
        token
        for document in documents
        if split_of(document.key, 0.1) == "train"
        for token in [*tokenizer.encode(document.text).ids, eos]
    ]
    assert np.concatenate(train.shards).tolist() == stream

    before = _entry_files(folder)
    assert _train(data, tmp_path / "second", cache) == 0
    second = json.loads((tmp_path / "second" / "results.json").read_text())["data"]
    assert second["prepared"]["prepared_now"] is False and second["prepared"]["folder"] == str(folder)
    assert _entry_files(folder) == before  # nothing written again: no shard, no index, no tokenizer
    assert second["identity"] == first["identity"]
    assert sorted(path.name for path in cache.glob("lm-data-*") if path.is_dir()) == [folder.name]

    # a file edited (its size and time change) or a setting that changes the tokens: another entry
    with (data / "part0.jsonl").open("a") as file:
        file.write(json.dumps({"text": "return x"}) + "\n")
    assert _train(data, tmp_path / "third", cache, "data.vocab_size=320") == 0
    third = json.loads((tmp_path / "third" / "results.json").read_text())["data"]
    assert third["prepared"]["prepared_now"] is True and third["prepared"]["folder"] != str(folder)


def test_a_damaged_or_unfinished_cache_entry_is_prepared_again_to_the_same_shards(tmp_path, write_corpus):
    data = write_corpus(tmp_path / "corpus", notes=True)
    settings = {"cache_dir": tmp_path / "cache", "seq_len": 16, "vocab_size": 300, "validation_fraction": 0.1}
    clean = build_raw_lm_data(data, **settings)
    folder = Path(clean.info["prepared"]["folder"])
    shard = folder / "train-00000.bin"
    want = shard.read_bytes()
    damaged = bytearray(want)
    damaged[7] ^= 0x01
    shard.write_bytes(bytes(damaged))
    with pytest.warns(RuntimeWarning, match="is prepared again from --data .*SHA-256 differs"):
        again = build_raw_lm_data(data, **settings)
    assert again.info["prepared"]["prepared_now"] is True and shard.read_bytes() == want
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps({**index, "complete": False}))
    with pytest.warns(RuntimeWarning, match="did not finish"):
        finished = build_raw_lm_data(data, **settings)
    assert json.loads((folder / "index.json").read_text())["complete"] is True
    assert finished.info["identity"] == clean.info["identity"]


def test_the_read_caps_apply_to_a_raw_corpus(tmp_path, write_corpus):
    data = write_corpus(tmp_path / "corpus", files=4, notes=True)
    settings = {"cache_dir": tmp_path / "cache", "seq_len": 16, "vocab_size": 300, "validation_fraction": 0.1}
    whole = build_raw_lm_data(data, **settings)
    capped = build_raw_lm_data(data, max_files=2, **settings)
    index = json.loads((Path(capped.info["prepared"]["folder"]) / "index.json").read_text())
    assert [entry["name"] for entry in index["source"]["files"]] == [
        path.name for path in corpus_files(data)[:2]
    ]
    read = capped.info["train"]["read"] + capped.info["validation"]["read"]
    assert 0 < read < whole.info["train"]["read"] + whole.info["validation"]["read"]
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1, or 0 or None"):
        build_raw_lm_data(data, max_bytes=-1, **settings)
    with pytest.raises(ValueError, match="layout must be one of"):
        build_raw_lm_data(data, layout="lines", **settings)


def test_the_whole_layout_gives_the_in_memory_blocks(tmp_path, write_corpus):
    data = write_corpus(tmp_path / "corpus", notes=True)
    cache = tmp_path / "cache"
    settings = {"seq_len": 16, "vocab_size": 300, "validation_fraction": 0.1, "max_validation_blocks": 7}
    memory = build_lm_data(data, cache_dir=cache, **settings)
    mapped = build_raw_lm_data(data, cache_dir=cache, layout="whole", **settings)
    assert mapped.info["identity"] == memory.info["identity"]
    assert [mapped.train[i].tolist() for i in range(len(mapped.train))] == memory.train.tokens.tolist()
    assert [mapped.validation[i].tolist() for i in range(7)] == memory.validation.tokens.tolist()
    for split in ("train", "validation"):
        assert mapped.info[split] == memory.info[split]


def test_a_second_process_waits_for_the_entry_being_prepared_then_reads_it(tmp_path, write_corpus):
    data = write_corpus(tmp_path / "corpus", notes=True)
    cache = tmp_path / "cache"
    settings = {"cache_dir": cache, "seq_len": 16, "vocab_size": 300, "validation_fraction": 0.1}
    key = cache_key(data, PrepareSettings(vocab_size=300, validation_fraction=0.1), None, None)
    cache.mkdir()
    built = []
    with (cache / f"lm-data-{key}.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a run preparing the entry holds it
        waiting = threading.Thread(target=lambda: built.append(build_raw_lm_data(data, **settings)))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not (cache / f"lm-data-{key}").exists()
        fcntl.flock(held, fcntl.LOCK_UN)
    waiting.join(timeout=60)
    assert built and built[0].info["prepared"]["folder"] == str(cache / f"lm-data-{key}")
