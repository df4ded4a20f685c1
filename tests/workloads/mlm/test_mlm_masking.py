"""Dynamic BERT masking of packed blocks: rates, uniform replacements, what is never masked, seeds."""

import math

import torch

from comera.data.bpe import SPECIAL_TOKENS, SpecialIds
from comera.workloads.mlm.masking import MaskingCollator, mask_tokens
from comera.workloads.mlm.packing import pack_documents

IDS = SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=4, vocab_size=1000)


def _within_binomial(count: int, trials: int, probability: float, sigmas: float = 5.0) -> bool:
    """Whether ``count`` is within ``sigmas`` standard deviations of Binomial(trials, probability)'s mean."""
    mean = trials * probability
    return abs(count - mean) <= sigmas * math.sqrt(trials * probability * (1 - probability))


def _token_batch(rows: int = 200, length: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ordinary tokens with <s> first, </s> sprinkled in and <pad> tails; and where masking may act."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, IDS.vocab_size, (rows, length), generator=generator)
    ids[:, 0] = IDS.bos
    ids[torch.rand(rows, length, generator=generator) < 0.02] = IDS.eos
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    padding = torch.arange(length) >= lengths[:, None]
    ids[padding] = IDS.pad
    maskable = ~padding & ~torch.isin(ids, torch.tensor(IDS.all))
    return ids, maskable


def _blocks(fixed: bool):
    documents = [list(range(5 + i, 5 + i + 30 + 7 * i)) for i in range(40)]
    return pack_documents(documents, 64, IDS, fixed_masking=fixed)


def test_masking_rates_follow_the_binomial():
    ids, maskable = _token_batch()
    masked, labels = mask_tokens(ids, maskable, IDS, torch.Generator().manual_seed(7))
    chosen = labels != -100
    candidates = int(maskable.sum())
    assert candidates > 50_000
    assert _within_binomial(int(chosen.sum()), candidates, 0.15)
    picked = int(chosen.sum())
    to_mask = int((masked[chosen] == IDS.mask).sum())
    unchanged = int((masked[chosen] == ids[chosen]).sum())
    replaced = picked - to_mask - unchanged
    ordinary = IDS.vocab_size - len(SPECIAL_TOKENS)
    # a random replacement equals the original token with probability 1 / ordinary
    assert _within_binomial(to_mask, picked, 0.8)
    assert _within_binomial(replaced, picked, 0.1 * (1 - 1 / ordinary))
    assert _within_binomial(unchanged, picked, 0.1 + 0.1 / ordinary)
    random_tokens = masked[chosen & (masked != IDS.mask) & (masked != ids)]
    assert not torch.isin(random_tokens, torch.tensor(IDS.all)).any()
    assert int(random_tokens.min()) >= 5 and int(random_tokens.max()) < IDS.vocab_size


def test_random_replacements_are_uniform_over_ordinary_tokens():
    ids = torch.full((400_000,), 10)
    small = SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=4, vocab_size=25)
    masked, labels = mask_tokens(
        ids, torch.ones_like(ids, dtype=torch.bool), small, torch.Generator().manual_seed(3)
    )
    replaced = masked[(labels != -100) & (masked != small.mask) & (masked != ids)]
    counts = torch.bincount(replaced, minlength=small.vocab_size)[5:]
    assert counts[10 - 5] == 0
    others = torch.cat([counts[: 10 - 5], counts[10 - 5 + 1 :]])
    trials = int(replaced.numel())
    for count in others.tolist():
        assert _within_binomial(count, trials, 1 / 19)


def test_special_and_padding_tokens_are_never_masked_and_labels_only_where_masked():
    ids, maskable = _token_batch()
    masked, labels = mask_tokens(ids, maskable, IDS, torch.Generator().manual_seed(11))
    chosen = labels != -100
    assert not chosen[~maskable].any()
    assert torch.equal(masked[~chosen], ids[~chosen])
    assert torch.equal(labels[chosen], ids[chosen])
    assert not torch.isin(labels[chosen], torch.tensor(IDS.all)).any()


def test_collator_masks_only_real_ordinary_tokens_and_builds_the_attention_mask():
    blocks = _blocks(fixed=False)
    samples = [blocks[i] for i in range(len(blocks))]
    batch = MaskingCollator(IDS, seed=5)(samples)
    ids = torch.stack([sample["input_ids"] for sample in samples])
    assert torch.equal(batch["attention_mask"], (ids != IDS.pad).long())
    special = torch.isin(ids, torch.tensor(IDS.all))
    assert (batch["labels"][special] == -100).all()
    chosen = batch["labels"] != -100
    assert torch.equal(batch["labels"][chosen], ids[chosen])
    assert torch.equal(batch["input_ids"][~chosen], ids[~chosen])
    assert _within_binomial(int(chosen.sum()), int((~special).sum()), 0.15)


def test_fixed_masking_depends_only_on_the_seed_and_the_block():
    blocks = _blocks(fixed=True)
    collator = MaskingCollator(IDS, seed=3)
    alone = collator([blocks[4]])
    together = collator([blocks[7], blocks[4], blocks[1]])
    collator.set_epoch(5)
    later = collator([blocks[4], blocks[2]])
    for batch, row in ((together, 1), (later, 0)):
        assert torch.equal(batch["input_ids"][row], alone["input_ids"][0])
        assert torch.equal(batch["labels"][row], alone["labels"][0])
    other_seed = MaskingCollator(IDS, seed=4)([blocks[4]])
    assert not torch.equal(other_seed["labels"], alone["labels"])


def test_training_masks_are_reproducible_and_change_with_the_batch_and_epoch():
    blocks = _blocks(fixed=False)
    batch = [blocks[i] for i in (3, 9, 0, 12)]
    first = MaskingCollator(IDS, seed=3)(batch)
    again = MaskingCollator(IDS, seed=3)(batch)
    assert all(torch.equal(first[key], again[key]) for key in first)
    reordered = MaskingCollator(IDS, seed=3)([blocks[i] for i in (9, 3, 0, 12)])
    assert not torch.equal(reordered["labels"][1], first["labels"][0])
    next_epoch = MaskingCollator(IDS, seed=3)
    next_epoch.set_epoch(1)
    assert not torch.equal(next_epoch(batch)["labels"], first["labels"])
