"""The language-model workload's data: reading, the split by file, packing, the fixed validation set."""

import gzip
import json
import subprocess
import sys

import pytest
import torch

from comera.data.bpe import SpecialIds
from comera.data.sources import split_of
from comera.workloads.llm.data import (
    TOPICS_KEY,
    build_lm_data,
    pack_stream,
    read_lm_documents,
    topic_documents,
)

IDS = SpecialIds(bos=0, pad=1, eos=2, unk=3, mask=4, vocab_size=50)
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


def _text(seed: int, words: int = 120) -> str:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (words,), generator=generator).tolist()
    return " ".join(WORDS[index] for index in picks) + ".\n"


@pytest.fixture
def corpus(tmp_path):
    """A folder of 30 ``.txt`` files (one in a subfolder), one ``.jsonl`` and one ``.jsonl.gz`` file."""
    folder = tmp_path / "corpus"
    (folder / "more").mkdir(parents=True)
    for index in range(30):
        (folder / ("more" if index == 0 else "") / f"doc{index}.txt").write_text(_text(index))
    records = [{"text": _text(100 + index), "url": f"u{index}"} for index in range(8)]
    (folder / "c4.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    with gzip.open(folder / "c4-2.jsonl.gz", "wt") as file:
        file.write(json.dumps({"text": _text(200)}) + "\n")
    (folder / "ignored.md").write_text("not a document")
    return folder


def test_pack_stream_blocks_concatenate_to_the_token_stream():
    documents = [[10, 11, 12], [], [13], [14, 15, 16, 17, 18]]
    stream = [10, 11, 12, 2, 13, 2, 14, 15, 16, 17, 18, 2]  # </s> after each non-empty document
    dropped = pack_stream(documents, 5, IDS, tail="drop")
    assert dropped.tokens.tolist() == [stream[0:5], stream[5:10]]
    assert dropped.dropped_tokens == 2 and dropped.targets == 2 * 4
    padded = pack_stream(documents, 5, IDS, tail="pad")
    assert padded.tokens.flatten().tolist() == stream + [1, 1, 1]
    assert padded.targets == 4 + 4 + 1  # the last block predicts one real token; pads are no target
    assert padded[2].dtype == torch.int64 and padded[2].tolist() == [18, 2, 1, 1, 1]
    assert pack_stream(documents, 5, IDS, tail="pad", max_blocks=1).tokens.tolist() == [stream[0:5]]


def test_kept_blocks_are_spread_evenly_over_the_stream():
    documents = [list(range(10 + 7 * d, 17 + 7 * d)) for d in range(10)]  # 10 documents of 7 ids + </s>
    every = pack_stream(documents, 4, IDS, tail="drop")  # 80 ids: 20 blocks, two per document
    for count in (1, 3, 7, 19):
        kept = pack_stream(documents, 4, IDS, tail="drop", max_blocks=count)
        wanted = [(i * 20) // count for i in range(count)]
        assert kept.tokens.tolist() == every.tokens[wanted].tolist()
        assert len(set(wanted)) == count and wanted[0] == 0
        assert kept.targets == count * 3
    three = pack_stream(documents, 4, IDS, tail="drop", max_blocks=3).tokens
    assert {int(block[0]) for block in three} == {10, 31, 56}  # from documents 0, 3 and 6, not 0 and 1 only
    assert torch.equal(pack_stream(documents, 4, IDS, tail="drop", max_blocks=20).tokens, every.tokens)
    assert torch.equal(pack_stream(documents, 4, IDS, tail="drop", max_blocks=50).tokens, every.tokens)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_len": 1, "tail": "drop"}, "seq_len must be an int >= 2"),
        ({"seq_len": 4, "tail": "wrap"}, r"tail must be one of \('drop', 'pad'\)"),
        ({"seq_len": 4, "tail": "pad", "max_blocks": 0}, "max_blocks must be an int >= 1 or None"),
    ],
)
def test_pack_stream_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pack_stream([[5, 6]], ids=IDS, **kwargs)


def test_folder_reading_takes_txt_files_and_jsonl_text_fields(corpus):
    documents, skipped = read_lm_documents(corpus)
    keys = {document.key for document in documents}
    assert {f"doc{index}.txt" for index in range(1, 30)} | {"more/doc0.txt"} <= keys
    assert {f"c4.jsonl:{line}" for line in range(1, 9)} | {"c4-2.jsonl.gz:1"} <= keys
    assert len(documents) == 39 and skipped == []
    texts = {document.key: document.text for document in documents}
    assert texts["c4.jsonl:3"] == _text(102) and texts["doc7.txt"] == _text(7)


