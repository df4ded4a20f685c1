"""Criteo click logs (Kaggle ``train.txt``, Terabyte ``day_N``, plain or gzip): streamed vectorised parsing as
the DLRM reference processes them, id maps, the reference's split by line order, and a memmap cache.
Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from comera.checks import check_int
from comera.data.cache import building_folder, read_entry, read_json
from comera.data.files import open_data, reading
from comera.workloads.dlrm.clicks import ClickData

__all__ = [
    "KAGGLE_CARDINALITIES",
    "NUM_INTEGER",
    "NUM_CATEGORICAL",
    "COLUMN_NAMES",
    "MalformedLineError",
    "ParsedLines",
    "CriteoLog",
    "parse_lines",
    "read_blocks",
    "load_criteo",
    "check_criteo_options",
    "split_by_line_order",
    "SPLITS",
    "MIN_SAMPLES",
]

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
_FIELDS = 1 + NUM_INTEGER + NUM_CATEGORICAL
COLUMN_NAMES = ("label", *(f"I{i}" for i in range(1, 14)), *(f"C{i}" for i in range(1, 27)))
SPLITS = ("train", "validation", "test")
# Rows of the 26 categorical tables of Criteo Kaggle as the DLRM reference counts them (its ``ln_emb``).
KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
_MAX_INT_DIGITS = 18
_MAX_HEX_DIGITS = 15
_CACHE_FORMAT = 3
_MAP_BLOCK_ROWS = 1 << 18
_TAB, _LF, _CR, _MINUS = 9, 10, 13, ord("-")
# bytes that a blank line may hold besides its newline: space, tab, \v, \f and a lone \r
_BLANK = np.zeros(256, dtype=bool)
_BLANK[list(b" \t\n\v\f\r")] = True

# digit value of each byte, decimal in rows 0..255 and hexadecimal in rows 256..511 (index: byte | hex << 8);
# 255 for a byte that is no digit of the base, 0 for the separators (they sit after each field's last digit)
_DIGIT = np.full(512, 255, dtype=np.uint8)
for _base, _digits in ((0, b"0123456789"), (256, b"0123456789abcdef"), (256, b"0123456789ABCDEF")):
    _DIGIT[_base + np.frombuffer(_digits, np.uint8).astype(np.int32)] = np.arange(len(_digits))
_DIGIT[[_TAB, _LF, 256 + _TAB, 256 + _LF]] = 0
# base ** k for k = position from the field's end: 10 ** k in rows 0..31, 16 ** k in rows 32..63
_POWER = np.zeros(64, dtype=np.uint64)
_POWER[: _MAX_INT_DIGITS + 1] = [10**k for k in range(_MAX_INT_DIGITS + 1)]
_POWER[32 : 33 + _MAX_HEX_DIGITS] = [16**k for k in range(_MAX_HEX_DIGITS + 1)]
# column kind: 0 label, 1 integer, 2 categorical
_KIND = np.array([0] + [1] * NUM_INTEGER + [2] * NUM_CATEGORICAL, dtype=np.uint8)
# longest field: a 0/1 label; an integer of 18 characters (a minus sign included), so it fits in int64
_MAX_LENGTH = np.array([1] + [_MAX_INT_DIGITS] * NUM_INTEGER + [_MAX_HEX_DIGITS] * NUM_CATEGORICAL)


class MalformedLineError(ValueError):
    """A line of a Criteo file that does not follow the format; the message names file and line."""


@dataclass(frozen=True)
class ParsedLines:
    """Parsed lines: ``labels`` ``(L,)`` uint8, ``integers`` ``(L, 13)`` int64 (empty -> 0), ``categories``
    ``(L, 26)`` uint64 (hexadecimal value + 1, 0 for empty), ``skipped`` line numbers left out."""

    labels: np.ndarray
    integers: np.ndarray
    categories: np.ndarray
    skipped: np.ndarray

    @property
    def dense(self) -> np.ndarray:
        """``log(1 + max(x, 0))`` of the integers, ``(L, 13)`` float32."""
        return np.log1p(np.maximum(self.integers, 0).astype(np.float64)).astype(np.float32)


def _fail(path: str, line: int, message: str) -> MalformedLineError:
    return MalformedLineError(f"{path}:{line}: {message}")


def _line_bytes(data: np.ndarray, ends: np.ndarray, line: int) -> str:
    start = 0 if line == 0 else int(ends[line - 1]) + 1
    return bytes(data[start : ends[line]]).decode("latin-1")


def parse_lines(
    buffer: bytes, *, path: str = "<bytes>", first_line: int = 1, skip_malformed: bool = False
) -> ParsedLines:
    """Parse complete lines of a Criteo file (``buffer`` may lack the final newline).

    Args:
        buffer: the bytes of whole lines.
        path, first_line: file name and number of the buffer's first line, for messages.
        skip_malformed: leave malformed lines out (their numbers in ``skipped``) instead of raising.

    Raises:
        MalformedLineError: the first malformed line, naming ``path`` and its line number.
    """
    data = np.frombuffer(buffer, dtype=np.uint8)
    if data.size and data[-1] != _LF:
        data = np.append(data, np.uint8(_LF))
    carriage = np.flatnonzero((data[:-1] == _CR) & (data[1:] == _LF))
    if carriage.size:
        data = np.delete(data, carriage)
    ends = np.flatnonzero(data == _LF)
    if ends.size == 0:
        return _parse_fields(data, ends, np.zeros(0, np.int64), np.zeros(0, np.int64), path, skip_malformed)
    numbers = first_line + np.arange(ends.size)
    data, ends, numbers = _drop_lines(data, ends, numbers, _blank_lines(data, ends))
    tabs_per_line = np.bincount(np.searchsorted(ends, np.flatnonzero(data == _TAB)), minlength=ends.size)
    wrong = np.flatnonzero(tabs_per_line != _FIELDS - 1)
    skipped = numbers[wrong]
    if wrong.size:
        if not skip_malformed:
            line = int(wrong[0])
            raise _fail(
                path,
                int(numbers[line]),
                f"expected {_FIELDS} tab-separated fields (label, {NUM_INTEGER} integers, {NUM_CATEGORICAL} "
                f"categories), got {tabs_per_line[line] + 1}: {_line_bytes(data, ends, line)[:200]!r}",
            )
        data, ends, numbers = _drop_lines(data, ends, numbers, tabs_per_line != _FIELDS - 1)
    return _parse_fields(data, ends, numbers, skipped, path, skip_malformed)


def _blank_lines(data: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per line (``ends``: its newline positions in ``data``), whether it holds only blank bytes."""
    visible = np.flatnonzero(~_BLANK[data])
    return np.bincount(np.searchsorted(ends, visible), minlength=ends.size) == 0


