"""``comera.data.prepare``: the shards and index of a prepared corpus against a reference tokenization of the
same documents, a stopped or damaged preparation continued shard by shard to the result of a clean one, and
the refusals (other settings or files, an unfinished shard never left in place)."""

import gzip
import hashlib
import json
import random
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer

from comera.data import corpus as corpus_module
from comera.data.bpe import special_ids, train_tokenizer
from comera.data.prepare import PrepareSettings, prepare_corpus
from comera.data.sources import read_code, split_of
from comera.data.token_shards import INDEX_FILE, read_index, token_dtype

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "def",
    "return",
    "class",
]


def write_corpus(root, documents_per_file=120, seed=0):
    """A folder of two .jsonl files, a .jsonl.gz file and two .txt files; one bad JSON line, one empty
    text."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))

    root.mkdir(parents=True)
    for name in ("a.jsonl", "sub/b.jsonl"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"text": text()}) for _ in range(documents_per_file)]
        (root / name).write_text("\n".join(lines) + "\n")
    with gzip.open(root / "c.jsonl.gz", "wt") as file:
        for number in range(documents_per_file):
            file.write(json.dumps({"text": text() if number != 7 else "   "}) + "\n")
        file.write("{not json\n")
    (root / "d.txt").write_text(text())
    (root / "e.txt").write_text("a text file of its own\nwith two lines\n")
    return root


@pytest.fixture
def tokenizer_file(tmp_path):
    """A given tokenizer, so that two preparations encode with the same one (BPE training breaks ties in an
    order that changes between processes)."""
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(200)]
    path = tmp_path / "tokenizer.json"
    train_tokenizer(texts, 300).save(str(path))
    return path


def settings(**changes):
    values = {"vocab_size": 300, "validation_fraction": 0.2, "skip_bad_lines": True, "shard_tokens": 600}
    return PrepareSettings(**{**values, **changes})


def shard_bytes(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.bin"))}


def test_the_index_counts_equal_a_reference_tokenization_of_the_same_documents(tmp_path):
    source = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    prepare_corpus(source, out, settings())
    index = read_index(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = special_ids(tokenizer).eos
    assert index["complete"] and index["eos_id"] == eos and index["dtype"] == "uint16"
    # the reference: the project's reader of the same files, one document encoded at a time
    documents, skipped = read_code(source, extensions=(".txt",), text_fields=("text",), skip_bad_lines=True)
    streams = {"train": [], "validation": []}
    counts = {"train": 0, "validation": 0}
    for document in documents:
        split = split_of(document.key, 0.2)
        streams[split] += [*tokenizer.encode(document.text, add_special_tokens=False).ids, eos]
        counts[split] += 1
    for split in ("train", "validation"):
        facts = index["splits"][split]
        assert facts["documents"] == counts[split] > 0
        assert facts["tokens"] == len(streams[split])
        shards = facts["shards"]
        assert len(shards) > (1 if split == "train" else 0)
        joined = np.concatenate([np.fromfile(out / entry["name"], dtype=np.uint16) for entry in shards])
        assert joined.tolist() == streams[split]
        assert int((joined == eos).sum()) >= facts["documents"]
        assert sum(entry["documents"] for entry in shards) == facts["documents"]
        for before, entry in zip(shards, shards[1:]):
            assert entry["first_document"] == before["first_document"] + before["documents"]
        for entry in shards:
            data = (out / entry["name"]).read_bytes()
            assert len(data) == entry["bytes"] == 2 * entry["tokens"]
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert index["skipped"]["by_reason"] == {"bad_line": 1, "empty": 1}
    assert {(entry["key"], entry["reason"]) for entry in index["skipped"]["first"]} == {
        ("c.jsonl.gz:121", "bad_line"),
        ("c.jsonl.gz:8", "empty"),
    }
    assert len(skipped) == 2
    assert index["tokenizer"]["sha256"] == hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    assert not list(out.glob(".*"))  # no temporary file left


def test_damaged_and_missing_shards_are_redone_alone_to_the_clean_result(tmp_path):
    source = write_corpus(tmp_path / "corpus")
    clean = tmp_path / "clean"
    prepare_corpus(source, clean, settings())
    damaged = tmp_path / "damaged"
    shutil.copytree(clean, damaged)
    flipped = bytearray((damaged / "train-00001.bin").read_bytes())
    flipped[10] ^= 0xFF
    (damaged / "train-00001.bin").write_bytes(bytes(flipped))
    (damaged / "train-00003.bin").unlink()
    (damaged / "validation-00000.bin").write_bytes((damaged / "validation-00000.bin").read_bytes()[:-2])
    untouched = {path.name: path.stat().st_mtime_ns for path in damaged.glob("*.bin")}
    lines = []
    result = prepare_corpus(source, damaged, settings(), report=lines.append)
    redone = {"train-00001.bin", "train-00003.bin", "validation-00000.bin"}
    assert set(result.redone) == set(result.written) == redone
    assert "SHA-256 differs" in result.redone["train-00001.bin"]
    assert "cannot be read" in result.redone["train-00003.bin"]
    assert sorted(result.kept) == sorted(set(shard_bytes(clean)) - redone)
    for name in result.kept:
        assert (damaged / name).stat().st_mtime_ns == untouched[name], f"{name} was written again"
    assert shard_bytes(damaged) == shard_bytes(clean)
    assert json.loads((damaged / INDEX_FILE).read_text()) == json.loads((clean / INDEX_FILE).read_text())
    assert any("train-00003.bin" in line and "encoding it again" in line for line in lines)


class Stop(Exception):
    pass


def test_a_stopped_preparation_continues_shard_by_shard(tmp_path, tokenizer_file):
    source = write_corpus(tmp_path / "corpus")
    given = settings(tokenizer_file=tokenizer_file)
    clean = tmp_path / "clean"
    prepare_corpus(source, clean, given)
    stopped = tmp_path / "stopped"
    written = []

    def stop_after_three(line):
        if "written" in line:
            written.append(line.split(":")[0])
            if len(written) == 3:
                raise Stop

    with pytest.raises(Stop):
        prepare_corpus(source, stopped, given, report=stop_after_three)
    partial = read_index(stopped)
    assert not partial["complete"] and not list(stopped.glob(".*.tmp"))
    recorded = [entry["name"] for split in partial["splits"].values() for entry in split["shards"]]
    assert len(recorded) == 2  # the index is written after a shard's callback; the third is not in it
    result = prepare_corpus(source, stopped, given)
    assert sorted(result.kept) == sorted(recorded)
    assert set(result.written) == set(shard_bytes(clean)) - set(recorded)
    assert shard_bytes(stopped) == shard_bytes(clean)
    assert json.loads((stopped / INDEX_FILE).read_text()) == json.loads((clean / INDEX_FILE).read_text())


def test_a_preparation_of_other_settings_or_files_is_refused_by_name(tmp_path, tokenizer_file):
    source = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    prepare_corpus(source, out, settings(tokenizer_file=tokenizer_file))
    with pytest.raises(ValueError, match=r"other settings \(shard_tokens\)"):
        prepare_corpus(source, out, settings(tokenizer_file=tokenizer_file, shard_tokens=700))
    with (source / "d.txt").open("a") as file:
        file.write(" more")
    with pytest.raises(ValueError, match=r"other files \(d.txt: \d+ bytes then, \d+ now\)"):
        prepare_corpus(source, out, settings(tokenizer_file=tokenizer_file))


def test_a_bad_line_stops_the_preparation_naming_file_and_line_unless_skipped(tmp_path):
    source = write_corpus(tmp_path / "corpus")
    with pytest.raises(ValueError, match=r"c.jsonl.gz: line 121: not valid JSON"):
        prepare_corpus(source, tmp_path / "prepared", settings(skip_bad_lines=False))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"shard_tokens": 0}, "--shard-tokens must be"),
        ({"validation_fraction": 1.0}, r"data.validation_fraction must be a float in \(0, 1\)"),
        ({"vocab_size": 10}, "data.vocab_size must be"),
        ({"sample_bytes": 0}, "sample bytes"),
    ],
)
def test_bad_settings_are_named(tmp_path, changes, message):
    source = write_corpus(tmp_path / "corpus")
    with pytest.raises(ValueError, match=message):
        prepare_corpus(source, tmp_path / "prepared", settings(**changes))
    assert not (tmp_path / "prepared").exists()


def test_ids_are_uint16_up_to_65536_tokens_then_uint32():
    assert token_dtype(300) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_a_parquet_file_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "part.parquet").write_bytes(b"PAR1")
    real_import = corpus_module.importlib.import_module

    def no_pyarrow(name, *args):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args)

    monkeypatch.setattr(corpus_module.importlib, "import_module", no_pyarrow)
    with pytest.raises(
        ImportError, match=r"part.parquet is a Parquet file; reading it needs pyarrow: .*comera\[parquet\]"
    ):
        prepare_corpus(source, tmp_path / "prepared", settings())


def test_parquet_rows_are_documents_keyed_by_file_and_row(tmp_path, tokenizer_file):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    source = tmp_path / "corpus"
    source.mkdir()
    rng = random.Random(2)
    texts = [" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(50)] + [None]
    parquet.write_table(pyarrow.table({"text": texts, "id": list(range(51))}), source / "part.parquet")
    out = tmp_path / "prepared"
    prepare_corpus(source, out, settings(tokenizer_file=tokenizer_file))
    index = read_index(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    expected = {"train": [], "validation": []}
    for row, text in enumerate(texts[:-1], start=1):
        expected[split_of(f"part.parquet:{row}", 0.2)] += [*tokenizer.encode(text).ids, index["eos_id"]]
    for split, tokens in expected.items():
        shards = index["splits"][split]["shards"]
        joined = np.concatenate([np.fromfile(out / entry["name"], dtype=np.uint16) for entry in shards])
        assert joined.tolist() == tokens
    assert index["skipped"]["first"] == [{"key": "part.parquet:51", "reason": "empty"}]