def test_a_jsonl_line_without_text_is_named(corpus):
    (corpus / "bad.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: expected a JSON object with a string field"):
        read_lm_documents(corpus)


def test_bad_data_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data .*missing: no such file or folder"):
        read_lm_documents(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(ValueError, match=r"--data .*empty: no document found .*\.txt files or \.jsonl"):
        read_lm_documents(tmp_path / "empty")


def test_a_saved_dataset_without_the_datasets_package_names_it(tmp_path, monkeypatch):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ImportError, match="needs the 'datasets' package, which is not installed"):
        read_lm_documents(saved)


def test_the_default_corpus_is_the_standard_library_and_its_topics():
    documents, _ = read_lm_documents(None, max_bytes=100_000)
    keys = [document.key for document in documents]
    topics = [key for key in keys if key.startswith(TOPICS_KEY + "/")]
    assert len(topics) == len(topic_documents()) > 50
    assert f"{TOPICS_KEY}.py" not in keys  # the file holding the topics is not read as a source too
    assert any(key.endswith(".py") for key in keys)
    assert len(set(keys)) == len(keys)


def _build(path, cache, **changes):
    settings = {"seq_len": 16, "vocab_size": 300, "validation_fraction": 0.2, **changes}
    return build_lm_data(path, cache_dir=cache, **settings)


def test_the_split_is_by_file_and_leak_free(corpus, tmp_path):
    data = _build(corpus, tmp_path / "cache")
    documents, _ = read_lm_documents(corpus)
    by_split = {"train": set(), "validation": set()}
    for document in documents:
        by_split[split_of(document.key, 0.2)].add(document.key)
    assert by_split["train"] and by_split["validation"]
    assert not by_split["train"] & by_split["validation"]
    assert data.info["train"]["read"] == len(by_split["train"])
    assert data.info["validation"]["read"] == len(by_split["validation"])
    # the training stream is made of the training files alone, in key order
    stream = []
    for document in sorted(documents, key=lambda document: document.key):
        if document.key in by_split["train"]:
            stream += data.tokenizer.encode(document.text, add_special_tokens=False).ids + [data.ids.eos]
    flat = data.train.tokens.flatten().tolist()
    assert flat == stream[: len(flat)] and len(stream) - len(flat) == data.train.dropped_tokens < 16


def test_the_packed_splits_are_the_tokenized_documents_in_key_order(corpus, tmp_path):
    data = _build(corpus, tmp_path / "cache")
    documents, _ = read_lm_documents(corpus)
    validation = sorted((d for d in documents if split_of(d.key, 0.2) == "validation"), key=lambda d: d.key)
    stream = []
    for document in validation:
        stream += data.tokenizer.encode(document.text, add_special_tokens=False).ids + [data.ids.eos]
    flat = data.validation.tokens.flatten().tolist()
    assert flat[: len(stream)] == stream and set(flat[len(stream) :]) <= {data.ids.pad}
    assert data.info["validation_tokens"] == data.validation.targets
    assert data.info["validation"]["tokens"] == data.info["validation"]["stream_tokens"] == len(stream)
    assert data.info["identity"]["tokenizer"] and data.tokenizer_path.is_file()


