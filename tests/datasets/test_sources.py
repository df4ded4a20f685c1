"""Reading a corpus of source code (JSON lines, folders, the standard library) and its split."""

import gzip
import hashlib
import json
import math
import random
import sysconfig
from pathlib import Path

import pytest

from comera.data.sources import read_code, split_of

DATA = Path(__file__).resolve().parents[1] / "data"
# the folder fixture's sources end in .src so that linters of this repository leave them alone
SOURCE = [".src"]


def _within_binomial(count: int, trials: int, probability: float, sigmas: float = 5.0) -> bool:
    """Whether ``count`` is within ``sigmas`` standard deviations of Binomial(trials, probability)'s mean."""
    mean = trials * probability
    return abs(count - mean) <= sigmas * math.sqrt(trials * probability * (1 - probability))


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


def test_hidden_files_and_folders_are_not_read(tmp_path):
    """An editor's lock file or a macOS resource fork beside the sources is not a source."""
    (tmp_path / "good.py").write_text("def f(x):\n    return x\n")
    (tmp_path / ".#good.py").write_text("root@host.1234")
    (tmp_path / "._good.py").write_bytes(b"\x00\x05\x16\x07")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "copy.py").write_text("x = 1\n")
    documents, skipped = read_code(tmp_path)
    assert [d.key for d in documents] == ["good.py"] and skipped == []


def test_pipes_are_skipped_and_counted_without_waiting_on_them(tmp_path, deadline):
    """A pipe named like a source file (``.py``, ``.jsonl``) would block a reader forever: skipped as
    unreadable, like a looping link."""
    import os

    (tmp_path / "good.py").write_text("def f(x):\n    return x\n")
    os.mkfifo(tmp_path / "pipe.py")
    os.mkfifo(tmp_path / "pipe.jsonl")
    deadline(20)
    documents, skipped = read_code(tmp_path)
    assert [d.key for d in documents] == ["good.py"]
    reasons = sorted((s.key, s.reason) for s in skipped)
    assert reasons == [("pipe.jsonl", "unreadable"), ("pipe.py", "unreadable")]


@pytest.mark.parametrize("make", ["fifo", "dangling", "device"])
def test_a_data_path_that_is_a_pipe_a_device_or_a_broken_link_is_named(tmp_path, make, deadline):
    """The path given is itself not a file or folder: refused as such, not read as an empty corpus (which
    had said "no document was read") and not waited on."""
    import os

    path = Path("/dev/null") if make == "device" else tmp_path / "corpus.jsonl"
    if make == "fifo":
        os.mkfifo(path)
    elif make == "dangling":
        path.symlink_to("nowhere.jsonl")
    deadline(20)
    with pytest.raises(ValueError, match=rf"{path}: not a regular file"):
        read_code(path)


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


def test_a_jsonl_file_with_a_utf8_byte_order_mark_reads_its_first_line(tmp_path):
    source = DATA / "code_jsonl" / "functions.jsonl"
    marked = tmp_path / "functions.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + source.read_bytes())
    assert read_code(marked) == read_code(source)


def test_a_text_file_with_a_utf8_byte_order_mark_reads_without_it(tmp_path):
    """A source or ``.txt`` document saved with a byte-order mark (Windows Notepad) is the text after the
    mark, as a JSON-lines file is; a mark further in is text and stays."""
    (tmp_path / "notes.txt").write_bytes(b"\xef\xbb\xbfhello world\n")
    (tmp_path / "inner.txt").write_bytes("a\n\ufeffb\n".encode())
    documents, skipped = read_code(tmp_path, extensions=[".txt"])
    assert skipped == []
    assert {d.key: d.text for d in documents} == {"notes.txt": "hello world\n", "inner.txt": "a\n\ufeffb\n"}


