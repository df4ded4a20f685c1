"""The Criteo loader on fixture files against a line-by-line Python parser; cache, split and batches."""

import bz2
import gzip
import lzma
import math
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from comera.workloads.dlrm import criteo
from comera.workloads.dlrm.clicks import ClickData, collate_clicks
from comera.workloads.dlrm.criteo import (
    MIN_SAMPLES,
    MalformedLineError,
    load_criteo,
    parse_lines,
    split_by_line_order,
)

DATA = Path(__file__).parents[2] / "data"
SAMPLE = DATA / "criteo_sample.txt"


def _reference(path: Path, min_frequency: int = 1):
    """Labels, dense features and ids of ``path`` by splitting each line in Python."""
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    labels = np.array([int(row[0]) for row in rows])
    dense = np.array([[math.log1p(max(int(v), 0)) if v else 0.0 for v in row[1:14]] for row in rows])
    raw = [[int(v, 16) if v else None for v in row[14:]] for row in rows]
    ids = np.zeros((len(rows), 26), dtype=np.int64)
    cardinalities = []
    for column in range(26):
        values = [row[column] for row in raw if row[column] is not None]
        kept = sorted(v for v in set(values) if values.count(v) >= min_frequency)
        position = {v: i + 1 for i, v in enumerate(kept)}
        ids[:, column] = [position.get(row[column], 0) for row in raw]
        cardinalities.append(len(kept) + 1)
    return labels, dense, ids, tuple(cardinalities)


def _assert_matches(log, reference):
    labels, dense, ids, cardinalities = reference
    np.testing.assert_array_equal(log.data.labels, labels)
    np.testing.assert_allclose(log.data.dense, dense, rtol=1e-6)
    np.testing.assert_array_equal(log.data.ids, ids)
    assert log.cardinalities == cardinalities


def test_parse_equals_line_by_line_reference(tmp_path):
    log = load_criteo(SAMPLE, tmp_path)
    _assert_matches(log, _reference(SAMPLE))
    assert (log.read, log.skipped) == (21, 0)
    text = SAMPLE.read_text()
    assert "\t\t" in text and "\t-" in text  # the fixture has empty fields and negative integers


def test_crlf_file_parses_like_lf(tmp_path):
    crlf, lf = load_criteo(DATA / "criteo_crlf.txt", tmp_path), load_criteo(SAMPLE, tmp_path)
    for name in ("dense", "ids", "labels"):
        np.testing.assert_array_equal(getattr(crlf.data, name), getattr(lf.data, name))


@pytest.mark.parametrize("chunk_bytes", [1, 97, 1000])
def test_block_boundaries_do_not_matter(tmp_path, chunk_bytes):
    log = load_criteo(SAMPLE, tmp_path, chunk_bytes=chunk_bytes)
    _assert_matches(log, _reference(SAMPLE))


def test_frequency_threshold_shares_id_zero(tmp_path):
    log = load_criteo(SAMPLE, tmp_path, min_frequency=4)
    reference = _reference(SAMPLE, min_frequency=4)
    _assert_matches(log, reference)
    assert (
        any(rows < 7 for rows in reference[3])
        and (reference[2] == 0).sum() > (_reference(SAMPLE)[2] == 0).sum()
    )


def test_hash_size_takes_the_ids_modulo_and_caps_the_tables(tmp_path):
    log = load_criteo(SAMPLE, tmp_path, hash_size=5)
    _, _, ids, cardinalities = _reference(SAMPLE)
    np.testing.assert_array_equal(log.data.ids, ids % 5)
    assert log.cardinalities == tuple(min(rows, 5) for rows in cardinalities)
    assert any(rows > 5 for rows in cardinalities) and any(rows < 5 for rows in cardinalities)


def test_short_line_names_file_and_line(tmp_path):
    path = DATA / "criteo_short_line.txt"
    with pytest.raises(
        MalformedLineError, match=r"criteo_short_line\.txt:4: expected 40 tab-separated fields"
    ):
        load_criteo(path, tmp_path)
    log = load_criteo(path, tmp_path, skip_malformed=True)
    assert (log.read, log.skipped) == (4, 1)
    lines = SAMPLE.read_text().splitlines()
    expected = [int(lines[i].split("\t")[0]) for i in (0, 1, 2, 4)]
    np.testing.assert_array_equal(log.data.labels, expected)


