"""The corpus reader's contract (comera.data.sources): argument checks that name the argument and the valid
values, the hash order of files, the byte cap at its boundary, JSON-line keys and errors, the split's boundary
and the documents' digest, each against a reference computed here by hand or with hashlib."""

import hashlib
import json
import re

import pytest

from comera.data.sources import (
    CodeDocument,
    SkippedDocument,
    documents_digest,
    read_code,
    read_counts,
    split_of,
)


def _unit(*parts: str) -> float:
    """SHA-256 of the parts joined by 0x1f, its first 8 bytes big-endian, as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256("\x1f".join(parts).encode()).digest()[:8], "big") / 2**64


def _write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


@pytest.mark.parametrize(
    ("extensions", "shown"),
    [
        (".py", "'.py'"),  # a string is not a list of extensions
        ([], "[]"),
        ({".py"}, "{'.py'}"),  # not a sequence
    ],
)
def test_extensions_must_be_a_non_empty_list(tmp_path, extensions, shown):
    """Each is refused by the first check, with the message naming the argument and the value given."""
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(
        ValueError, match=re.escape(f"extensions must be a non-empty list like ['.py'], got {shown}")
    ):
        read_code(tmp_path, extensions=extensions)


@pytest.mark.parametrize(("extension", "shown"), [("py", "'py'"), (".", "'.'"), (3, "3"), ("", "''")])
def test_each_extension_must_start_with_a_dot_and_name_something(tmp_path, extension, shown):
    """An extension without its dot, a dot alone (shorter than 2 characters) or a non-string is refused."""
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(
        ValueError,
        match=re.escape(f"extensions must be strings starting with '.', like '.py', got {shown}"),
    ):
        read_code(tmp_path, extensions=[".py", extension])


def test_a_two_character_extension_is_accepted(tmp_path):
    """``.c`` (exactly 2 characters, the shortest allowed) selects C files."""
    (tmp_path / "main.c").write_text("int main(void) { return 0; }\n")
    (tmp_path / "other.py").write_text("x = 1\n")
    documents, skipped = read_code(tmp_path, extensions=[".c"])
    assert [(d.key, d.text) for d in documents] == [("main.c", "int main(void) { return 0; }\n")]
    assert skipped == []


@pytest.mark.parametrize(
    ("text_fields", "shown"), [("text", "'text'"), ([], "[]"), (["code", 1], "['code', 1]")]
)
def test_text_fields_must_be_a_non_empty_list_of_names(tmp_path, text_fields, shown):
    """A bare string, an empty list or a non-string name is refused, naming the argument and the value."""
    _write_jsonl(tmp_path / "f.jsonl", [{"code": "x = 1"}])
    with pytest.raises(
        ValueError,
        match=re.escape(f"text_fields must be a non-empty list of field names, got {shown}"),
    ):
        read_code(tmp_path / "f.jsonl", text_fields=text_fields)


@pytest.mark.parametrize("name", ["max_files", "max_bytes"])
@pytest.mark.parametrize(
    ("value", "shown"),
    [(-1, "-1"), (-3, "-3"), (True, "True"), (False, "False"), (2.0, "2.0"), (0.0, "0.0"), ("2", "'2'")],
)
def test_caps_must_be_positive_ints_or_zero_or_none(tmp_path, name, value, shown):
    """-1 (just below 0, no cap), negatives, bools, floats and strings are refused by name."""
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(
        ValueError, match=re.escape(f"{name} must be an int >= 1, or 0 or None for no cap, got {shown}")
    ):
        read_code(tmp_path, **{name: value})


@pytest.mark.parametrize("name", ["max_files", "max_bytes"])
def test_a_cap_of_zero_reads_everything_as_none_does(tmp_path, name):
    for index in range(5):
        (tmp_path / f"m{index}.py").write_text(f"x = {index}\n")
    everything = read_code(tmp_path)
    assert len(everything[0]) == 5
    assert read_code(tmp_path, **{name: 0}) == everything


def test_a_cap_of_one_is_accepted(tmp_path):
    """1, the smallest cap, reads one file; a byte cap of 1 stops after the first document."""
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.py").write_text(f"{name} = 1\n")
    assert len(read_code(tmp_path, max_files=1)[0]) == 1
    assert len(read_code(tmp_path, max_bytes=1)[0]) == 1


def test_a_missing_path_is_named(tmp_path):
    """FileNotFoundError naming the path given."""
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(f"data path {missing} does not exist")):
        read_code(missing)


def test_files_are_read_in_the_hash_order_of_their_relative_path(tmp_path):
    """The order is that of SHA-256("order" 0x1f relative path), computed here; hidden folders and
    site-packages are not entered, and a one-character folder name is fine."""
    keys = [f"m{index}.py" for index in range(8)] + ["a/one.py", "pkg/sub/two.py", "pkg/three.py"]
    for key in keys:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_text(f"# {key}\n")
    for hidden in (".git/hook.py", ".venv/lib.py", "site-packages/vendored.py", "pkg/.cache/c.py"):
        (tmp_path / hidden).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / hidden).write_text("x = 1\n")
    documents, skipped = read_code(tmp_path)
    expected = sorted(keys, key=lambda key: _unit("order", key))
    assert expected != sorted(keys)  # the check below could not tell hash order from name order otherwise
    assert [d.key for d in documents] == expected
    assert [d.text for d in documents] == [f"# {key}\n" for key in expected]
    assert skipped == []
    assert [d.key for d in read_code(tmp_path, max_files=3)[0]] == expected[:3]


@pytest.mark.parametrize(
    ("max_bytes", "read"),
    [
        (6, 1),  # the first text has 5 characters but 10 UTF-8 bytes
        (10, 1),  # exactly the first text's bytes: stop after it
        (11, 2),  # one byte more: the second text is read too
        (20, 2),  # exactly the first two
        (21, 3),
        (30, 3),
        (31, 3),  # the cap is never reached: everything is read
    ],
)
def test_the_byte_cap_counts_utf8_bytes_and_stops_once_reached(tmp_path, max_bytes, read):
    """Reading stops as soon as the UTF-8 bytes read reach ``max_bytes`` (10 bytes a text here)."""
    texts = ["é" * 5, "b" * 10, "c" * 10]
    _write_jsonl(tmp_path / "f.jsonl", [{"code": text} for text in texts])
    documents, _ = read_code(tmp_path / "f.jsonl", max_bytes=max_bytes)
    assert [d.text for d in documents] == texts[:read]


def test_an_empty_record_is_skipped_and_the_file_read_on(tmp_path):
    """A blank text in a JSON-lines file is counted as empty; the records after it are still read."""
    _write_jsonl(
        tmp_path / "f.jsonl", [{"code": "x = 1"}, {"code": " \n\t"}, {"code": "y = 2"}, {"code": ""}]
    )
    documents, skipped = read_code(tmp_path / "f.jsonl")
    assert [(d.key, d.text) for d in documents] == [("f.jsonl:1", "x = 1"), ("f.jsonl:3", "y = 2")]
    assert skipped == [SkippedDocument("f.jsonl:2", "empty"), SkippedDocument("f.jsonl:4", "empty")]


def test_a_json_record_keyed_by_repo_and_path_only_when_both_are_strings(tmp_path):
    """``repo/path`` when both are strings, else ``file:line``."""
    _write_jsonl(
        tmp_path / "f.jsonl",
        [
            {"repo": "octo/calc", "code": "a = 1"},
            {"path": "calc/ops.py", "code": "b = 2"},
            {"repo": "octo/calc", "path": 7, "code": "c = 3"},
            {"repo": "octo/calc", "path": "calc/ops.py", "code": "d = 4"},
        ],
    )
    documents, _ = read_code(tmp_path / "f.jsonl")
    assert [d.key for d in documents] == ["f.jsonl:1", "f.jsonl:2", "f.jsonl:3", "octo/calc/calc/ops.py"]


@pytest.mark.parametrize(
    ("line", "fields", "shown"),
    [
        ('{"code": 5}', None, "['code', 'original_string']"),
        ("[1, 2]", None, "['code', 'original_string']"),
        ('{"code": "x"}', ["text"], "['text']"),
    ],
)
def test_a_record_without_a_text_field_is_named_with_the_fields_expected(tmp_path, line, fields, shown):
    """The error names the file, the line and the fields that may hold the text."""
    path = tmp_path / "f.jsonl"
    path.write_text('{"code": "ok = 1", "text": "ok = 1"}\n' + line + "\n")
    arguments = {} if fields is None else {"text_fields": fields}
    with pytest.raises(
        ValueError,
        match=re.escape(f"{path}: line 2: expected a JSON object with a string field among {shown}"),
    ):
        read_code(path, **arguments)


def test_split_boundary_and_names():
    """A key whose hash equals the fraction exactly goes to train (the test is strictly below); the two
    answers are exactly "validation" and "train"."""
    for key in ("pkg/a.py", "repo/b.py", "c.jsonl:3"):
        fraction = _unit("split", key)
        assert split_of(key, fraction) == "train"
        assert split_of(key, min(1.0, fraction * (1 + 1e-9) + 1e-18)) == "validation"
        assert split_of(key, 0.0) == "train"
        assert split_of(key, 1.0) == "validation"


def test_documents_digest_is_sha256_of_settings_keys_and_texts():
    """``sha256("/".join(settings))``, then per document its key, a NUL byte and the SHA-256 of its text;
    the first 16 hex digits."""
    documents = [CodeDocument("a.py", "x = 'é'\n"), CodeDocument("b/c.py", "")]
    reference = hashlib.sha256(b"code-bpe/2/300/2")
    for key, text in (("a.py", "x = 'é'\n"), ("b/c.py", "")):
        reference.update(key.encode() + b"\x00")
        reference.update(hashlib.sha256(text.encode("utf-8")).digest())
    assert documents_digest(documents, "code-bpe", 2, 300, 2) == reference.hexdigest()[:16]
    assert documents_digest([], "x") == hashlib.sha256(b"x").hexdigest()[:16]


def test_read_counts_counts_each_skip_reason():
    """Totals and one count per reason, zero for reasons that did not occur."""
    documents = [CodeDocument("a.py", "a"), CodeDocument("b.py", "b")]
    skipped = [
        SkippedDocument("c.py", "not_utf8"),
        SkippedDocument("d.jsonl:3", "bad_line"),
        SkippedDocument("d.jsonl:5", "bad_line"),
    ]
    assert read_counts(documents, skipped) == {
        "read": 2,
        "skipped": 3,
        "skipped_not_utf8": 1,
        "skipped_unreadable": 0,
        "skipped_bad_line": 2,
        "skipped_empty": 0,
    }
    assert read_counts([], []) == {
        "read": 0,
        "skipped": 0,
        "skipped_not_utf8": 0,
        "skipped_unreadable": 0,
        "skipped_bad_line": 0,
        "skipped_empty": 0,
    }
