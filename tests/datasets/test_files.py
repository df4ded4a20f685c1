"""Reading data files (comera.data.files): archives named by format, gzip and zstd read by content and their
errors naming the file, UTF-8 errors placed by line and column."""

import bz2
import gzip
import io
import lzma
import re
import tarfile
import zipfile

import pytest

from comera.data import files
from comera.data.corpus import SkipLog, corpus_files, read_corpus
from comera.data.files import numbered_lines, open_data, utf8_text
from comera.data.sources import read_code

_BOM = b"\xef\xbb\xbf"
_RECORD = b'{"code": "def f(x):\\n    return x\\n"}\n'


def _tar(member: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo("functions.jsonl")
        info.size = len(member)
        archive.addfile(info, io.BytesIO(member))
    return buffer.getvalue()


def _zip(member: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("functions.jsonl", member)
    return buffer.getvalue()


# The zstd frame magic number is 0xFD2FB528, written little-endian (RFC 8878, section 3.1.1), followed here by
# bytes that are no frame.
_ZSTD_GARBAGE = b"\x28\xb5\x2f\xfd" + bytes(40)

ARCHIVES = {
    "bzip2-compressed": bz2.compress(_RECORD),
    "xz-compressed": lzma.compress(_RECORD, format=lzma.FORMAT_XZ),
    "a zip archive": _zip(_RECORD),
    "a tar archive": _tar(_RECORD),
}


@pytest.mark.parametrize("name", list(ARCHIVES))
def test_an_archive_is_refused_naming_its_format_and_the_file(tmp_path, name):
    """Each unsupported format, read plainly and from inside gzip, is named with the file (the tar magic sits
    at byte 257, past what the other probes read)."""
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(ARCHIVES[name])
    with pytest.raises(
        ValueError,
        match=re.escape(f"{plain}: {name}, not a text file; extract or decompress it first"),
    ):
        open_data(plain)
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(ARCHIVES[name]))
    with pytest.raises(
        ValueError,
        match=re.escape(f"{packed}: {name} inside gzip, not a text file; extract or decompress it first"),
    ):
        open_data(packed)


def test_a_file_gzipped_twice_is_named_as_such(tmp_path):
    """gzip inside gzip (``gzip`` run twice): named, not read as text whose first line is binary."""
    twice = tmp_path / "day_0.gz"
    twice.write_bytes(gzip.compress(gzip.compress(_RECORD)))
    with pytest.raises(ValueError, match=re.escape(f"{twice}: gzip-compressed inside gzip, not a text file")):
        open_data(twice)


def _zstd_frames(data: bytes, cuts: tuple[int, ...]) -> bytes:
    """``data`` compressed as one zstd frame per piece between the ``cuts`` (as ``zstd`` writes a file joined
    from several, or a streaming writer flushes)."""
    zstandard = pytest.importorskip("zstandard")
    bounds = [0, *cuts, len(data)]
    compressor = zstandard.ZstdCompressor()
    return b"".join(compressor.compress(data[start:end]) for start, end in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("cuts", [(), (1,), (7, 4000, 4001)])
def test_a_zstd_file_reads_as_the_text_it_holds_frame_after_frame(tmp_path, cuts):
    """A zstd file of one or several frames gives the bytes compressed into it (a leading byte-order mark
    skipped, as for a plain file), whatever its name, and the same JSON-lines documents as the plain file."""
    text = "".join(f'{{"text": "document {i} \u00e9"}}\n' for i in range(400)).encode()
    packed = tmp_path / "zst" / "shard.jsonl.zst"
    packed.parent.mkdir()
    packed.write_bytes(_zstd_frames(_BOM + text, cuts))
    with open_data(packed) as handle:
        assert handle.read() == text
    misnamed = tmp_path / "misnamed.jsonl"
    misnamed.write_bytes(packed.read_bytes())
    with open_data(misnamed) as handle:
        assert handle.read() == text
    plain = tmp_path / "plain" / "shard.jsonl"
    plain.parent.mkdir()
    plain.write_bytes(text)
    read = [d.text for d in read_corpus(packed.parent, corpus_files(packed.parent), SkipLog())]
    assert read == [d.text for d in read_corpus(plain.parent, corpus_files(plain.parent), SkipLog())]
    assert len(read) == 400


@pytest.mark.parametrize("damage", ["truncated", "not a frame"])
def test_a_truncated_or_corrupt_zstd_file_is_named_not_read_short(tmp_path, damage):
    """zstandard's own reader stops at a cut frame without a word; comera's names the file instead of
    returning the documents before the cut."""
    text = b'{"text": "a line of the corpus"}\n' * 2000
    whole = _zstd_frames(text, ())
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(whole[: len(whole) // 2] if damage == "truncated" else _ZSTD_GARBAGE)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the compressed data is truncated or corrupt")):
        list(numbered_lines(open_data(path), path))


def test_gzip_and_zstd_inside_each_other_are_named(tmp_path):
    """A file compressed twice is named with both formats, not read as text whose first line is binary."""
    zstd_in_gzip = tmp_path / "a.jsonl.gz"
    zstd_in_gzip.write_bytes(gzip.compress(_zstd_frames(_RECORD, ())))
    with pytest.raises(ValueError, match=re.escape(f"{zstd_in_gzip}: zstd-compressed inside gzip, not")):
        open_data(zstd_in_gzip)
    gzip_in_zstd = tmp_path / "b.jsonl.zst"
    gzip_in_zstd.write_bytes(_zstd_frames(gzip.compress(_RECORD), ()))
    with pytest.raises(ValueError, match=re.escape(f"{gzip_in_zstd}: gzip-compressed inside zstd, not")):
        open_data(gzip_in_zstd)


def test_a_zstd_file_without_zstandard_installed_is_refused_saying_how_to_install_it(tmp_path, monkeypatch):
    path = tmp_path / "shard.jsonl.zst"
    path.write_bytes(_zstd_frames(_RECORD, ()))
    monkeypatch.setattr(files, "zstandard", None)
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: zstd-compressed, and zstandard is not installed: ")
    ):
        open_data(path)


def test_read_code_refuses_a_tar_file_named_jsonl(tmp_path):
    """The reader of JSON lines goes through the same probe: a tar archive is named, not parsed as JSON."""
    path = tmp_path / "functions.jsonl"
    path.write_bytes(_tar(_RECORD))
    with pytest.raises(ValueError, match=re.escape(f"{path}: a tar archive, not a text file")):
        read_code(path)


def test_a_file_that_only_resembles_an_archive_is_read_as_text(tmp_path):
    """Text whose bytes 257.. are not ``ustar`` (here: shorter than 257 bytes, and exactly 262 bytes) is
    returned whole, from the start."""
    for size in (10, 262):
        data = (b"ustar " * 60)[:size]
        path = tmp_path / f"text{size}.txt"
        path.write_bytes(data)
        with open_data(path) as handle:
            assert handle.read() == data


def test_a_truncated_gzip_header_read_names_the_file(tmp_path):
    """A gzip file cut before its first 262 decompressed bytes fails in the probe itself: the error names the
    file (no line: none was read)."""
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(bytes(range(256)) * 8)[:40])
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: the compressed data is truncated or corrupt: ")
    ) as caught:
        open_data(path)
    assert "after line" not in str(caught.value)


@pytest.mark.parametrize(
    ("data", "line", "column"),
    [
        (b"\xe9abc", 1, 1),  # at the very start
        (b"\n\xe9", 2, 1),  # right after a newline at offset 0
        (b"a\nbb\ncc\xe9\n", 3, 3),  # the last newline before the byte decides the column
        (b"caf\xe9\nok\n", 1, 4),  # a newline after the byte does not count
    ],
)
def test_utf8_text_names_the_line_column_and_byte(data, line, column):
    """Line and column (both from 1) of the first byte that is not UTF-8, counted by hand."""
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"settings.toml: line {line}, column {column}: "
            "byte 0xe9 is not valid UTF-8 (save the file as UTF-8)"
        ),
    ):
        utf8_text(data, "settings.toml")