def test_non_hex_category_names_column_and_line(tmp_path):
    path = DATA / "criteo_nonhex.txt"
    with pytest.raises(MalformedLineError, match=r"criteo_nonhex\.txt:3: column C7 is 'xyz12'"):
        load_criteo(path, tmp_path)
    assert load_criteo(path, tmp_path, skip_malformed=True).skipped == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2" + "\t" * 39, "column label is '2'"),
        ("1\t1x" + "\t" * 38, "column I1 is '1x'"),
        ("1\t--1" + "\t" * 38, "column I1 is '--1'"),
        ("\t" * 39 + "a", "column label is ''"),
        ("1" + "\t" * 14 + "1" * 16 + "\t" * 25, "at most 15 digits"),
        ("1\t" + "9" * 19 + "\t" * 38, "at most 18 characters"),
    ],
)
def test_bad_fields_are_named(text, message):
    with pytest.raises(MalformedLineError, match=message):
        parse_lines(text.encode(), path="x.txt", first_line=7)


@pytest.mark.parametrize("chunk_bytes", [1, 97, 1 << 23])
@pytest.mark.parametrize("skip_malformed", [False, True])
def test_blank_lines_are_passed_over_neither_read_nor_skipped(tmp_path, chunk_bytes, skip_malformed):
    lines = SAMPLE.read_text().splitlines(keepends=True)
    blanks = ["\n", " \t \x0b\x0c\n", "\r\n", "\t\t\n"]
    text = "".join(blanks[:2] + lines[:5] + blanks[2:] + lines[5:]) + "\n  "
    path = tmp_path / "blank.txt"
    path.write_text(text)
    log = load_criteo(path, tmp_path / "cache", chunk_bytes=chunk_bytes, skip_malformed=skip_malformed)
    _assert_matches(log, _reference(SAMPLE))
    assert (log.read, log.skipped) == (21, 0)


@pytest.mark.parametrize("pack", [bytes, gzip.compress])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_line(tmp_path, pack):
    path = tmp_path / "bom.txt"
    path.write_bytes(pack(b"\xef\xbb\xbf" + SAMPLE.read_bytes()))
    log = load_criteo(path, tmp_path / "cache")
    _assert_matches(log, _reference(SAMPLE))
    assert (log.read, log.skipped) == (21, 0)


def test_a_malformed_line_after_blank_lines_keeps_its_line_number():
    line = "1" + "\t" * 39 + "\n"
    with pytest.raises(MalformedLineError, match=r"x\.txt:5: column C26 is 'zz'"):
        parse_lines(f"\n{line}  \n{line}{line[:-1]}zz\n\n".encode(), path="x.txt")
    parsed = parse_lines(f"\n{line}\t\n{line}".encode(), skip_malformed=True)
    assert (parsed.labels.tolist(), parsed.skipped.tolist()) == ([1, 1], [])


def test_nothing_to_parse():
    parsed = parse_lines(b"")
    assert (
        parsed.labels.shape == (0,)
        and parsed.integers.shape == (0, 13)
        and parsed.categories.shape == (0, 26)
    )


def test_empty_file_gives_no_samples(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    log = load_criteo(empty, tmp_path / "cache")
    assert (log.read, len(log.data), log.cardinalities) == (0, 0, (1,) * 26)


def test_empty_and_negative_values():
    parsed = parse_lines(("0\t\t-5" + "\t7" * 11 + "\t" * 26 + "\n").encode())
    assert parsed.integers[0, :3].tolist() == [0, -5, 7]
    assert parsed.dense[0, :3].tolist() == [0.0, 0.0, pytest.approx(math.log(8.0))]
    assert parsed.categories[0].tolist() == [0] * 26


def test_cache_is_reused_and_equals_the_parse(tmp_path, monkeypatch):
    first = load_criteo(SAMPLE, tmp_path)
    in_memory = parse_lines(SAMPLE.read_bytes())
    np.testing.assert_array_equal(first.data.dense, in_memory.dense)
    np.testing.assert_array_equal(first.data.labels, in_memory.labels)

    def fail(*args, **kwargs):
        raise AssertionError("the cached file was parsed again")

    monkeypatch.setattr(criteo, "parse_lines", fail)
    again = load_criteo(SAMPLE, tmp_path)
    assert again.cache == first.cache and isinstance(again.data.ids, np.memmap)
    _assert_matches(again, _reference(SAMPLE))
    with pytest.raises(AssertionError, match="parsed again"):
        load_criteo(SAMPLE, tmp_path, min_frequency=2)  # other options: another cache entry
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.cache.name]


