"""Blank lines in GLUE and JSON lines files are neither read nor skipped, and later line numbers stay true."""

import json
from pathlib import Path

import pytest

from comera.workloads.nli.data import read_glue_tsv, read_jsonl

GLUE = Path(__file__).parents[2] / "data" / "glue_mnli"


def with_blank_lines(lines: list[bytes]) -> bytes:
    """``lines`` with a blank line (LF or CRLF) after every other one and two at the end."""
    out = []
    for number, line in enumerate(lines):
        out.append(line)
        if number % 2:
            out.append(b"\r\n" if number % 4 == 1 else b"\n")
    return b"".join(out) + b"\n\r\n"


def test_glue_blank_lines_are_not_counted(tmp_path):
    original = (GLUE / "train.tsv").read_bytes()
    blank = tmp_path / "train.tsv"
    blank.write_bytes(with_blank_lines(original.splitlines(keepends=True)))
    plain, padded = read_glue_tsv(GLUE / "train.tsv"), read_glue_tsv(blank)
    assert padded.counts() == plain.counts()
    assert padded.skipped_reasons == plain.skipped_reasons
    assert (padded.first, padded.second, padded.labels) == (plain.first, plain.second, plain.labels)


@pytest.mark.parametrize("blank", [b"   \n", b"\t\t\t\n", b" \t \r\n"])
def test_glue_lines_of_only_whitespace_are_blank_as_in_json_lines(tmp_path, blank):
    """Spaces and tabs alone make a blank line, as in the JSON lines reader: not read, not skipped, not an
    error (a line of tabs alone would otherwise be a row of empty fields)."""
    lines = (GLUE / "train.tsv").read_bytes().splitlines(keepends=True)
    path = tmp_path / "train.tsv"
    path.write_bytes(b"".join([lines[0], blank, *lines[1:], blank]))
    plain, padded = read_glue_tsv(GLUE / "train.tsv"), read_glue_tsv(path)
    assert padded.counts() == plain.counts()
    assert (padded.first, padded.labels) == (plain.first, plain.labels)


def test_glue_line_numbers_count_the_blank_lines(tmp_path):
    header = (GLUE / "train.tsv").read_bytes().splitlines(keepends=True)[0]
    path = tmp_path / "train.tsv"
    path.write_bytes(header + b"\n\n" + b"too\tfew\tfields\n")
    with pytest.raises(ValueError, match=r"train\.tsv:4: malformed line"):
        read_glue_tsv(path)
    assert read_glue_tsv(path, skip_malformed=True).counts() == {"read": 1, "skipped": 1}


def test_jsonl_blank_lines_are_not_counted(tmp_path):
    records = [
        {"premise": "A cat sat.", "hypothesis": "An animal sat.", "label": "entailment"},
        {"premise": "A dog ran.", "hypothesis": "Nothing moved.", "label": 2},
        {"premise": "It rained.", "hypothesis": "The ground is wet.", "label": "-"},
    ]
    lines = [json.dumps(record).encode() + b"\n" for record in records]
    plain, padded = tmp_path / "plain.jsonl", tmp_path / "padded.jsonl"
    plain.write_bytes(b"".join(lines))
    padded.write_bytes(with_blank_lines(lines))
    expected = read_jsonl(plain)
    assert expected.counts() == {"read": 3, "skipped": 1}
    assert read_jsonl(padded).counts() == expected.counts()
    assert read_jsonl(padded).labels == expected.labels == [0, 2]
