"""Code data for masked-LM pre-training: reading, split, tokenizer cache, packing and masking statistics."""

import gzip
import hashlib
import json
import math
import random
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from comera.data.bpe import (
    MAX_PIECE_CHARS,
    SPECIAL_TOKENS,
    SpecialIds,
    load_or_train_tokenizer,
    special_ids,
    train_tokenizer,
)
from comera.data.sources import CodeDocument, read_code, split_of
from comera.workloads.mlm.data import build_code_data
from comera.workloads.mlm.masking import MaskingCollator, mask_tokens
from comera.workloads.mlm.packing import pack_documents

DATA = Path(__file__).resolve().parents[2] / "data"
# the folder fixture's sources end in .src so that linters of this repository leave them alone
SOURCE = [".src"]
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


def _blocks(fixed: bool):
    documents = [list(range(5 + i, 5 + i + 30 + 7 * i)) for i in range(40)]
    return pack_documents(documents, 64, IDS, fixed_masking=fixed)


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


@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=12),
    seq_len=st.integers(2, 17),
    tail=st.sampled_from(["pad", "drop"]),
)
def test_packing_keeps_every_token_exactly_once(lengths, seq_len, tail):
    counter = iter(range(5, 10_000))
    documents = [[next(counter) for _ in range(length)] for length in lengths]
    stream = [token for document in documents if document for token in [*document, IDS.eos]]
    packed = pack_documents(documents, seq_len, IDS, tail=tail)
    assert packed.tokens.shape == (len(packed), seq_len)
    assert (packed.tokens[:, 0] == IDS.bos).all()
    bodies = [packed.tokens[i, 1 : int(packed.lengths[i])].tolist() for i in range(len(packed))]
    flat = [token for body in bodies for token in body]
    rest = len(stream) % (seq_len - 1)
    if tail == "pad":
        assert flat == stream
        assert packed.dropped_tokens == 0
        assert (packed.tokens[packed.tokens == IDS.pad].numel()) == (seq_len - 1 - rest if rest else 0)
    else:
        assert flat == stream[: len(stream) - rest]
        assert packed.dropped_tokens == rest
        assert (packed.lengths == seq_len).all()
    assert packed.num_tokens == len(flat) + len(packed)


def test_jsonl_and_gzip_read_the_code_or_original_string_field():
    plain, skipped = read_code(DATA / "code_jsonl" / "functions.jsonl")
    gzipped, _ = read_code(DATA / "code_jsonl_gz")
    assert skipped == []
    records = [
        json.loads(line) for line in (DATA / "code_jsonl" / "functions.jsonl").read_text().splitlines()
    ]
    assert [d.text for d in plain] == [r.get("code", r.get("original_string")) for r in records]
    assert plain[0].key == "octo/calc/calc/ops.py" == plain[1].key
    assert plain[4].key == "functions.jsonl:5"
    assert [d.text for d in gzipped] == [d.text for d in plain]


def test_folder_reads_by_extension_and_skips_files_that_are_not_utf8():
    documents, skipped = read_code(DATA / "code_folder", extensions=SOURCE)
    keys = sorted(d.key for d in documents)
    assert keys == ["main.src", "pkg/__init__.src", "pkg/sub/shapes.src", "pkg/util.src"]
    assert sorted((s.key, s.reason) for s in skipped) == [
        ("pkg/empty.src", "empty"),
        ("pkg/latin1.src", "not_utf8"),
    ]
    for document in documents:
        assert document.text == (DATA / "code_folder" / document.key).read_text(encoding="utf-8")
    shell, _ = read_code(DATA / "code_folder", extensions=[".sh"])
    assert [d.key for d in shell] == ["pkg/sub/script.sh"]
    assert read_code(DATA / "code_folder") == ([], [])