@pytest.mark.parametrize("name", ["meta.json", "ids.i32", "labels.u8"])
def test_a_damaged_cache_file_is_parsed_again_and_replaced(tmp_path, cache_damage, name, monkeypatch):
    folder = load_criteo(SAMPLE, tmp_path).cache
    cache_damage(folder / name)
    with cache_damage.rebuilt(folder / name):
        again = load_criteo(SAMPLE, tmp_path)
    assert again.cache == folder and (again.read, again.skipped) == (21, 0)
    _assert_matches(again, _reference(SAMPLE))
    monkeypatch.setattr(criteo, "parse_lines", lambda *args, **kwargs: pytest.fail("parsed again"))
    _assert_matches(load_criteo(SAMPLE, tmp_path), _reference(SAMPLE))
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_a_file_in_place_of_the_cache_folder_is_named(tmp_path):
    folder = load_criteo(SAMPLE, tmp_path).cache
    shutil.rmtree(folder)
    folder.write_text("")
    with pytest.raises(
        ValueError, match=rf"cache entry {re.escape(str(folder))} is not a folder.*; delete it$"
    ):
        load_criteo(SAMPLE, tmp_path)


def test_cache_key_follows_modification(tmp_path):
    path = tmp_path / "day_0"
    path.write_bytes(SAMPLE.read_bytes())
    first = load_criteo(path, tmp_path / "cache")
    path.write_bytes(b"".join(SAMPLE.read_bytes().splitlines(keepends=True)[:7]))
    second = load_criteo(path, tmp_path / "cache")
    assert second.cache != first.cache and second.read == 7


def test_split_by_line_order_follows_the_reference():
    for count in (0, 1, 7, 21, 100, 4_584_062):
        days = np.array_split(np.arange(count), 7)
        test, validation = np.array_split(days[6], 2)
        ranges = split_by_line_order(count)
        assert ranges["train"] == range(0, sum(d.size for d in days[:6]))
        assert list(ranges["test"][:5]) == test[:5].tolist() and len(ranges["test"]) == test.size
        assert list(ranges["validation"][:5]) == validation[:5].tolist()
        assert len(ranges["validation"]) == validation.size
    with pytest.raises(ValueError, match="count must be"):
        split_by_line_order(-1)


def test_min_samples_is_the_fewest_that_give_every_split_a_sample():
    assert all(len(rows) for rows in split_by_line_order(MIN_SAMPLES).values())
    assert not any(
        all(len(rows) for rows in split_by_line_order(count).values()) for count in range(MIN_SAMPLES)
    )


def test_splits_are_views_in_line_order(tmp_path):
    log = load_criteo(SAMPLE, tmp_path)
    splits = log.splits()
    assert [len(splits[n]) for n in ("train", "validation", "test")] == [18, 1, 2]
    np.testing.assert_array_equal(splits["test"].ids, log.data.ids[18:20])
    np.testing.assert_array_equal(splits["validation"].labels, log.data.labels[20:])


