"""``comera train mlm --data RAW``: the folder is prepared once into the cache and read through memory maps;
the next build reuses the entry; ``data.layout=whole`` gives the blocks the in-memory build gave."""

import json
import random
from pathlib import Path

import numpy as np

from comera.workloads.mlm.data import build_code_data
from comera.workloads.mlm.packing import ShardBlocks
from comera.workloads.mlm.prepared import build_raw_code_data

WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":"]


def write_corpus(root, seed=0):
    """Source files (``.py``) and a CodeSearchNet-style JSON-lines file."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(12):
        (root / f"module{number}.py").write_text(" ".join(rng.choice(WORDS) for _ in range(120)))
    with (root / "functions.jsonl").open("w") as file:
        for number in range(40):
            code = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            file.write(json.dumps({"repo": "r", "path": f"f{number}.py", "code": code}) + "\n")
    return root


SETTINGS = {"seq_len": 16, "vocab_size": 300, "validation_fraction": 0.2}


def test_a_raw_folder_is_prepared_once_and_read_through_memory_maps(tmp_path):
    data = write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    first = build_raw_code_data(data, cache_dir=cache, **SETTINGS)
    folder = Path(first.info["prepared"]["folder"])
    assert folder.parent == cache and folder.name.startswith("code-data-")
    assert first.info["prepared"]["prepared_now"] is True
    assert isinstance(first.train, ShardBlocks)
    assert all(isinstance(shard, np.memmap) for shard in first.train.blocks.shards)
    index = json.loads((folder / "index.json").read_text())
    assert index["splits"]["train"]["documents"] + index["splits"]["validation"]["documents"] == 52
    times = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    second = build_raw_code_data(data, cache_dir=cache, **SETTINGS)
    assert second.info["prepared"]["prepared_now"] is False
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == times
    assert [second.train[i]["input_ids"].tolist() for i in range(len(second.train))] == [
        first.train[i]["input_ids"].tolist() for i in range(len(first.train))
    ]


def test_the_whole_layout_gives_the_in_memory_blocks(tmp_path):
    data = write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    memory = build_code_data(data, cache_dir=cache, **SETTINGS)
    mapped = build_raw_code_data(data, cache_dir=cache, layout="whole", **SETTINGS)
    assert mapped.info["identity"] == memory.info["identity"]
    for split in ("train", "validation"):
        want, got = getattr(memory, split), getattr(mapped, split)
        assert len(got) == len(want) > 0
        assert all(got[i]["input_ids"].tolist() == want[i]["input_ids"].tolist() for i in range(len(want)))
        assert mapped.info[split] == memory.info[split]