def test_unreadable_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "good.py").write_text("def f(x):\n    return x\n")
    (tmp_path / "self.py").symlink_to("self.py")
    (tmp_path / "loop.jsonl").symlink_to("loop.jsonl")
    documents, skipped = read_code(tmp_path)
    assert [d.key for d in documents] == ["good.py"]
    assert sorted((s.key, s.reason) for s in skipped) == [
        ("loop.jsonl", "unreadable"),
        ("self.py", "unreadable"),
    ]


def test_a_truncated_gzip_file_is_named_with_the_last_line_read(tmp_path):
    lines = b"".join(
        json.dumps({"code": f"def f{i}(x):\n    return {i}\n"}).encode() + b"\n" for i in range(400)
    )
    packed = gzip.compress(lines)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(
        ValueError, match=r"cut\.jsonl\.gz: the compressed data is truncated or corrupt \(after line \d+\)"
    ):
        read_code(path)


def test_a_gzip_file_is_read_by_its_content_whatever_its_name(tmp_path):
    path = tmp_path / "functions.jsonl"
    path.write_bytes((DATA / "code_jsonl_gz" / "functions.jsonl.gz").read_bytes())
    plain, _ = read_code(DATA / "code_jsonl" / "functions.jsonl")
    assert [d.text for d in read_code(path)[0]] == [d.text for d in plain]


def test_a_corrupt_tokenizer_file_is_named(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ')
    with pytest.raises(
        ValueError, match=r"tokenizer_file .*tokenizer\.json: not a tokenizers tokenizer\.json"
    ):
        load_or_train_tokenizer([], 300, tmp_path, tokenizer_file=path)


def test_a_bad_json_line_raises_naming_file_and_line_or_is_skipped_and_counted():
    path = DATA / "code_bad_line" / "broken.jsonl"
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 3: not valid JSON"):
        read_code(path)
    documents, skipped = read_code(path, skip_bad_lines=True)
    assert len(documents) == 3
    assert [(s.key, s.reason) for s in skipped] == [
        ("broken.jsonl:3", "bad_line"),
        ("broken.jsonl:5", "bad_line"),
    ]


def test_caps_take_a_fixed_sample():
    first, _ = read_code(DATA / "code_folder", extensions=SOURCE, max_files=3)
    second, _ = read_code(DATA / "code_folder", extensions=SOURCE, max_files=3)
    assert [d.key for d in first] == [d.key for d in second]
    capped, _ = read_code(DATA / "code_folder", extensions=SOURCE, max_bytes=1)
    assert len(capped) == 1


def test_default_source_is_the_standard_library():
    documents, _ = read_code(None, max_files=4)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert 1 <= len(documents) <= 4
    for document in documents:
        assert document.key.endswith(".py") and "site-packages" not in document.key
        assert (stdlib / document.key).read_text(encoding="utf-8") == document.text


def test_split_is_a_fixed_function_of_the_key():
    keys = [f"pkg{i % 17}/module_{i}.py" for i in range(20_000)]
    expected = [
        int.from_bytes(hashlib.sha256(f"split\x1f{key}".encode()).digest()[:8], "big") / 2**64 < 0.05
        for key in keys
    ]
    assert [split_of(key, 0.05) == "validation" for key in keys] == expected
    assert _within_binomial(sum(expected), len(keys), 0.05)
    shuffled = keys[:]
    random.Random(0).shuffle(shuffled)
    assert {k for k in shuffled if split_of(k, 0.05) == "validation"} == {
        k for k, e in zip(keys, expected) if e
    }


def _documents() -> list[CodeDocument]:
    documents, _ = read_code(DATA / "code_folder", extensions=SOURCE)
    return documents


def test_tokenizer_is_cached_and_reused(tmp_path):
    documents = _documents()
    first, path, cached = load_or_train_tokenizer(documents, 300, tmp_path)
    assert not cached and path.parent == tmp_path and path.is_file()
    second, same_path, cached = load_or_train_tokenizer(list(reversed(documents)), 300, tmp_path)
    assert cached and same_path == path
    assert second.to_str() == first.to_str()
    _, other_path, cached = load_or_train_tokenizer(documents[:-1], 300, tmp_path)
    assert not cached and other_path != path
    given_tokenizer, given_path, cached = load_or_train_tokenizer(
        [], 999, tmp_path / "unused", tokenizer_file=path
    )
    assert cached and given_path == path and given_tokenizer.to_str() == first.to_str()
    ids = special_ids(first)
    assert (ids.bos, ids.pad, ids.eos, ids.unk, ids.mask) == (0, 1, 2, 3, 4)
    for document in documents:
        encoding = first.encode(document.text, add_special_tokens=False)
        assert first.decode(encoding.ids, skip_special_tokens=False) == document.text


def test_long_pieces_are_cut_and_the_rest_is_pre_tokenised_as_gpt2_does():
    documents = _documents()
    draw = random.Random(0)
    blob = "".join(draw.choice("abcdefgh") for _ in range(3 * MAX_PIECE_CHARS + 17))
    tokenizer = train_tokenizer([*(document.text for document in documents), f"x = '{blob}'\n"], 300)
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(f"y={blob} z")]
    assert max(map(len, pieces)) == MAX_PIECE_CHARS
    assert "".join(pieces) == f"y={blob}Ġz"
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for document in documents:
        assert tokenizer.pre_tokenizer.pre_tokenize_str(document.text) == gpt2.pre_tokenize_str(document.text)
    encoding = tokenizer.encode(blob, add_special_tokens=False)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == blob