def test_utf8_text_drops_a_leading_byte_order_mark_only():
    assert utf8_text(b"\xef\xbb\xbfa = 1\n", "a.toml") == "a = 1\n"
    assert utf8_text("a\n\ufeffb".encode(), "a.toml") == "a\n\ufeffb"


@pytest.mark.parametrize("pack", [bytes, gzip.compress])
def test_open_data_starts_after_a_byte_order_mark(tmp_path, pack):
    """Every line reader (GLUE, JSON lines, Criteo) gets the first line without the BOM."""
    path = tmp_path / "data.tsv"
    path.write_bytes(pack(b"\xef\xbb\xbfsentence1\tlabel\nx\t1\n"))
    with open_data(path) as handle:
        assert handle.read() == b"sentence1\tlabel\nx\t1\n"


def test_utf8_text_decodes_valid_text():
    """Valid UTF-8 (two- and three-byte characters) is decoded as it is."""
    assert utf8_text("é€ x\n".encode(), "a.toml") == "é€ x\n"


def test_a_file_that_cannot_be_opened_is_named_with_the_reason(tmp_path, monkeypatch):
    """No permission (as for another user; root ignores the mode bits, so ``open`` is made to refuse) or a
    folder where a file is expected: ``ValueError`` naming the file and the reason, not an ``OSError``
    traceback."""
    import builtins

    locked = tmp_path / "train.tsv"
    locked.write_bytes(b"a\tb\n")
    real_open = builtins.open

    def refusing(file, *args, **kwargs):
        if str(file) == str(locked):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    denied = re.escape(f"{locked}: cannot be read (Permission denied)")
    with pytest.raises(ValueError, match=f"^{denied}$"):
        open_data(locked)
    monkeypatch.setattr(builtins, "open", real_open)
    folder = re.escape(f"{tmp_path}: cannot be read (Is a directory)")
    with pytest.raises(ValueError, match=f"^{folder}$"):
        open_data(tmp_path)


