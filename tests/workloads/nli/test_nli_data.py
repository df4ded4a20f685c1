"""MNLI readers on fixture files in GLUE's and JSON lines' real formats, and the recipe-facing builder."""

import gzip
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera.data.tokenize import load_tokenizer
from comera.workloads.nli.data import build_nli_data, read_glue_tsv, read_jsonl, read_mnli
from comera.workloads.nli.pairs import PadCollate, exact_match_flags

DATA = Path(__file__).parents[2] / "data"
GLUE = DATA / "glue_mnli"
VOCAB = DATA / "nli_vocab" / "vocab.txt"


def test_glue_train_keeps_quotes_as_text_and_skips_the_missing_label():
    examples = read_glue_tsv(GLUE / "train.tsv")
    assert examples.counts() == {"read": 6, "skipped": 1}
    assert examples.skipped_reasons == {"no gold label": 1}
    assert examples.first[0] == '"Hello," she said to the cat.'
    assert examples.second[0] == 'She said "hello".'
    assert examples.first[1] == 'He has a 6" ruler and a 12" one.'
    # an unbalanced quote does not swallow the following lines
    assert examples.first[3] == 'Quotes " open and never close'
    assert examples.first[4] == "The cat sat."
    assert examples.labels == [0, 2, 1, 0, 2]


def test_glue_dev_files_find_columns_by_header_name():
    matched = read_glue_tsv(GLUE / "dev_matched.tsv")
    assert matched.counts() == {"read": 3, "skipped": 1}
    assert matched.labels == [2, 0]
    assert matched.second == ["She said yes.", "A dog sat."]


def test_glue_folder_gives_train_and_both_validation_splits():
    splits = read_mnli(GLUE)
    assert list(splits) == ["train", "validation_matched", "validation_mismatched"]
    assert [len(splits[name]) for name in splits] == [5, 2, 2]


def test_malformed_glue_line_names_file_and_line():
    path = DATA / "glue_mnli_malformed" / "train.tsv"
    with pytest.raises(
        ValueError, match=r"glue_mnli_malformed/train\.tsv:3: malformed line: 9 tab-separated"
    ):
        read_glue_tsv(path)


def test_malformed_glue_lines_are_counted_when_skipped():
    examples = read_glue_tsv(DATA / "glue_mnli_malformed" / "train.tsv", skip_malformed=True)
    assert examples.counts() == {"read": 4, "skipped": 2}
    assert examples.skipped_reasons == {"malformed": 2}
    assert examples.labels == [0, 0]  # the gold label, not label1


def test_unknown_glue_label_is_malformed(tmp_path):
    lines = (DATA / "glue_mnli_malformed" / "train.tsv").read_text().splitlines()
    path = tmp_path / "train.tsv"
    path.write_text("\n".join([lines[0], lines[4]]) + "\n")
    with pytest.raises(ValueError, match=r"train\.tsv:2: malformed line: label 'maybe'"):
        read_glue_tsv(path)


def _with_latin1_line(source: Path, target: Path, number: int) -> Path:
    lines = source.read_bytes().splitlines(keepends=True)
    lines[number - 1] = lines[number - 1].replace(b"a", b"\xe9", 1)
    target.write_bytes(b"".join(lines))
    return target


@pytest.mark.parametrize(
    ("source", "name", "reader"),
    [(GLUE / "train.tsv", "train.tsv", read_glue_tsv), (DATA / "nli_pairs.jsonl", "pairs.jsonl", read_jsonl)],
)
def test_a_line_that_is_not_utf8_is_named_and_skippable(tmp_path, source, name, reader):
    path = _with_latin1_line(source, tmp_path / name, 2)
    with pytest.raises(
        ValueError, match=rf"{name}:2: malformed line: byte 0xe9 at offset \d+ is not valid UTF-8"
    ):
        reader(path)
    clean = reader(source)
    examples = reader(path, skip_malformed=True)
    assert examples.skipped_reasons["malformed"] == 1
    assert examples.read == clean.read and len(examples) == len(clean) - 1


@pytest.mark.parametrize(
    ("text", "name", "reader"),
    [
        (b"sentence1\tsentence2\tgold_label\nA cat.\tA pet.\tentailment\n", "train.tsv", read_glue_tsv),
        (DATA.joinpath("nli_pairs.jsonl").read_bytes(), "pairs.jsonl", read_jsonl),
    ],
    ids=["glue-tsv", "jsonl"],
)
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_line(tmp_path, text, name, reader):
    plain, marked = tmp_path / name, tmp_path / f"bom-{name}"
    plain.write_bytes(text)
    marked.write_bytes(b"\xef\xbb\xbf" + text)
    assert reader(marked) == reader(plain) and len(reader(plain)) > 0