def test_collate_gathers_the_rows_of_the_handles(tmp_path):
    data = load_criteo(SAMPLE, tmp_path).data
    rows = [5, 0, 17, 3]
    batch = collate_clicks([data[i] for i in rows])
    assert batch.ids.dtype == torch.int64 and batch.ids.shape == (26, 4)
    np.testing.assert_array_equal(batch.ids.numpy(), np.asarray(data.ids)[rows].T)
    np.testing.assert_array_equal(batch.dense.numpy(), np.asarray(data.dense)[rows])
    assert batch.labels.dtype == torch.float32
    np.testing.assert_array_equal(batch.labels.numpy(), np.asarray(data.labels)[rows])
    contiguous = data.gather(np.arange(2, 9))
    np.testing.assert_array_equal(contiguous.ids.numpy(), np.asarray(data.ids)[2:9].T)
    other = ClickData(np.zeros((2, 13), np.float32), np.zeros((2, 26), np.int32), np.zeros(2))
    with pytest.raises(ValueError, match="one ClickData"):
        collate_clicks([data[0], other[1]])
    with pytest.raises(IndexError, match="index must be in"):
        data[21]


def test_batches_cover_every_row_once(tmp_path):
    data = load_criteo(SAMPLE, tmp_path).data
    seen = np.concatenate([b.labels.numpy() for b in data.batches(4)])
    np.testing.assert_array_equal(seen, data.labels)
    dense = torch.cat([b.dense for b in data.batches(5, shuffle=True, seed=3)])
    order = np.lexsort(dense.numpy().T)
    np.testing.assert_array_equal(
        dense.numpy()[order], np.asarray(data.dense)[np.lexsort(np.asarray(data.dense).T)]
    )
    assert sum(1 for _ in data.batches(4, drop_last=True)) == 5
    with pytest.raises(ValueError, match="batch_size must be"):
        next(data.batches(0))


def test_bad_options_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="min_frequency must be"):
        load_criteo(SAMPLE, tmp_path, min_frequency=0)
    with pytest.raises(ValueError, match="hash_size must be"):
        load_criteo(SAMPLE, tmp_path, hash_size=1)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_criteo(tmp_path / "missing.txt", tmp_path)


def test_a_gzip_file_is_read_as_its_text(tmp_path):
    packed = tmp_path / "day_0.gz"
    packed.write_bytes(gzip.compress(SAMPLE.read_bytes()))
    log, plain = load_criteo(packed, tmp_path / "cache", chunk_bytes=200), load_criteo(SAMPLE, tmp_path)
    assert log.read == plain.read and log.cardinalities == plain.cardinalities
    np.testing.assert_array_equal(log.data.ids, plain.data.ids)
    np.testing.assert_array_equal(log.data.dense, plain.data.dense)


def test_a_truncated_gzip_file_is_named(tmp_path):
    packed = gzip.compress(SAMPLE.read_bytes())
    path = tmp_path / "day_1.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(ValueError, match=r"day_1.gz: the compressed data is truncated or corrupt"):
        load_criteo(path, tmp_path / "cache", chunk_bytes=64)


def test_bytes_after_the_gzip_data_are_named_as_such(tmp_path):
    """A Criteo day file with bytes after its gzip data: named as such, not as corrupt "after line 0"."""
    path = tmp_path / "day_1.gz"
    path.write_bytes(gzip.compress(SAMPLE.read_bytes()) + b"garbage!!")
    with pytest.raises(ValueError, match=r"day_1.gz: bytes that are not gzip data follow") as caught:
        load_criteo(path, tmp_path / "cache", chunk_bytes=1 << 20)
    assert "after line" not in str(caught.value)


def _tar_of(path: Path, target: Path) -> Path:
    with tarfile.open(target, "w:gz") as archive:
        archive.add(path, arcname="train.txt")
    return target


@pytest.mark.parametrize(
    ("pack", "match"),
    [
        (lambda path, tmp: _tar_of(path, tmp / "dac.tar.gz"), r"dac.tar.gz: a tar archive inside gzip"),
        (
            lambda path, tmp: _written(tmp / "t.bz2", bz2.compress(path.read_bytes())),
            r"t.bz2: bzip2-compressed, not a text file",
        ),
        (lambda path, tmp: _written(tmp / "t.xz", lzma.compress(path.read_bytes())), r"t.xz: xz-compressed"),
    ],
)
def test_archives_and_other_compressions_are_named(tmp_path, pack, match):
    with pytest.raises(ValueError, match=match):
        load_criteo(pack(SAMPLE, tmp_path), tmp_path / "cache")


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
