"""The documents of a corpus on disk, read one at a time: what ``comera prepare`` tokenizes.

A corpus is a file or a folder of

- ``.txt`` files: one document each (read whole, so a document's size bounds the memory, not the corpus's);
- ``.jsonl`` / ``.jsonl.gz`` files: one document per line, its ``text`` field
  (:func:`comera.data.sources.jsonl_documents`; a bad line raises ``ValueError`` naming file and line, or is
  skipped and recorded with ``skip_bad_lines``);
- ``.parquet`` files: one document per row of the ``text`` column, read a row group at a time; needs
  ``pyarrow`` (``pip install 'comera[parquet]'``).

Files are read in the order of a hash of their relative path (:func:`comera.data.sources.source_files`),
lines and rows in file order. Keys (which decide the split, :func:`comera.data.sources.split_of`): a ``.txt``
file's relative path, a JSON line's ``repo/path`` when both fields are there else ``file:line``, a Parquet
row's ``file:row`` (rows from 1). A document whose text is blank is skipped (reason ``"empty"``), as is a
``.txt`` file that is not UTF-8 (``"not_utf8"``) or cannot be read (``"unreadable"``).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from comera.data.files import without_bom
from comera.data.sources import (
    MAX_LINE_BYTES,
    CodeDocument,
    SkippedDocument,
    jsonl_documents,
    source_files,
)

__all__ = [
    "CORPUS_EXTENSIONS",
    "PARQUET_EXTRA",
    "TEXT_FIELD",
    "SkipLog",
    "corpus_files",
    "corpus_inputs",
    "read_corpus",
]

CORPUS_EXTENSIONS = (".txt", ".parquet")
"""File endings read besides the JSON-lines ones (``.jsonl``, ``.jsonl.gz``)."""
TEXT_FIELD = "text"
"""The JSON field and the Parquet column that hold a document's text."""
PARQUET_EXTRA = "pip install 'comera[parquet]' (or pip install pyarrow)"
"""How to get the package that reads ``.parquet`` files."""
_PARQUET_BATCH_ROWS = 1024


class SkipLog:
    """Records left out while reading: every one counted by reason, the first ``keep`` kept by key.

    Used as the ``skipped`` list of :func:`comera.data.sources.jsonl_documents` (it has ``append``), so a
    corpus with millions of bad lines does not hold them all.
    """

    def __init__(self, keep: int = 1000) -> None:
        self.keep = keep
        self.counts: Counter[str] = Counter()
        self.entries: list[SkippedDocument] = []

    def append(self, entry: SkippedDocument) -> None:
        """Count ``entry``; keep it while fewer than ``keep`` are kept."""
        self.counts[entry.reason] += 1
        if len(self.entries) < self.keep:
            self.entries.append(entry)

    @property
    def total(self) -> int:
        """Records skipped in all."""
        return sum(self.counts.values())


def corpus_files(root: str | Path) -> list[Path]:
    """The files of the corpus at ``root`` that are read (module docstring), in reading order.

    Raises:
        FileNotFoundError: nothing is at ``root``. ValueError: it holds no file that is read.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"--data {root}: no such file or folder")
    files = source_files(root, CORPUS_EXTENSIONS)
    if not files:
        raise ValueError(
            f"--data {root}: no .txt, .jsonl, .jsonl.gz or .parquet file found; give one such file or a "
            "folder of them"
        )
    return files


def _relative(root: Path, file: Path) -> str:
    return file.name if root.is_file() else file.relative_to(root).as_posix()


def corpus_inputs(root: str | Path, files: list[Path]) -> list[dict[str, object]]:
    """``[{"name": relative name, "bytes": size}]`` of ``files`` (from :func:`corpus_files`): what a
    preparation records of its inputs, to tell a resume over the same files from one over others."""
    root = Path(root)
    return [{"name": _relative(root, file), "bytes": file.stat().st_size} for file in files]


def _text_file(file: Path, relative: str) -> CodeDocument | SkippedDocument:
    try:
        return CodeDocument(relative, without_bom(file.read_bytes()).decode("utf-8"))
    except UnicodeDecodeError:
        return SkippedDocument(relative, "not_utf8")
    except OSError:
        return SkippedDocument(relative, "unreadable")


def _parquet_documents(file: Path, relative: str) -> Iterator[CodeDocument]:
    try:
        parquet = importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ImportError(
            f"--data: {file} is a Parquet file; reading it needs pyarrow: {PARQUET_EXTRA}"
        ) from None
    reader = parquet.ParquetFile(file)
    columns = reader.schema_arrow.names
    if TEXT_FIELD not in columns:
        raise ValueError(f"{file}: no {TEXT_FIELD!r} column (columns: {columns})")
    row = 0
    for batch in reader.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[TEXT_FIELD]):
        for text in batch.column(0).to_pylist():
            row += 1
            yield CodeDocument(f"{relative}:{row}", text if isinstance(text, str) else "")


def read_corpus(
    root: str | Path,
    files: list[Path],
    skipped: SkipLog,
    *,
    skip_bad_lines: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Iterator[CodeDocument]:
    """The documents of ``files`` (from :func:`corpus_files` of ``root``), one at a time, in reading order;
    those left out are appended to ``skipped`` (module docstring).

    Raises:
        ValueError: a bad JSON line without ``skip_bad_lines`` (file and line named), a damaged gzip file, a
            Parquet file without a ``text`` column. ImportError: a Parquet file without ``pyarrow``.
    """
    root = Path(root)
    for file in files:
        relative = _relative(root, file)
        if file.name.endswith(".parquet"):
            found: Iterator[CodeDocument] = _parquet_documents(file, relative)
        elif file.name.endswith(".txt"):
            document = _text_file(file, relative)
            if isinstance(document, SkippedDocument):
                skipped.append(document)
                continue
            found = iter([document])
        else:
            found = jsonl_documents(file, relative, skip_bad_lines, skipped, (TEXT_FIELD,), max_line_bytes)
        for document in found:
            if document.text.strip():
                yield document
            else:
                skipped.append(SkippedDocument(document.key, "empty"))