def test_a_header_that_is_not_utf8_is_named(tmp_path):
    path = _with_latin1_line(GLUE / "train.tsv", tmp_path / "train.tsv", 1)
    with pytest.raises(ValueError, match=r"train\.tsv:1: header byte 0xe9 at offset \d+ is not valid UTF-8"):
        read_glue_tsv(path)


def test_missing_header_column_is_named(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("index\tsentence1\tlabel\n0\ta\tentailment\n")
    with pytest.raises(
        ValueError, match=r"train\.tsv:1: header lacks the column\(s\) \['sentence2', 'gold_label'\]"
    ):
        read_glue_tsv(path)


def test_jsonl_labels_by_name_or_index_and_skips():
    examples = read_jsonl(DATA / "nli_pairs.jsonl")
    assert examples.counts() == {"read": 6, "skipped": 2}
    assert examples.skipped_reasons == {"no gold label": 1, "empty sentence": 1}
    assert examples.labels == [0, 2, 0, 1]
    assert examples.first[0] == '"Hello," she said.'


def test_malformed_jsonl_line_names_file_and_line():
    with pytest.raises(ValueError, match=r"nli_malformed\.jsonl:2: malformed line: not valid JSON"):
        read_jsonl(DATA / "nli_malformed.jsonl")


def test_malformed_jsonl_lines_are_counted_when_skipped():
    examples = read_jsonl(DATA / "nli_malformed.jsonl", skip_malformed=True)
    assert examples.counts() == {"read": 5, "skipped": 3}
    assert examples.labels == [0, 2]


def test_single_jsonl_file_is_split_by_line():
    splits = read_mnli(DATA / "nli_pairs.jsonl", validation_every=2)
    assert splits["train"].labels == [0, 0] and splits["validation"].labels == [2, 1]
    assert splits["train"].counts() == {"read": 4, "skipped": 2}
    assert splits["validation"].counts() == {"read": 2, "skipped": 0}


@given(every=st.integers(2, 7), lines=st.lists(st.sampled_from(["pair", "bad"]), max_size=40))
@settings(max_examples=30, deadline=None)
def test_the_split_of_one_file_counts_each_line_once(tmp_path_factory, every, lines):
    """One ``.jsonl`` file split by line: the two splits' lines read add up to the file's, and each split
    read its pairs plus its skipped lines (the skipped ones counted with train)."""
    import json

    path = tmp_path_factory.mktemp("one") / "pairs.jsonl"
    rows = [
        json.dumps({"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % 3}) if kind == "pair" else "{"
        for i, kind in enumerate(lines)
    ]
    path.write_text("".join(row + "\n" for row in rows))
    splits = read_mnli(path, skip_malformed=True, validation_every=every)
    train, validation = splits["train"], splits["validation"]
    assert train.read + validation.read == len(lines)
    assert validation.read == len(validation) == lines.count("pair") // every
    assert train.read == len(train) + train.skipped and train.skipped == lines.count("bad")


def test_data_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_mnli(tmp_path / "nothing")
    with pytest.raises(ValueError, match="neither train.tsv"):
        read_mnli(tmp_path)
    with pytest.raises(ValueError, match="validation_every must be an int >= 2"):
        read_mnli(DATA / "nli_pairs.jsonl", validation_every=1)


def _glue_copy(folder: Path, names: tuple[str, ...]) -> Path:
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes((GLUE / name).read_bytes())
    return folder


@pytest.mark.parametrize("make", ["fifo", "loop", "dangling"])
@pytest.mark.parametrize("layout", ["glue", "jsonl"])
def test_a_split_file_that_is_not_a_regular_file_is_named_without_waiting_on_it(
    tmp_path, make, layout, deadline
):
    """A pipe (which reading would wait on forever), a looping or a dangling link under a split's name:
    refused naming the file, before anything is read; no split is dropped without a word."""
    import os

    if layout == "glue":
        folder, odd = _glue_copy(tmp_path / "d", ("train.tsv", "dev_mismatched.tsv")), "dev_matched.tsv"
    else:
        folder, odd = tmp_path / "d", "extra.jsonl"
        folder.mkdir()
        (folder / "train.jsonl").write_bytes((DATA / "nli_pairs.jsonl").read_bytes())
        (folder / "dev.jsonl").write_bytes((DATA / "nli_pairs.jsonl").read_bytes())
    if make == "fifo":
        os.mkfifo(folder / odd)
    else:
        (folder / odd).symlink_to(odd if make == "loop" else "nowhere")
    deadline(20)  # a reader that opens the pipe would wait forever
    with pytest.raises(ValueError, match=rf"{odd}: not a regular file"):
        read_mnli(folder)


@pytest.mark.parametrize("make", ["fifo", "loop", "dangling", "device"])
def test_a_data_path_that_is_there_but_not_a_file_or_folder_is_called_so(tmp_path, make, deadline):
    """``--data`` naming a pipe, a device or a broken link: refused as not a regular file, not as a path
    that does not exist, and nothing waits on the pipe."""
    import os

    path = Path("/dev/null") if make == "device" else tmp_path / "pairs.jsonl"
    if make == "fifo":
        os.mkfifo(path)
    elif make != "device":
        path.symlink_to(path.name if make == "loop" else "nowhere.jsonl")
    deadline(20)
    with pytest.raises(ValueError, match=rf"{path}: not a regular file"):
        read_mnli(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_mnli(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(("train", "why"), [("train.tsv", "add dev_matched.tsv"), ("train.jsonl", "pass ")])
def test_a_folder_without_an_evaluation_split_is_refused_before_training(tmp_path, train, why):
    """A folder holding only its training file would train a run that evaluates nothing: refused, saying
    what to add (a GLUE dev file, another .jsonl split, or the .jsonl file alone, which is then split)."""
    folder = tmp_path / "d"
    folder.mkdir()
    source = GLUE / "train.tsv" if train == "train.tsv" else DATA / "nli_pairs.jsonl"
    (folder / train).write_bytes(source.read_bytes())
    with pytest.raises(ValueError, match=rf"holds {train} but no evaluation split.*{why}"):
        read_mnli(folder)


def test_a_hidden_jsonl_file_in_a_folder_is_not_a_split(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    lines = (DATA / "nli_pairs.jsonl").read_bytes()
    for name in ("train.jsonl", "valid.jsonl", ".valid.jsonl", "._train.jsonl"):
        (folder / name).write_bytes(lines)
    assert set(read_mnli(folder)) == {"train", "valid"}


def test_builder_tokenises_pads_and_reports_counts(tmp_path):
    data = build_nli_data(GLUE, tmp_path, tokenizer=VOCAB, max_length=16)
    assert set(data.evals) == {"validation_matched", "validation_mismatched"}
    splits = data.info["splits"]
    assert splits["train"] == {
        "read": 6,
        "skipped": 1,
        "skipped_reasons": {"no gold label": 1},
        "examples": 5,
        "majority_accuracy": pytest.approx(2 / 5),
    }
    assert splits["validation_matched"]["read"] == 3 and splits["validation_matched"]["skipped"] == 1
    assert data.info["num_classes"] == 3 and data.info["vocab_size"] == 34
    batch = data.collate_fn([data.train[i] for i in range(3)])
    lengths = [len(data.train[i]["input_ids"]) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["labels"].tolist() == [0, 2, 1]
    for row, n in enumerate(lengths):
        assert batch["input_ids"][row, 0] == 2 and batch["input_ids"][row, n - 1] == 3
        assert (batch["input_ids"][row, n:] == 0).all() and (batch["token_type_ids"][row, n:] == 0).all()


def test_builder_trains_a_vocabulary_when_none_is_given(tmp_path):
    data = build_nli_data(DATA / "nli_pairs.jsonl", tmp_path, vocab_size=60, validation_every=2)
    assert 5 < data.info["vocab_size"] <= 60
    assert len(list(tmp_path.glob("wordpiece-*.json"))) == 1
    again = build_nli_data(DATA / "nli_pairs.jsonl", tmp_path, vocab_size=60, validation_every=2)
    assert torch.equal(again.train.ids, data.train.ids)


def test_a_damaged_trained_vocabulary_is_trained_again_and_replaced(tmp_path, cache_damage):
    options = {"vocab_size": 60, "validation_every": 2}
    clean = build_nli_data(DATA / "nli_pairs.jsonl", tmp_path, **options)
    (file,) = tmp_path.glob("wordpiece-*.json")
    cache_damage(file)
    with cache_damage.rebuilt(file):
        again = build_nli_data(DATA / "nli_pairs.jsonl", tmp_path, **options)
    # trained again, WordPiece may choose or number its pieces otherwise: the same pairs, perhaps other ids
    assert again.info["splits"] == clean.info["splits"] and len(again.train) == len(clean.train)
    read = build_nli_data(DATA / "nli_pairs.jsonl", tmp_path, **options)
    assert read.info["identity"] == again.info["identity"] and torch.equal(read.train.ids, again.train.ids)


def test_pad_collate_pads_to_the_longest():
    samples = [
        {
            "input_ids": torch.tensor([2, 7, 3]),
            "token_type_ids": torch.tensor([0, 0, 0]),
            "labels": torch.tensor(1),
        },
        {
            "input_ids": torch.tensor([2, 3, 8, 3]),
            "token_type_ids": torch.tensor([0, 0, 1, 1]),
            "labels": torch.tensor(0),
        },
    ]
    batch = PadCollate(pad_id=5)(samples)
    assert batch["input_ids"].tolist() == [[2, 7, 3, 5], [2, 3, 8, 3]]
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [1, 0]


def test_pad_collate_pads_exact_match_flags_with_zero():
    samples = [
        {
            "input_ids": torch.tensor([2, 7, 3, 7, 3]),
            "token_type_ids": torch.tensor([0, 0, 0, 1, 1]),
            "exact_match_ids": torch.tensor([0, 1, 0, 1, 0]),
            "labels": torch.tensor(1),
        },
        {
            "input_ids": torch.tensor([2, 8, 3]),
            "token_type_ids": torch.tensor([0, 0, 0]),
            "exact_match_ids": torch.tensor([0, 0, 0]),
            "labels": torch.tensor(0),
        },
    ]
    batch = PadCollate(pad_id=5)(samples)
    assert batch["exact_match_ids"].tolist() == [[0, 1, 0, 1, 0], [0, 0, 0, 0, 0]]


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1)), max_size=30),
    ignore=st.sets(st.integers(0, 9), max_size=3),
)
def test_exact_match_flags_mark_ids_found_in_the_other_segment(tokens, ignore):
    ids, types = [t for t, _ in tokens], [k for _, k in tokens]
    flags = exact_match_flags(ids, types, ignore)
    for position, (token, kind) in enumerate(tokens):
        in_other = any(other == token and other_kind != kind for other, other_kind in tokens)
        assert flags[position] == int(in_other and token not in ignore)


def test_exact_match_flags_need_aligned_types():
    with pytest.raises(ValueError, match="same length"):
        exact_match_flags([1, 2, 3], [0, 1])


def test_dataset_flags_shared_words_but_never_special_tokens(tmp_path):
    data = build_nli_data(GLUE, tmp_path, tokenizer=VOCAB, max_length=64)
    tokenizer = load_tokenizer(VOCAB, max_length=64)
    special = tokenizer.special_ids()
    assert {tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id} <= special
    flagged_any = False
    for index in range(len(data.train)):
        sample = data.train[index]
        ids, types, flags = sample["input_ids"], sample["token_type_ids"], sample["exact_match_ids"]
        first, second = set(ids[types == 0].tolist()), set(ids[types == 1].tolist())
        want = [int(t in first and t in second and t not in special) for t in ids.tolist()]
        assert flags.tolist() == want
        assert not flags[torch.isin(ids, torch.tensor(sorted(special)))].any()
        flagged_any |= bool(flags.any())
    assert flagged_any


@pytest.mark.parametrize(
    ("source", "reader"), [(GLUE / "train.tsv", read_glue_tsv), (DATA / "nli_pairs.jsonl", read_jsonl)]
)
def test_a_gzip_file_reads_as_its_text_and_a_truncated_one_is_named(tmp_path, source, reader):
    packed = tmp_path / source.name
    packed.write_bytes(gzip.compress(source.read_bytes()))
    plain, unpacked = reader(source), reader(packed)
    assert (unpacked.first, unpacked.second, unpacked.labels) == (plain.first, plain.second, plain.labels)
    cut = tmp_path / f"cut-{source.name}"
    cut.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(ValueError, match=rf"cut-{source.name}: the compressed data is truncated or corrupt"):
        reader(cut)


def test_the_trained_vocabulary_is_found_again_by_the_datas_content(tmp_path):
    """The cache key of a trained vocabulary follows the data's content: a touched file, a link to the
    folder or a renamed copy finds the same vocabulary; an edited file makes another key."""
    import os
    import shutil

    from comera.workloads.nli.data import _source_key

    folder = tmp_path / "glue"
    folder.mkdir()
    (folder / "train.tsv").write_text("a\tb\n")
    (folder / "dev_matched.tsv").write_text("c\td\n")
    key = _source_key(folder, 100)
    os.utime(folder / "train.tsv", (1, 1))
    (tmp_path / "link").symlink_to(folder)
    shutil.copytree(folder, tmp_path / "renamed")
    assert _source_key(folder, 100) == _source_key(tmp_path / "link", 100) == key
    assert _source_key(tmp_path / "renamed", 100) == key
    assert _source_key(folder, 200) != key
    (folder / "train.tsv").write_text("a\tB\n")
    assert _source_key(folder, 100) != key


def test_jsonl_gz_files_are_read_as_a_file_and_in_a_folder(tmp_path):
    """``NAME.jsonl.gz`` is a split as ``NAME.jsonl`` is (the other workloads read ``.jsonl.gz`` too); one
    split under both names is refused, naming it."""
    text = (DATA / "nli_pairs.jsonl").read_bytes()
    single = tmp_path / "pairs.jsonl.gz"
    single.write_bytes(gzip.compress(text))
    plain = read_mnli(DATA / "nli_pairs.jsonl", validation_every=2)
    packed = read_mnli(single, validation_every=2)
    assert packed["train"].labels == plain["train"].labels
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "train.jsonl.gz").write_bytes(gzip.compress(text))
    (folder / "dev.jsonl").write_bytes(text)
    splits = read_mnli(folder)
    assert list(splits) == ["train", "dev"] and splits["train"].labels == splits["dev"].labels
    (folder / "dev.jsonl.gz").write_bytes(gzip.compress(text))
    with pytest.raises(ValueError, match=r"both as NAME.jsonl and NAME.jsonl.gz: \['dev'\]"):
        read_mnli(folder)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"max_length": 1}, "max_length must be an int >= 4, got 1"),
        ({"vocab_size": -5}, "vocab_size must be an int in \\[6, 1048576\\], got -5"),
        ({"vocab_size": 0}, "vocab_size must be an int in \\[6, 1048576\\], got 0"),
    ],
)
def test_a_bad_setting_is_refused_before_the_data_and_the_cached_vocabulary_stays(
    tmp_path, recwarn, setting, message
):
    """With ``--data`` as without: a bad ``max_length`` or ``vocab_size`` is named before anything is read,
    and the WordPiece vocabulary cached for the data is neither called damaged nor trained again."""
    build_nli_data(GLUE, tmp_path, vocab_size=60, max_length=16)
    before = {file: file.read_bytes() for file in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=message):
        build_nli_data(GLUE, tmp_path, **{"vocab_size": 60, "max_length": 16, **setting})
    assert {file: file.read_bytes() for file in tmp_path.iterdir()} == before
    assert not [warning for warning in recwarn if "damaged" in str(warning.message)]


def test_the_cached_vocabulary_is_read_whatever_the_max_length(tmp_path, recwarn):
    from comera.workloads.nli.data import _trained_tokenizer

    first = build_nli_data(GLUE, tmp_path, vocab_size=60, max_length=16)
    (entry,) = tmp_path.glob("wordpiece-*.json")
    before = entry.read_bytes()
    splits = read_mnli(GLUE)
    with pytest.raises(ValueError, match="max_length must be an int >= 4, got 2"):
        _trained_tokenizer(splits["train"], tmp_path, entry.stem.removeprefix("wordpiece-"), 60, 2)
    again = build_nli_data(GLUE, tmp_path, vocab_size=60, max_length=16)
    assert entry.read_bytes() == before and again.info["identity"] == first.info["identity"]
    assert not [warning for warning in recwarn if "damaged" in str(warning.message)]


@pytest.mark.parametrize("tokenizer", [True, 3, ["vocab.txt"]])
def test_a_tokenizer_that_is_no_path_is_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"tokenizer must be the path of a vocab.txt or tokenizer.json"):
        build_nli_data(GLUE, tmp_path, tokenizer=tokenizer)