def test_bytes_after_the_gzip_data_are_named_as_such_not_as_a_line(tmp_path):
    """Whole gzip data followed by other bytes (a damaged copy, two files joined): every line was
    decompressed, so the error says what follows the data instead of a line number that no reader saw.
    Zero bytes after it (a block device's padding) are read past, as gzip itself does."""
    lines = b"".join(b'{"code": "x = %d"}\n' % i for i in range(200))
    path = tmp_path / "joined.jsonl.gz"
    path.write_bytes(gzip.compress(lines) + b"garbage!!")
    with pytest.raises(ValueError, match=re.escape(f"{path}: bytes that are not gzip data follow")) as caught:
        read_code(path)
    assert "after line" not in str(caught.value)
    path.write_bytes(gzip.compress(lines) + bytes(512))
    documents, skipped = read_code(path)
    assert (len(documents), skipped) == (200, [])


class _RecordingReader:
    """A binary file whose ``readline`` records the length of every piece it returns."""

    def __init__(self, data: bytes) -> None:
        self.file = io.BytesIO(data)
        self.reads: list[int] = []

    def readline(self, size: int = -1) -> bytes:
        line = self.file.readline(size)
        self.reads.append(len(line))
        return line


def test_numbered_lines_holds_at_most_the_limit_of_a_long_line():
    """A line longer than ``max_line_bytes`` comes as its first ``max_line_bytes + 1`` bytes and is never
    read whole: every read of the file returns at most that many bytes; the following lines are intact."""
    data = b"first\n" + b"x" * 100_000 + b"\nlast\n"
    reader = _RecordingReader(data)
    lines = list(numbered_lines(reader, "lines.txt", max_line_bytes=10))
    assert lines == [(1, b"first\n"), (2, b"x" * 11), (3, b"last\n")]
    assert max(reader.reads) == 11
    whole = [len(raw) for _, raw in numbered_lines(io.BytesIO(data), "lines.txt")]
    assert whole == [6, 100_001, 5]