def test_a_tokenizer_without_the_special_tokens_is_refused(tmp_path):
    path = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(path))
    with pytest.raises(ValueError, match="lacks the special token"):
        load_or_train_tokenizer([], 300, tmp_path, tokenizer_file=path)


def test_build_code_data_end_to_end(tmp_path):
    data = build_code_data(
        DATA / "code_jsonl", cache_dir=tmp_path, seq_len=16, vocab_size=300, validation_fraction=0.7
    )
    keys = [d.key for d in read_code(DATA / "code_jsonl")[0]]
    validation = sum(split_of(key, 0.7) == "validation" for key in keys)
    assert data.info["validation"]["read"] == validation
    assert data.info["train"]["read"] == len(keys) - validation
    assert data.validation.fixed_masking and not data.train.fixed_masking
    assert data.info["vocab_size"] == data.tokenizer.get_vocab_size() == data.ids.vocab_size
    batch = data.collator([data.train[i] for i in range(len(data.train))])
    assert batch["input_ids"].shape == (len(data.train), 16)
    again = build_code_data(
        DATA / "code_jsonl", cache_dir=tmp_path, seq_len=16, vocab_size=300, validation_fraction=0.7
    )
    assert again.info["tokenizer_cached"] and not data.info["tokenizer_cached"]
    assert torch.equal(again.train.tokens, data.train.tokens)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: read_code(DATA / "missing"), "does not exist"),
        (lambda: read_code(DATA / "code_folder", extensions="py"), "extensions must be"),
        (lambda: read_code(DATA / "code_folder", max_files=0), "max_files must be"),
        (lambda: pack_documents([[5]], 1, IDS), "seq_len must be an int >= 2"),
        (lambda: pack_documents([[5]], 4, IDS, tail="keep"), "tail must be one of"),
        (lambda: MaskingCollator(IDS, mask_probability=1.5), r"mask_probability must be a float in \(0, 1\)"),
        (
            lambda: load_or_train_tokenizer([CodeDocument("a", "x")], 100, "/tmp"),
            "vocab_size must be an int >= 262",
        ),
        (
            lambda: build_code_data(
                DATA / "code_folder", cache_dir="/tmp", seq_len=8, vocab_size=300, validation_fraction=0
            ),
            "validation_fraction",
        ),
        (
            lambda: build_code_data(
                DATA / "code_jsonl", cache_dir="/tmp", seq_len=8, vocab_size=300, validation_fraction=0.3
            ),
            "the validation split has no documents",
        ),
    ],
)
def test_bad_arguments_raise_naming_them(call, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        call()