def test_comera_prepares_reader_drops_a_byte_order_mark_as_read_code_does(tmp_path):
    """``comera prepare``'s reader (``read_corpus``) gives the same texts: the mark at the start of a ``.txt``
    file and of a JSON-lines file dropped, one further in kept."""
    from comera.data.corpus import SkipLog, corpus_files, read_corpus

    (tmp_path / "notes.txt").write_bytes(b"\xef\xbb\xbfhello world\n")
    (tmp_path / "inner.txt").write_bytes("a\n\ufeffb\n".encode())
    (tmp_path / "lines.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    documents = read_corpus(tmp_path, corpus_files(tmp_path), SkipLog())
    assert {d.key: d.text for d in documents} == {
        "notes.txt": "hello world\n",
        "inner.txt": "a\n\ufeffb\n",
        "lines.jsonl:1": "first",
        "lines.jsonl:2": "second",
    }


def test_a_json_line_longer_than_the_limit_is_named_or_skipped_without_reading_it_whole(tmp_path):
    """The limit counts the line's bytes with its newline: a line of exactly ``max_line_bytes`` is read, one
    byte more is a bad line (named with file and line, or skipped and counted); the lines after it are
    read."""
    short = json.dumps({"code": "x = 1"}) + "\n"
    limit = 64
    exact = json.dumps({"code": "y" * (limit - len('{"code": ""}\n'))}) + "\n"
    assert len(exact) == limit
    long = json.dumps({"code": "z" * 10_000}) + "\n"
    path = tmp_path / "corpus.jsonl"
    path.write_text(short + exact + long + short)
    message = r"corpus\.jsonl: line 3: longer than 64 bytes, the most one JSON line may hold"
    with pytest.raises(ValueError, match=message):
        read_code(path, max_line_bytes=limit)
    documents, skipped = read_code(path, max_line_bytes=limit, skip_bad_lines=True)
    assert [d.text for d in documents] == ["x = 1", json.loads(exact)["code"], "x = 1"]
    assert [(s.key, s.reason) for s in skipped] == [("corpus.jsonl:3", "bad_line")]
    assert read_code(path, max_line_bytes=len(long))[0][2].text == "z" * 10_000


def test_the_default_line_limit_is_eight_mebibytes(tmp_path):
    from comera.data.sources import MAX_LINE_BYTES

    assert MAX_LINE_BYTES == 8 * 2**20
    path = tmp_path / "big.jsonl"
    overhead = len('{"text": ""}\n')
    path.write_text('{"text": "' + "a" * (MAX_LINE_BYTES + 1 - overhead) + '"}\n')
    with pytest.raises(ValueError, match=r"big\.jsonl: line 1: longer than 8,388,608 bytes"):
        read_code(path, text_fields=["text"])
    path.write_text('{"text": "' + "a" * (MAX_LINE_BYTES - overhead) + '"}\n')
    assert len(read_code(path, text_fields=["text"])[0][0].text) == MAX_LINE_BYTES - overhead


def test_a_file_read_whole_larger_than_the_limit_is_refused_naming_it_without_reading_it(
    tmp_path, monkeypatch
):
    """A ``.txt`` (or source) file is one document: one larger than ``max_line_bytes`` stops the read naming
    the file and both sizes, in ``read_code`` and in ``comera prepare``'s ``read_corpus`` alike, before its
    bytes are read; a file of exactly the limit is read."""
    from comera.data.corpus import SkipLog, corpus_files, read_corpus

    limit = 64
    (tmp_path / "exact.txt").write_text("e" * limit)
    (tmp_path / "big.txt").write_text("b" * (limit + 1))
    read_bytes = Path.read_bytes

    def guarded(path):
        assert path.name != "big.txt", "the file larger than the limit was read"
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", guarded)
    message = r"big\.txt: 65 bytes, longer than 64 bytes, the most one document read whole may hold"
    with pytest.raises(ValueError, match=message):
        read_code(tmp_path, extensions=[".txt"], max_line_bytes=limit)
    with pytest.raises(ValueError, match=message):
        list(read_corpus(tmp_path, corpus_files(tmp_path), SkipLog(), max_line_bytes=limit))
    (tmp_path / "big.txt").unlink()
    documents, skipped = read_code(tmp_path, extensions=[".txt"], max_line_bytes=limit)
    assert ([d.text for d in documents], skipped) == (["e" * limit], [])
    assert [
        d.text for d in read_corpus(tmp_path, corpus_files(tmp_path), SkipLog(), max_line_bytes=limit)
    ] == ["e" * limit]
