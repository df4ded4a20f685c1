"""The masked LM's data built end to end: read, split, tokenize, cache, pack; bad arguments named."""

from pathlib import Path

import pytest
import torch

from comera.data.bpe import SpecialIds, load_or_train_tokenizer
from comera.data.sources import CodeDocument, read_code, split_of
from comera.workloads.mlm.data import build_code_data
from comera.workloads.mlm.masking import MaskingCollator
from comera.workloads.mlm.packing import pack_documents

DATA = Path(__file__).resolve().parents[2] / "data"
IDS = SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=4, vocab_size=1000)


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
        (lambda: read_code(DATA / "code_folder", max_files=-1), "max_files must be"),
        (lambda: pack_documents([[5]], 1, IDS), "seq_len must be an int >= 2"),
        (lambda: pack_documents([[5]], 4, IDS, tail="keep"), "tail must be one of"),
        (lambda: MaskingCollator(IDS, mask_probability=1.5), r"mask_probability must be a float in \(0, 1\)"),
        (
            lambda: load_or_train_tokenizer([CodeDocument("a", "x")], 100, "/tmp"),
            r"vocab_size must be an int in \[262, 1048576\]",
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


@pytest.mark.parametrize(
    ("caps", "said"),
    [
        (
            {"max_bytes": 400_000, "max_files": 10},
            r"validation_fraction=0.3\); add data, change validation_fraction$",
        ),
        ({"max_bytes": 6}, r"reading stopped at data\.max_bytes=6\); .* or raise the cap$"),
        ({"max_files": 1}, r"reading stopped at data\.max_files=1\); .* or raise the cap$"),
    ],
)
def test_an_empty_split_blames_a_read_cap_only_when_reading_stopped_at_it(tmp_path, caps, said):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    (folder / "b.txt").write_text("not read: not a .py file\n")
    if "max_files" in caps:
        (folder / "c.py").write_text("y = 2\n")
    with pytest.raises(ValueError, match=r"split has no documents \(\d read from .*tiny, .*" + said):
        build_code_data(
            folder, cache_dir=tmp_path, seq_len=8, vocab_size=300, validation_fraction=0.3, **caps
        )


def test_a_folder_without_a_file_of_the_read_extensions_says_which_are_read(tmp_path):
    """A folder of ``.txt`` documents gives the masked-LM workload no document: the error says which
    files it reads and which setting names others, not "add data"."""
    source = tmp_path / "texts"
    source.mkdir()
    for index in range(3):
        (source / f"doc{index}.txt").write_text("def f():\n    return 1\n" * 20)
    with pytest.raises(ValueError, match=r"no document was read from .*texts: files ending in \.py are read"):
        build_code_data(source, cache_dir=tmp_path / "cache", vocab_size=300, seq_len=32)