def test_validation_is_fixed_across_builds_and_processes(corpus, tmp_path):
    cache = tmp_path / "cache"
    first = _build(corpus, cache)
    again = _build(corpus, cache, max_validation_blocks=None)
    assert torch.equal(first.validation.tokens, again.validation.tokens)
    script = (
        "import sys, torch\n"
        "from comera.workloads.llm.data import build_lm_data\n"
        "data = build_lm_data(sys.argv[1], cache_dir=sys.argv[2], seq_len=16, vocab_size=300, "
        "validation_fraction=0.2)\n"
        "torch.save(data.validation.tokens, sys.argv[3])\n"
    )
    out = tmp_path / "validation.pt"
    subprocess.run([sys.executable, "-c", script, str(corpus), str(cache), str(out)], check=True)
    assert torch.equal(torch.load(out), first.validation.tokens)
    capped = _build(corpus, cache, max_validation_blocks=2)
    count = len(first.validation)
    assert count > 2
    assert torch.equal(capped.validation.tokens, first.validation.tokens[[0, count // 2]])
    assert capped.info["identity"]["tokenizer"] == first.info["identity"]["tokenizer"]
    assert capped.info["identity"]["validation"] != first.info["identity"]["validation"]
    assert again.info["identity"] == first.info["identity"]


def test_a_split_without_documents_is_named(corpus, tmp_path):
    with pytest.raises(ValueError, match="the validation split has no documents"):
        _build(corpus / "more", tmp_path / "cache")


def test_an_empty_split_names_the_read_cap_only_when_it_was_reached(tmp_path):
    from comera.data.sources import CodeDocument, require_documents

    splits = {"train": [CodeDocument("big.txt", "x" * 10)], "validation": []}
    capped = (
        r"\(1 read from corpus, validation_fraction=0.3, reading stopped at data\.max_bytes=10\); "
        "add data, change validation_fraction or raise the cap"
    )
    with pytest.raises(ValueError, match=capped):
        require_documents(splits, "corpus", 0.3, max_bytes=10)
    not_reached = r"validation_fraction=0.3\); add data, change validation_fraction$"
    for caps in ({}, {"max_bytes": 11}, {"max_bytes": 100_000, "max_files": 1}):
        with pytest.raises(ValueError, match=not_reached):
            require_documents(splits, "corpus", 0.3, **caps)
    for name in ("a.txt", "b.txt", "c.md"):
        (tmp_path / name).write_text("text")
    with pytest.raises(ValueError, match=r"reading stopped at data\.max_files=1\); .* or raise the cap$"):
        require_documents(splits, tmp_path, 0.3, max_files=1, extensions=(".txt",))
    with pytest.raises(ValueError, match=not_reached):
        require_documents(splits, tmp_path, 0.3, max_files=2, extensions=(".txt",))
    require_documents({**splits, "validation": splits["train"]}, "corpus", 0.3, max_files=1)


def test_a_saved_dataset_is_read_whole_so_an_empty_split_blames_no_read_cap(tmp_path, monkeypatch):
    from comera.data.sources import CodeDocument
    from comera.workloads.llm import data as lm_data

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    one = ([CodeDocument("train/0", "x" * 50)], [])
    monkeypatch.setattr(lm_data, "_saved_dataset_documents", lambda path: one)
    with pytest.raises(
        ValueError, match=r"1 read from .*saved, validation_fraction=0.2\); add data, change "
    ):
        _build(saved, tmp_path / "cache", max_bytes=10, max_files=1)


def test_a_read_cap_of_zero_is_no_cap_so_a_presets_cap_can_be_lifted(corpus, tmp_path):
    """``data.max_bytes=0`` / ``data.max_files=0`` read everything, as None does (a preset's cap cannot be
    set back to None from the command line); an empty split then blames no cap."""
    from comera.data.sources import require_documents
    from comera.methods import get_method
    from comera.recipes.settings import resolve_settings
    from comera.workloads import load_recipe

    whole, _ = read_lm_documents(corpus)
    assert read_lm_documents(corpus, max_bytes=0, max_files=0)[0] == whole
    assert len(read_lm_documents(corpus, max_bytes=1)[0]) == 1
    data = _build(corpus, tmp_path / "cache", max_bytes=0, max_files=0)
    assert data.info["train"]["read"] + data.info["validation"]["read"] == len(whole) == 39
    with pytest.raises(ValueError, match=r"max_bytes must be an int >= 1, or 0 or None for no cap, got -1"):
        read_lm_documents(corpus, max_bytes=-1)
    empty = {"train": whole, "validation": []}
    with pytest.raises(ValueError, match=r"validation_fraction=0.2\); add data, change validation_fraction$"):
        require_documents(empty, corpus, 0.2, max_files=0, max_bytes=0, extensions=(".txt",))
    presets = load_recipe("llm").presets
    settings = resolve_settings(presets, "smoke", get_method("dense"), assignments=["data.max_bytes=0"])
    assert presets["smoke"]["data"]["max_bytes"] == 100_000 and settings["data"]["max_bytes"] == 0


def test_skip_bad_lines_skips_and_counts_bad_json_lines_or_they_are_named(corpus, tmp_path):
    """``data.skip_bad_lines`` (as the masked LM has): a line that is not a JSON object with a ``text`` string
    is counted as ``skipped_bad_line`` in the split its key falls in instead of stopping the run."""
    from comera.methods import get_method
    from comera.recipes.settings import resolve_settings
    from comera.workloads import load_recipe

    (corpus / "bad.jsonl").write_text('{"text": "fine words here"}\n{"content": "no text"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: expected a JSON object"):
        _build(corpus, tmp_path / "cache")
    data = _build(corpus, tmp_path / "cache", skip_bad_lines=True)
    counted = {name: data.info[name]["skipped_bad_line"] for name in ("train", "validation")}
    expected = {"train": 0, "validation": 0}
    for key in ("bad.jsonl:2", "bad.jsonl:3"):
        expected[split_of(key, 0.2)] += 1
    assert counted == expected
    assert data.info["train"]["read"] + data.info["validation"]["read"] == 40
    with pytest.raises(ValueError, match="skip_bad_lines must be true or false, got 'yes'"):
        _build(corpus, tmp_path / "cache", skip_bad_lines="yes")
    presets = load_recipe("llm").presets
    assert all(preset["data"]["skip_bad_lines"] is False for preset in presets.values())
    settings = resolve_settings(
        presets, "smoke", get_method("dense"), assignments=["data.skip_bad_lines=true"]
    )
    assert settings["data"]["skip_bad_lines"] is True


class _FakeDataset:
    """What ``_saved_dataset_documents`` reads of a ``datasets.Dataset``: ``column_names`` and a column."""

    def __init__(self, texts):
        self.texts = list(texts)
        self.column_names = ["text"]

    def __getitem__(self, column):
        assert column == "text"
        return list(self.texts)


def _saved(tmp_path, monkeypatch, splits):
    """A ``save_to_disk`` folder whose loading (by a stand-in ``datasets`` module) gives ``splits``: a
    ``DatasetDict`` of them, or the one ``Dataset`` given as ``None``'s value."""
    import types

    class DatasetDict(dict):
        pass

    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    loaded = DatasetDict({name: _FakeDataset(texts) for name, texts in splits.items()})
    if list(splits) == [None]:
        loaded = _FakeDataset(splits[None])
    module = types.ModuleType("datasets")
    module.DatasetDict = DatasetDict
    module.load_from_disk = lambda path: loaded
    monkeypatch.setitem(sys.modules, "datasets", module)
    return folder


def _validation_texts(data):
    """The validation stream's documents, decoded (``</s>`` ends each)."""
    ids = [token for token in data.validation.tokens.flatten().tolist() if token != data.ids.pad]
    documents, current = [], []
    for token in ids:
        if token == data.ids.eos:
            documents.append(data.tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    return documents


@pytest.mark.parametrize("held_out", ["validation", "test"])
def test_a_dataset_dicts_own_held_out_split_is_the_validation_split(tmp_path, monkeypatch, held_out):
    """Every document of the dict's ``validation`` (else ``test``) split, and no other, is validation; the
    training split is the ``train`` split whole (no held-out document is trained on)."""
    train = [_text(300 + index) for index in range(30)]
    held = [_text(400 + index) for index in range(4)]
    saved = _saved(tmp_path, monkeypatch, {"train": train, held_out: held})
    data = _build(saved, tmp_path / "cache", validation_fraction=0.5)
    assert data.info["train"]["read"] == 30 and data.info["validation"]["read"] == 4
    keys = sorted(f"{held_out}/{index}" for index in range(4))  # the stream is in key order
    assert _validation_texts(data) == [held[int(key.partition("/")[2])] for key in keys]


def test_a_test_split_beside_a_validation_split_is_left_out_and_a_plain_dataset_is_split_by_hash(
    tmp_path, monkeypatch
):
    train = [_text(500 + index) for index in range(20)]
    validation = [_text(600 + index) for index in range(3)]
    test = [_text(700 + index) for index in range(5)]
    saved = _saved(tmp_path, monkeypatch, {"train": train, "validation": validation, "test": test})
    data = _build(saved, tmp_path / "cache")
    assert data.info["train"]["read"] == 20 and data.info["validation"]["read"] == 3
    assert not set(_validation_texts(data)) & set(test)
    (tmp_path / "single").mkdir()
    single = _saved(tmp_path / "single", monkeypatch, {None: train})
    data = _build(single, tmp_path / "cache")
    in_validation = sum(split_of(f"data/{index}", 0.2) == "validation" for index in range(20))
    assert data.info["validation"]["read"] == in_validation
    assert data.info["train"]["read"] == 20 - in_validation
