"""``comera.data.token_blocks``: blocks of memory-mapped shards equal the slices of the joined stream (across
shard boundaries, with a padded or dropped tail, a selection), the shards stay memory maps, and the
Trainer's data order (seeded permutation, resume position, per-rank shards) works over them; and
``comera.data.corpus_sample``'s sample is fixed by the documents, not their order."""

import random

import numpy as np
import pytest
import torch

from comera.data.corpus_sample import sample_documents, sample_hash
from comera.data.sources import CodeDocument
from comera.data.token_blocks import TokenBlocks, spread_blocks
from comera.train.data import EpochData


@pytest.fixture
def shards(tmp_path):
    """Three memory-mapped uint16 shards of 37, 0 and 50 tokens and their joined stream."""
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 65535, size=87, dtype=np.uint16)
    maps = []
    for number, (start, end) in enumerate([(0, 37), (37, 37), (37, 87)]):
        path = tmp_path / f"train-{number:05d}.bin"
        stream[start:end].tofile(path)
        maps.append(np.memmap(path, dtype=np.uint16, mode="r") if end > start else np.zeros(0, np.uint16))
    return maps, stream.astype(np.int64)


def test_blocks_are_the_slices_of_the_joined_stream(shards):
    maps, stream = shards
    blocks = TokenBlocks(maps, 10)
    assert len(blocks) == 8 and blocks.dropped_tokens == 7 and blocks.stream_tokens == 87
    for number in range(len(blocks)):
        item = blocks[number]
        assert item.dtype == torch.int64 and item.shape == (10,)
        assert item.tolist() == stream[number * 10 : (number + 1) * 10].tolist()  # block 3 spans two shards
    assert blocks[-1].tolist() == stream[70:80].tolist()
    with pytest.raises(IndexError):
        blocks[8]


def test_the_shards_stay_memory_maps_and_are_not_copied(shards):
    maps, _ = shards
    blocks = TokenBlocks(maps, 10)
    assert all(held is given for held, given in zip(blocks.shards, maps))
    assert isinstance(blocks.shards[0], np.memmap) and isinstance(blocks.shards[2], np.memmap)


def test_a_padded_tail_and_a_selection(shards):
    maps, stream = shards
    padded = TokenBlocks(maps, 10, pad_id=1)
    assert len(padded) == 9 and padded.dropped_tokens == 0
    assert padded[8].tolist() == [*stream[80:87].tolist(), 1, 1, 1]
    selection = spread_blocks(9, 4)
    assert selection.tolist() == [0, 2, 4, 6]
    chosen = TokenBlocks(maps, 10, pad_id=1, selection=selection)
    assert [chosen[i].tolist() for i in range(4)] == [padded[n].tolist() for n in (0, 2, 4, 6)]
    assert spread_blocks(9, 9) is None and spread_blocks(9, None) is None
    with pytest.raises(ValueError, match=r"block numbers in \[0, 9\)"):
        TokenBlocks(maps, 10, pad_id=1, selection=np.array([9]))


def test_the_trainers_order_resumes_and_shards_by_rank_over_the_blocks(shards):
    maps, _ = shards
    blocks = TokenBlocks(maps, 4)  # 21 blocks

    def epoch(start=0, rank=0, world_size=1):
        data = EpochData(
            blocks, batch_size=3, shuffle=True, drop_last=True, seed=5, rank=rank, world_size=world_size
        )
        return [batch.tolist() for batch in data.epoch(2, start)]

    whole = epoch()
    assert epoch(start=4) == whole[4:]
    ranks = [epoch(rank=rank, world_size=2) for rank in (0, 1)]
    seen = [tuple(row) for batches in ranks for batch in batches for row in batch]
    assert len(seen) == len(set(seen)) == 2 * 3 * 3  # 10 blocks a rank, 3 whole batches each, none shared
    assert ranks[0] != ranks[1]
    assert epoch(start=1, rank=1, world_size=2) == ranks[1][1:]


def _documents(count, seed=0):
    rng = random.Random(seed)
    return [CodeDocument(f"file{n % 7}.jsonl:{n}", "x" * rng.randint(1, 400)) for n in range(count)]


def test_the_tokenizer_sample_is_the_lowest_hashes_within_the_budget_in_any_order():
    documents = _documents(500)
    sample = sample_documents(documents, 20_000)
    shuffled = list(documents)
    random.Random(3).shuffle(shuffled)
    assert sample == sample_documents(shuffled, 20_000)
    ordered = sorted(documents, key=lambda document: sample_hash(document.key))
    prefix, held = [], 0
    for document in ordered:
        if held + len(document.text) > 20_000:
            break
        prefix.append(document)
        held += len(document.text)
    assert sample == prefix and 19_000 < held <= 20_000
    assert {document.key.split(":")[0] for document in sample} == {f"file{n}.jsonl" for n in range(7)}
    assert sample_documents(documents, 10**9) == ordered
