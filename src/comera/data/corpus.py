"""The documents of a corpus on disk (``.txt`` files read whole, ``.jsonl(.gz|.zst)`` lines, ``.parquet``
rows), read one at a time in the order of a hash of their relative path, with their keys and the records
left out: what ``comera prepare`` tokenizes. Details: docs/llm.md, 'Bringing a corpus' ('What is read').
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from comera.data.files import check_data_path, without_bom
from comera.data.sources import (
    JSONL_SUFFIXES,
    MAX_LINE_BYTES,
    CodeDocument,
    SkippedDocument,
    check_whole_file,
    jsonl_documents,
    source_files,
)

__all__ = [
    "CORPUS_EXTENSIONS",
    "PARQUET_EXTRA",
    "TEXT_FIELD",
    "WHOLE_FILES",
    "SkipLog",
    "corpus_files",
    "corpus_inputs",
    "read_corpus",
]

CORPUS_EXTENSIONS = (".txt", ".parquet")
"""File endings read by default besides the JSON-lines ones (``.jsonl``, ``.jsonl.gz``)."""
WHOLE_FILES = (".txt",)
"""The endings of files read as one document each, by default."""
TEXT_FIELD = "text"
"""The JSON field and the Parquet column that hold a document's text, by default."""
PARQUET_EXTRA = "pip install 'comera[parquet]' (or pip install pyarrow)"
"""How to get the package that reads ``.parquet`` files."""
_PARQUET_BATCH_ROWS = 1024


class SkipLog:
    """Records left out while reading: every one counted by reason (and by split with ``split_by``), the first
    ``keep`` kept by key; usable as the ``skipped`` list of :func:`comera.data.sources.jsonl_documents`.
    """

    def __init__(self, keep: int = 1000, split_by: Callable[[str], str | None] | None = None) -> None:
        self.keep = keep
        self.split_by = split_by
        self.counts: Counter[str] = Counter()
        self.by_split: dict[str, Counter[str]] = {}
        self.entries: list[SkippedDocument] = []

    def append(self, entry: SkippedDocument) -> None:
        """Count ``entry``; keep it while fewer than ``keep`` are kept."""
        self.counts[entry.reason] += 1
        split = None if self.split_by is None else self.split_by(entry.key)
        if split is not None:
            self.by_split.setdefault(split, Counter())[entry.reason] += 1
        if len(self.entries) < self.keep:
            self.entries.append(entry)

    @property
    def total(self) -> int:
        """Records skipped in all."""
        return sum(self.counts.values())


def corpus_files(root: str | Path, whole_files: tuple[str, ...] = WHOLE_FILES) -> list[Path]:
    """The files of the corpus at ``root`` that are read, in reading order; ``whole_files``: the endings of
    files read as one document each (``.txt`` by default).

    Raises:
        FileNotFoundError: nothing is at ``root``. ValueError: it holds no file that is read, or is a symbolic
            link that loops or points at nothing (:func:`comera.data.files.check_data_path`).
    """
    root = check_data_path(root)
    files = source_files(root, (*whole_files, ".parquet"))
    if not files:
        endings = ", ".join([*whole_files, *JSONL_SUFFIXES, ".parquet"])
        raise ValueError(f"--data {root}: no {endings} file found; give one such file or a folder of them")
    return files


def _relative(root: Path, file: Path) -> str:
    return file.name if root.is_file() else file.relative_to(root).as_posix()


def corpus_inputs(root: str | Path, files: list[Path]) -> list[dict[str, object]]:
    """``[{"name": relative name, "bytes": size}]`` of ``files`` (from :func:`corpus_files`): what a
    preparation records of its inputs, to tell a resume over the same files from one over others."""
    root = Path(root)
    return [{"name": _relative(root, file), "bytes": file.stat().st_size} for file in files]


def _text_file(file: Path, relative: str, max_bytes: int) -> CodeDocument | SkippedDocument:
    check_whole_file(file, max_bytes)
    try:
        return CodeDocument(relative, without_bom(file.read_bytes()).decode("utf-8"))
    except UnicodeDecodeError:
        return SkippedDocument(relative, "not_utf8")
    except OSError:
        return SkippedDocument(relative, "unreadable")


def _parquet_documents(
    file: Path, relative: str, fields: tuple[str, ...], on_position: Callable[[int], None] | None
) -> Iterator[CodeDocument]:
    try:
        parquet = importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ImportError(
            f"--data: {file} is a Parquet file; reading it needs pyarrow: {PARQUET_EXTRA}"
        ) from None
    reader = parquet.ParquetFile(file)
    columns = reader.schema_arrow.names
    column = next((name for name in fields if name in columns), None)
    if column is None:
        raise ValueError(f"{file}: no {' or '.join(map(repr, fields))} column (columns: {columns})")
    size, rows = file.stat().st_size, max(1, reader.metadata.num_rows)
    row = 0
    for batch in reader.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[column]):
        for text in batch.column(0).to_pylist():
            row += 1
            yield CodeDocument(f"{relative}:{row}", text if isinstance(text, str) else "")
        if on_position is not None:
            on_position(size * row // rows)  # the rows read, as a share of the file's bytes


def read_corpus(
    root: str | Path,
    files: list[Path],
    skipped: SkipLog,
    *,
    skip_bad_lines: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
    whole_files: tuple[str, ...] = WHOLE_FILES,
    text_fields: tuple[str, ...] = (TEXT_FIELD,),
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[CodeDocument]:
    """The documents of ``files`` (from :func:`corpus_files` of ``root``), one at a time, in reading order;
    those left out are appended to ``skipped``.

    Args:
        root, files: the corpus and its files (:func:`corpus_files`).
        skipped: where records left out go.
        skip_bad_lines: skip and record a bad JSON line instead of raising.
        max_line_bytes: the longest JSON line read, and the largest file read whole.
        whole_files: endings of files read as one document each.
        text_fields: the JSON fields (and Parquet columns) that may hold a text, the first present used.
        on_bytes: called now and then with the bytes of the input files read so far, for a progress bar.

    Raises:
        ValueError: a bad JSON line without ``skip_bad_lines`` (file and line named), a file read whole larger
            than ``max_line_bytes`` (named), a damaged gzip file, a Parquet file without a text column.
            ImportError: a Parquet file without ``pyarrow``.
    """
    root = Path(root)
    done = 0
    for file in files:
        relative = _relative(root, file)
        size = file.stat().st_size if on_bytes is not None else 0
        within = None if on_bytes is None else (lambda position, done=done: on_bytes(done + position))
        if file.name.endswith(".parquet"):
            found: Iterator[CodeDocument] = _parquet_documents(file, relative, text_fields, within)
        elif file.name.endswith(whole_files) and not file.name.endswith(JSONL_SUFFIXES):
            document = _text_file(file, relative, max_line_bytes)
            found = iter([]) if isinstance(document, SkippedDocument) else iter([document])
            if isinstance(document, SkippedDocument):
                skipped.append(document)
        else:
            found = jsonl_documents(
                file, relative, skip_bad_lines, skipped, text_fields, max_line_bytes, within
            )
        for document in found:
            if document.text.strip():
                yield document
            else:
                skipped.append(SkippedDocument(document.key, "empty"))
        done += size
        if on_bytes is not None:
            on_bytes(done)