def _drop_lines(
    data: np.ndarray, ends: np.ndarray, numbers: np.ndarray, drop: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(data, ends, numbers)`` without the lines where ``drop`` is True."""
    if not drop.any():
        return data, ends, numbers
    lengths = np.diff(np.concatenate(([-1], ends)))
    data = data[np.repeat(~drop, lengths)]
    return data, np.flatnonzero(data == _LF), numbers[~drop]


def _parse_fields(
    data: np.ndarray, ends: np.ndarray, numbers: np.ndarray, skipped: np.ndarray, path: str, skip: bool
) -> ParsedLines:
    """Values of lines that all have 40 fields: ``data`` their bytes, ``ends`` the newline positions."""
    lines = ends.size
    if lines == 0:
        empty = np.zeros((0, _FIELDS), dtype=np.uint64)
        return ParsedLines(
            np.zeros(0, np.uint8),
            empty[:, :NUM_INTEGER].astype(np.int64),
            empty[:, :NUM_CATEGORICAL],
            skipped,
        )
    field_end = np.flatnonzero((data == _TAB) | (data == _LF)).astype(np.int32)  # (lines * 40,)
    field_start = np.concatenate(([0], field_end[:-1] + 1)).astype(np.int32)
    length = field_end - field_start
    column = np.tile(np.arange(_FIELDS, dtype=np.uint8), lines)
    kind = _KIND[column]
    # per byte (separators included, each belonging to the field it ends): its field, base and digit
    field_of_byte = np.repeat(np.arange(field_end.size, dtype=np.int32), length + 1)
    hexadecimal = (kind == 2)[field_of_byte]
    digit = _DIGIT[data | (hexadecimal.astype(np.int32) << 8)]
    negative = (kind == 1) & (length >= 2) & (data[np.minimum(field_start, data.size - 1)] == _MINUS)
    digit[field_start[negative]] = 0
    bad_field = np.zeros(field_end.size, dtype=bool)
    bad_field[field_of_byte[digit == 255]] = True
    bad_field |= length > _MAX_LENGTH[column]
    bad_field |= (kind == 0) & (length != 1)
    # value of each field: sum of digit * base ** (position from the field's end), by a wrapping cumsum;
    # a separator's position is -1 (clipped to 0, its digit is 0); bad bytes give garbage on flagged lines
    position = field_end[field_of_byte] - np.arange(data.size, dtype=np.int32) - 1
    power = _POWER[np.clip(position, 0, 31) | (hexadecimal.astype(np.int32) << 5)]
    contribution = digit.astype(np.uint64) * power
    total = np.concatenate(([0], np.cumsum(contribution, dtype=np.uint64))).astype(np.uint64)
    value = (total[field_end] - total[field_start]).reshape(lines, _FIELDS)
    bad_field = bad_field.reshape(lines, _FIELDS)
    bad_field[:, 0] |= value[:, 0] > 1
    bad_line = bad_field.any(axis=1)
    if bad_line.any():
        if not skip:
            line = int(np.flatnonzero(bad_line)[0])
            col = int(np.flatnonzero(bad_field[line])[0])
            index = line * _FIELDS + col
            text = bytes(data[field_start[index] : field_end[index]]).decode("latin-1")
            expected = (
                "0 or 1",
                f"an integer of at most {_MAX_INT_DIGITS} characters or empty",
                f"a hexadecimal number of at most {_MAX_HEX_DIGITS} digits or empty",
            )[_KIND[col]]
            raise _fail(
                path, int(numbers[line]), f"column {COLUMN_NAMES[col]} is {text[:40]!r}, expected {expected}"
            )
        skipped = np.sort(np.concatenate((skipped, numbers[bad_line])))
        value, negative = value[~bad_line], negative.reshape(lines, _FIELDS)[~bad_line]
        length = length.reshape(lines, _FIELDS)[~bad_line]
    else:
        negative, length = negative.reshape(lines, _FIELDS), length.reshape(lines, _FIELDS)
    integers = value[:, 1 : 1 + NUM_INTEGER].astype(np.int64)
    integers = np.where(negative[:, 1 : 1 + NUM_INTEGER], -integers, integers)
    categories = np.where(length[:, 1 + NUM_INTEGER :] > 0, value[:, 1 + NUM_INTEGER :] + np.uint64(1), 0)
    return ParsedLines(value[:, 0].astype(np.uint8), integers, categories.astype(np.uint64), skipped)


def _read(handle, chunk_bytes: int, path: str | os.PathLike, line: int) -> bytes:
    with reading(path, f"after line {line - 1}"):
        return handle.read(chunk_bytes)


def read_blocks(path: str | os.PathLike, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(number of the first line, bytes of whole lines)`` blocks of about ``chunk_bytes`` from ``path``
    (gzip decompressed; :func:`comera.data.files.open_data`)."""
    line, rest = 1, b""
    with open_data(path) as handle:
        while block := _read(handle, chunk_bytes, path, line):
            block = rest + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:
                rest = block
                continue
            yield line, block[:cut]
            line += block.count(b"\n", 0, cut)
            rest = block[cut:]
    if rest.strip(b"\r"):
        yield line, rest


class _ValueCounts:
    """Counts of uint64 values over a stream: sorted ``(values, counts)`` runs merged like a binary counter,
    so each value is re-sorted O(log chunks) times."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, values: np.ndarray) -> None:
        self.runs.append(np.unique(values, return_counts=True))
        while len(self.runs) >= 2 and self.runs[-1][0].size * 2 >= self.runs[-2][0].size:
            self.runs[-2:] = [_merge_runs(self.runs[-2:])]

    def total(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.runs:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        return _merge_runs(self.runs)


def _merge_runs(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    values, group = np.unique(np.concatenate([v for v, _ in runs]), return_inverse=True)
    counts = np.bincount(group, weights=np.concatenate([c for _, c in runs]).astype(np.float64))
    return values, counts.astype(np.int64)


@dataclass(frozen=True)
class CriteoLog:
    """A parsed Criteo file: every sample as a :class:`ClickData` (memmaps of the cache) and its tables.

    Attributes:
        data: all samples in line order.
        cardinalities: rows of each categorical table (26 ints).
        read: samples read; skipped: malformed lines left out.
        cache: the cache folder holding the arrays.
    """

    data: ClickData
    cardinalities: tuple[int, ...]
    read: int
    skipped: int
    cache: Path

    def splits(self) -> dict[str, ClickData]:
        """``{"train", "validation", "test"}`` views by :func:`split_by_line_order`."""
        return {name: self.data.rows(r.start, r.stop) for name, r in split_by_line_order(self.read).items()}


MIN_SAMPLES = 2 * 7
"""The fewest samples :func:`split_by_line_order` gives every split at least one of: the 7th "day" holds
``count // 7`` of them and is halved into test and validation."""


def split_by_line_order(count: int) -> dict[str, range]:
    """Row ranges of the reference split of ``count`` samples."""
    check_int(count, "count", 0)
    days = np.array_split(np.arange(count), 7)
    train_end = sum(day.size for day in days[:6])
    test, validation = np.array_split(days[6], 2)
    return {
        "train": range(0, train_end),
        "validation": range(train_end + test.size, train_end + test.size + validation.size),
        "test": range(train_end, train_end + test.size),
    }


def check_criteo_options(min_frequency: object, hash_size: object) -> None:
    """``ValueError`` naming a ``min_frequency`` below 1 or a ``hash_size`` outside ``[2, 2**31 - 1]``."""
    check_int(min_frequency, "min_frequency", 1)
    if hash_size is not None and (
        isinstance(hash_size, bool) or not isinstance(hash_size, int) or not 2 <= hash_size < 2**31
    ):
        raise ValueError(f"hash_size must be None or an int in [2, 2**31 - 1], got {hash_size!r}")


def _cache_key(path: Path, options: dict) -> str:
    stat = path.stat()
    source = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    text = json.dumps({"format": _CACHE_FORMAT, "source": source, "options": options}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_criteo(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike,
    *,
    min_frequency: int = 1,
    hash_size: int | None = None,
    skip_malformed: bool = False,
    chunk_bytes: int = 1 << 23,
) -> CriteoLog:
    """Parse a Criteo file into the cache (first call) or open the cached arrays (later calls).

    Args:
        path: a Kaggle ``train.txt`` or Terabyte ``day_N`` file, or a gzip of one (``day_N.gz``).
        cache_dir: where the parsed arrays are kept (one sub-folder per file and options).
        min_frequency: values seen fewer times share id 0 with empty fields.
        hash_size: cap every table at this many rows: the mapped ids are taken modulo ``hash_size`` (the
            reference's ``max_ind_range``).
        skip_malformed: leave malformed lines out (counted in ``skipped``) instead of raising.
        chunk_bytes: size of the text blocks parsed at once.

    Raises:
        FileNotFoundError: ``path`` does not exist. MalformedLineError: a malformed line (file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Criteo file not found")
    check_criteo_options(min_frequency, hash_size)
    check_int(chunk_bytes, "chunk_bytes", 1)
    options = {"min_frequency": min_frequency, "hash_size": hash_size, "skip_malformed": skip_malformed}
    folder = Path(cache_dir) / f"criteo-{path.name}-{_cache_key(path, options)}"
    log = read_entry(folder, _open_cache, folder=True)
    if log is None:
        _build_cache(path, folder, options, chunk_bytes)
        log = _open_cache(folder)
    return log


def _build_cache(path: Path, folder: Path, options: dict, chunk_bytes: int) -> None:
    """Parse ``path`` into a temporary folder next to ``folder``, then put it in place
    (:func:`comera.data.cache.building_folder`)."""
    with building_folder(folder) as work:
        counts = [_ValueCounts() for _ in range(NUM_CATEGORICAL)]
        read = skipped = 0
        with (
            open(work / "dense.f32", "wb") as dense,
            open(work / "labels.u8", "wb") as labels,
            open(work / "raw.u64", "wb") as raw,
        ):
            for first_line, block in read_blocks(path, chunk_bytes):
                parsed = parse_lines(
                    block, path=str(path), first_line=first_line, skip_malformed=options["skip_malformed"]
                )
                parsed.dense.tofile(dense)
                parsed.labels.tofile(labels)
                parsed.categories.tofile(raw)
                for column, counter in enumerate(counts):
                    counter.add(parsed.categories[:, column])
                read += parsed.labels.size
                skipped += parsed.skipped.size
        cardinalities = _map_ids(work, counts, read, options["min_frequency"], options["hash_size"])
        meta = {"rows": read, "skipped": skipped, "cardinalities": cardinalities, "source": str(path)}
        (work / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _map_ids(
    work: Path, counts: list[_ValueCounts], rows: int, min_frequency: int, hash_size: int | None
) -> list[int]:
    """Write ``ids.i32`` from ``raw.u64`` with per-column maps (ids modulo ``hash_size`` if given); returns
    the table sizes."""
    kept = []
    for counter in counts:
        values, count = counter.total()
        kept.append(values[(count >= min_frequency) & (values != 0)])
    if rows:
        raw = np.memmap(work / "raw.u64", dtype=np.uint64, mode="r", shape=(rows, NUM_CATEGORICAL))
        ids = np.memmap(work / "ids.i32", dtype=np.int32, mode="w+", shape=(rows, NUM_CATEGORICAL))
        for start in range(0, rows, _MAP_BLOCK_ROWS):
            values = raw[start : start + _MAP_BLOCK_ROWS]
            for column, keys in enumerate(kept):
                mapped = _lookup(keys, values[:, column])
                ids[start : start + _MAP_BLOCK_ROWS, column] = mapped % hash_size if hash_size else mapped
        ids.flush()
        del raw, ids
    else:
        (work / "ids.i32").touch()
    (work / "raw.u64").unlink()
    return [min(keys.size + 1, hash_size or keys.size + 1) for keys in kept]


def _lookup(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Ids of ``values`` in sorted ``keys``: position + 1 where present, else 0."""
    if keys.size == 0:
        return np.zeros(values.shape, dtype=np.int32)
    where = np.searchsorted(keys, values)
    found = keys[np.minimum(where, keys.size - 1)] == values
    return np.where(found, where + 1, 0).astype(np.int32)


def _open_cache(folder: Path) -> CriteoLog:
    """The parsed log in the cache folder ``folder``; ``ValueError`` naming the file that is damaged."""
    meta = _read_meta(folder / "meta.json")
    rows = meta["rows"]

    def array(name: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        file = folder / name
        size, expected = file.stat().st_size, int(np.prod(shape)) * np.dtype(dtype).itemsize
        if size != expected:
            raise ValueError(f"{file} holds {size} bytes where {rows} rows take {expected}")
        if rows == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(file, dtype=dtype, mode="r", shape=shape)

    data = ClickData(
        array("dense.f32", np.float32, (rows, NUM_INTEGER)),
        array("ids.i32", np.int32, (rows, NUM_CATEGORICAL)),
        array("labels.u8", np.uint8, (rows,)),
    )
    return CriteoLog(data, tuple(meta["cardinalities"]), rows, meta["skipped"], folder)


def _read_meta(file: Path) -> dict:
    """The ``meta.json`` of a cache folder; ``ValueError`` naming it where it is not one."""
    meta = read_json(file)
    fields = meta if isinstance(meta, dict) else {}
    cardinalities = fields.get("cardinalities")
    if not (
        _is_count(fields.get("rows"))
        and _is_count(fields.get("skipped"))
        and isinstance(cardinalities, list)
        and len(cardinalities) == NUM_CATEGORICAL
        and all(_is_count(rows, 1) for rows in cardinalities)
    ):
        raise ValueError(f"{file} does not describe a parsed Criteo file")
    return fields


def _is_count(value: object, least: int = 0) -> bool:
    return type(value) is int and value >= least
