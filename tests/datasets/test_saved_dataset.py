"""A ``datasets.save_to_disk`` folder as ``--data``: its ``text`` column streamed through pyarrow's memory
maps into token shards, a ``DatasetDict``'s own validation split kept (and written in the index), the same
documents as ``datasets.load_from_disk`` gives, and ``comera train llm`` on it."""

import json
import random
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from comera.cli import main
from comera.data.bpe import special_ids
from comera.data.prepare import PrepareSettings, prepare_corpus
from comera.data.saved_dataset import saved_dataset_documents
from comera.data.sources import split_of
from comera.workloads.llm.data import read_lm_documents

datasets = pytest.importorskip("datasets")  # it writes the folders; comera reads them with pyarrow alone
pytest.importorskip("pyarrow")

WORDS = ["def", "return", "class", "self", "import", "for", "in", "if", "else", "x", "y", "(", ")", ":"]


def _texts(count, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) for _ in range(count)]


def _dataset(texts):
    return datasets.Dataset.from_dict({"text": texts, "number": list(range(len(texts)))})


def _stream(folder, split, index):
    return np.concatenate(
        [
            np.fromfile(folder / entry["name"], dtype=index["dtype"])
            for entry in index["splits"][split]["shards"]
        ]
    ).tolist()


def test_a_dataset_dict_keeps_its_own_validation_split_and_leaves_its_test_split_out(tmp_path):
    train, validation, test = _texts(300, 0), _texts(40, 1), _texts(30, 2)
    train[5] = "   "  # a blank text is skipped and counted
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": _dataset(train), "validation": _dataset(validation), "test": _dataset(test)}
    ).save_to_disk(str(saved), max_shard_size="4KB")  # several Arrow files per split
    assert len(list((saved / "train").glob("*.arrow"))) > 1
    out = tmp_path / "prepared"
    settings = PrepareSettings(vocab_size=300, validation_fraction=0.5, shard_tokens=500)
    index = prepare_corpus(saved, out, settings, workers=0).index
    assert index["source"]["held_out_split"] == "validation"
    assert "own 'validation' split is the validation split" in index["split_rule"]
    assert index["splits"]["train"]["documents"] == 299 and index["splits"]["validation"]["documents"] == 40
    assert index["skipped"]["by_reason"] == {"empty": 1, "held_out": 30}
    assert index["splits"]["train"]["skipped"] == {"empty": 1}
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = special_ids(tokenizer).eos
    for split, texts in (("train", train), ("validation", validation)):
        want = [t for text in texts if text.strip() for t in [*tokenizer.encode(text).ids, eos]]
        assert _stream(out, split, index) == want


def test_a_plain_dataset_is_split_by_hash_into_the_documents_load_from_disk_gives(tmp_path):
    texts = _texts(200, 3)
    saved = tmp_path / "saved"
    _dataset(texts).save_to_disk(str(saved))
    documents, skipped = read_lm_documents(saved)  # through datasets.load_from_disk
    streamed = list(saved_dataset_documents(saved, [], ("text",)))
    assert streamed == documents and skipped == []
    out = tmp_path / "prepared"
    index = prepare_corpus(
        saved, out, PrepareSettings(vocab_size=300, validation_fraction=0.2), workers=0
    ).index
    assert index["source"]["held_out_split"] is None
    validation = [document for document in documents if split_of(document.key, 0.2) == "validation"]
    assert index["splits"]["validation"]["documents"] == len(validation) > 0
    with pytest.raises(
        ValueError, match=r"split 'data' has no 'code' column \(columns: \['text', 'number'\]\)"
    ):
        list(saved_dataset_documents(saved, [], ("code",)))


def test_comera_train_reads_a_saved_dataset_through_the_cache(tmp_path):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": _dataset(_texts(300, 4)), "test": _dataset(_texts(30, 5))}).save_to_disk(
        str(saved)
    )
    arguments = ["train", "llm", "--method", "dense", "--preset", "smoke", "--data", str(saved)]
    arguments += ["--cache", str(tmp_path / "cache"), "--no-progress"]
    for assignment in ["train.early=3", "train.late=1", "train.plot=false"]:
        arguments += ["--set", assignment]
    assert main([*arguments, "--out", str(tmp_path / "first")]) == 0
    assert main([*arguments, "--out", str(tmp_path / "second")]) == 0
    first, second = (
        json.loads((tmp_path / name / "results.json").read_text())["data"] for name in ("first", "second")
    )
    assert first["prepared"]["prepared_now"] and not second["prepared"]["prepared_now"]
    assert first["splits"]["validation"]["read"] == 30  # the test split is the validation split
    index = json.loads((tmp_path / "cache" / first["prepared"]["folder"] / "index.json").read_text())
    assert index["source"]["held_out_split"] == "test"


def test_without_pyarrow_the_error_names_the_extra(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    _dataset(_texts(10, 6)).save_to_disk(str(saved))
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"datasets.save_to_disk; reading it needs pyarrow: pip install"):
        list(saved_dataset_documents(saved, [], ("text",)))
