"""Text documents read from source files, JSON-lines corpora or, by default, the running Python's standard
library, with read caps, and their deterministic train/validation split by a hash of each document's key
(:func:`split_of`). Details: docs/llm.md, 'Data' and 'Bringing a corpus'.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from comera.checks import check_int
from comera.data.files import check_regular_file, numbered_lines, open_data, without_bom

__all__ = [
    "DEFAULT_EXTENSIONS",
    "TEXT_FIELDS",
    "JSONL_SUFFIXES",
    "MAX_LINE_BYTES",
    "check_whole_file",
    "SKIP_REASONS",
    "CodeDocument",
    "SkippedDocument",
    "default_source_dir",
    "documents_digest",
    "jsonl_documents",
    "read_code",
    "read_counts",
    "require_documents",
    "source_files",
    "split_of",
]

DEFAULT_EXTENSIONS = (".py",)
TEXT_FIELDS = ("code", "original_string")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
"""The names of JSON-lines files (plain, gzip or zstd; the compression is found by content whatever the
name)."""
MAX_LINE_BYTES = 8 * 2**20
"""The longest document read (8 MiB): a JSON line (its end of line included) or a file read whole. A document
of millions of tokens is no training text, and one such document cost minutes and gigabytes to tokenize (a
50 MB JSON line: about two minutes and 9 GB; a 50 MB ``.txt`` file: six minutes and 10.4 GiB); longer lines
are bad lines, longer files are refused (:func:`read_code`, :func:`check_whole_file`)."""
_POSITION_LINES = 64
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CodeDocument:
    """One text to train on; ``key`` decides its split."""

    key: str
    text: str


SKIP_REASONS = ("not_utf8", "unreadable", "bad_line", "empty")


@dataclass(frozen=True)
class SkippedDocument:
    """A file, JSON line or empty text left out; ``key`` is its split key, ``reason`` one of
    :data:`SKIP_REASONS`."""

    key: str
    reason: str


def read_counts(documents: Sequence[CodeDocument], skipped: Sequence[SkippedDocument]) -> dict[str, int]:
    """``{"read": n, "skipped": k}`` plus ``"skipped_<reason>"`` for each of :data:`SKIP_REASONS`."""
    counts = {"read": len(documents), "skipped": len(skipped)}
    for reason in SKIP_REASONS:
        counts[f"skipped_{reason}"] = sum(entry.reason == reason for entry in skipped)
    return counts


def _unit_hash(*parts: object) -> float:
    """A fraction in ``[0, 1)`` from SHA-256 of ``parts`` (stable across runs and platforms)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(key: str, validation_fraction: float) -> str:
    """``"validation"`` or ``"train"`` for a document key."""
    return "validation" if _unit_hash("split", key) < validation_fraction else "train"


def require_documents(
    splits: dict[str, list[CodeDocument]],
    source: str | Path,
    validation_fraction: float,
    max_files: int | None = None,
    max_bytes: int | None = None,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
) -> None:
    """``ValueError`` when a split of ``splits`` (``{"train": [...], "validation": [...]}``) is empty, naming
    the split, how many documents were read from ``source``, the fraction and the read caps that stopped the
    reading (``data.max_files``, ``data.max_bytes``; a cap reached by one large file leaves a split empty);
    ``extensions`` are those :func:`read_code` read ``source`` with."""
    documents = [document for split in splits.values() for document in split]
    for name, split in splits.items():
        if split:
            continue
        if not documents:
            raise ValueError(
                f"no document was read from {source}: files ending in {', '.join(extensions)} are read "
                "(data.extensions names others)"
            )
        caps = _caps_reached(documents, source, extensions, max_files, max_bytes)
        capped = f", reading stopped at {' and '.join(caps)}" if caps else ""
        raise ValueError(
            f"the {name} split has no documents ({len(documents)} read from {source}, validation_fraction="
            f"{validation_fraction}{capped}); add data, change validation_fraction"
            + (" or raise the cap" if caps else "")
        )


def _caps_reached(
    documents: Sequence[CodeDocument],
    source: str | Path,
    extensions: Sequence[str],
    max_files: int | None,
    max_bytes: int | None,
) -> list[str]:
    """The caps that stopped :func:`read_code` on ``source`` before its end, as ``data.NAME=VALUE``:
    ``max_files`` when ``source`` holds more files it reads (``extensions`` and JSON lines) than that, and
    ``max_bytes`` when the ``documents`` read hold at least that many UTF-8 bytes."""
    caps = []
    max_files, max_bytes = _check_cap(max_files, "max_files"), _check_cap(max_bytes, "max_bytes")
    if max_files is not None and len(source_files(Path(source), tuple(extensions))) > max_files:
        caps.append(f"data.max_files={max_files}")
    if max_bytes is not None and sum(len(d.text.encode("utf-8")) for d in documents) >= max_bytes:
        caps.append(f"data.max_bytes={max_bytes}")
    return caps


def default_source_dir() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_jsonl(path: Path) -> bool:
    return path.name.endswith(JSONL_SUFFIXES)


def _check_extensions(extensions: object) -> tuple[str, ...]:
    if isinstance(extensions, str) or not isinstance(extensions, Sequence) or not extensions:
        raise ValueError(f"extensions must be a non-empty list like ['.py'], got {extensions!r}")
    for extension in extensions:
        if not isinstance(extension, str) or not extension.startswith(".") or len(extension) < 2:
            raise ValueError(f"extensions must be strings starting with '.', like '.py', got {extension!r}")
    return tuple(extensions)


def _check_cap(value: object, name: str) -> int | None:
    """A read cap as :func:`read_code` applies it: an int >= 1, or None for no cap (which 0 also means, so
    that a setting a preset caps can be lifted from the command line, ``--set data.max_bytes=0``)."""
    if value is None or (value == 0 and type(value) is int):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, or 0 or None for no cap, got {value!r}")
    return value


def source_files(root: Path, extensions: tuple[str, ...]) -> list[Path]:
    """``[root]`` when ``root`` is a file; else the files under ``root`` with one of ``extensions`` or a
    JSON-lines suffix, in hash order of their path; folders named in :data:`_EXCLUDED_DIRS` and hidden
    folders are not entered, and hidden files (an editor's ``.#name.py`` lock, a ``._name`` resource fork)
    are not read."""
    if root.is_file():
        return [root]
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(name for name in subfolders if name not in _EXCLUDED_DIRS and name[0] != ".")
        kept = [name for name in names if name[0] != "."]
        files += [Path(folder, name) for name in kept if name.endswith(extensions) or _is_jsonl(Path(name))]
    return sorted(files, key=lambda path: (_unit_hash("order", path.relative_to(root).as_posix()), path))


def _record_text(record: object, fields: tuple[str, ...]) -> str | None:
    if not isinstance(record, dict):
        return None
    for name in fields:
        if isinstance(record.get(name), str):
            return record[name]
    return None


def check_whole_file(file: Path, max_bytes: int) -> None:
    """``ValueError`` naming ``file``, a document read whole, when it holds more than ``max_bytes`` bytes
    (:data:`MAX_LINE_BYTES` by default), from its size: such a file is not read."""
    try:
        size = file.stat().st_size
    except OSError:
        return  # the reader skips and counts it as unreadable
    if size > max_bytes:
        raise ValueError(
            f"{file}: {size:,} bytes, longer than {max_bytes:,} bytes, the most one document read whole may "
            "hold; split it into smaller files (or into JSON lines)"
        )


def _read_file(file: Path, relative: str, max_bytes: int) -> CodeDocument | SkippedDocument:
    if not file.is_file():  # a pipe (reading it would wait forever), a broken or looping link
        return SkippedDocument(relative, "unreadable")
    check_whole_file(file, max_bytes)
    try:
        return CodeDocument(relative, without_bom(file.read_bytes()).decode("utf-8"))
    except UnicodeDecodeError:
        return SkippedDocument(relative, "not_utf8")
    except OSError:
        return SkippedDocument(relative, "unreadable")


def _parse_line(raw: bytes, fields: tuple[str, ...], max_line_bytes: int) -> tuple[object, str | None]:
    """``(record, None)`` for a JSON line holding a text field, else ``(None or the record, the problem)``."""
    if len(raw) > max_line_bytes:
        return None, (
            f"longer than {max_line_bytes:,} bytes, the most one JSON line may hold (split the document, or "
            "skip such lines with skip_bad_lines)"
        )
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return None, f"not valid JSON ({error})"
    if _record_text(record, fields) is None:
        return record, f"expected a JSON object with a string field among {list(fields)}"
    return record, None


def jsonl_documents(
    path: Path,
    relative: str,
    skip_bad_lines: bool,
    skipped: list[SkippedDocument],
    fields: tuple[str, ...],
    max_line_bytes: int,
    on_position: Callable[[int], None] | None = None,
) -> Iterator[CodeDocument]:
    """The documents of the JSON-lines file ``path`` (``relative``: its name in the keys), one line at a
    time: a line's text is its first string field among ``fields``; blank lines are passed over; a bad line
    (:func:`read_code`) raises ``ValueError`` naming file and line, or with ``skip_bad_lines`` is appended to
    ``skipped`` (key ``relative:line``, reason ``"bad_line"``). Empty texts are yielded (the caller decides).
    ``on_position``, if given, is called every :data:`_POSITION_LINES` lines with the bytes of the file read
    so far (of the compressed file, for gzip).
    """
    with open_data(path) as file:
        raw_file = getattr(file, "fileobj", file)  # a gzip.GzipFile reads the compressed bytes from .fileobj
        for number, raw in numbered_lines(file, path, max_line_bytes):
            if on_position is not None and number % _POSITION_LINES == 0:
                on_position(raw_file.tell())
            if not raw.strip():
                continue
            record, problem = _parse_line(raw, fields, max_line_bytes)
            if problem is not None:
                if not skip_bad_lines:
                    raise ValueError(f"{path}: line {number}: {problem}")
                skipped.append(SkippedDocument(f"{relative}:{number}", "bad_line"))
                continue
            repo, name = record.get("repo"), record.get("path")
            key = (
                f"{repo}/{name}"
                if isinstance(repo, str) and isinstance(name, str)
                else f"{relative}:{number}"
            )
            yield CodeDocument(key, _record_text(record, fields))


def read_code(
    path: str | Path | None = None,
    *,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    skip_bad_lines: bool = False,
    max_files: int | None = None,
    max_bytes: int | None = None,
    text_fields: Sequence[str] = TEXT_FIELDS,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> tuple[list[CodeDocument], list[SkippedDocument]]:
    """Read code documents from ``path``; None reads the standard library.

    Args:
        path: a ``*.jsonl`` / ``*.jsonl.gz`` file, or a folder of source files and JSON-lines files.
        extensions: file name endings of source files in a folder.
        skip_bad_lines: skip (and count) bad JSON lines instead of raising.
        max_files: read at most this many files (0 or None: all).
        max_bytes: stop once the texts read hold this many UTF-8 bytes (0 or None: no cap).
        text_fields: the fields of a JSON line that may hold its text, the first string one used
            (default :data:`TEXT_FIELDS`, CodeSearchNet's; ``("text",)`` for C4-style corpora).
        max_line_bytes: the longest JSON line read (its end of line included), a longer one being a bad line,
            and the largest file read whole, a larger one being refused.

    Returns:
        The documents read and those skipped (files not valid UTF-8 or unreadable, bad JSON lines when
        skipped, empty texts).

    Raises:
        FileNotFoundError: ``path`` does not exist. ValueError: ``path`` is a pipe, a device or a broken
            link (:func:`comera.data.files.check_regular_file`); a bad JSON line (file and line named) unless
            skipped, a truncated or corrupt gzip file (named), or bad arguments.
    """
    extensions = _check_extensions(extensions)
    if isinstance(text_fields, str) or not text_fields or not all(isinstance(f, str) for f in text_fields):
        raise ValueError(f"text_fields must be a non-empty list of field names, got {text_fields!r}")
    fields = tuple(text_fields)
    max_files, max_bytes = _check_cap(max_files, "max_files"), _check_cap(max_bytes, "max_bytes")
    check_int(max_line_bytes, "max_line_bytes", 1)
    root = default_source_dir() if path is None else Path(path)
    check_regular_file(root)
    if not root.exists():
        raise FileNotFoundError(f"data path {root} does not exist")
    skipped: list[SkippedDocument] = []
    documents: list[CodeDocument] = []
    size = 0
    for file in source_files(root, extensions)[:max_files]:
        relative = file.name if root.is_file() else file.relative_to(root).as_posix()
        if _is_jsonl(file) and file.is_file() and os.access(file, os.R_OK):
            found = jsonl_documents(file, relative, skip_bad_lines, skipped, fields, max_line_bytes)
        else:
            document = _read_file(file, relative, max_line_bytes)
            if isinstance(document, SkippedDocument):
                skipped.append(document)
                continue
            found = [document]
        for document in found:
            if not document.text.strip():
                skipped.append(SkippedDocument(document.key, "empty"))
                continue
            documents.append(document)
            size += len(document.text.encode("utf-8"))
            if max_bytes is not None and size >= max_bytes:
                return documents, skipped
    return documents, skipped


def documents_digest(documents: Sequence[CodeDocument], *settings: object) -> str:
    """Digest of ``settings`` and the documents' keys and contents, in order."""
    digest = hashlib.sha256("/".join(map(str, settings)).encode())
    for document in documents:
        digest.update(document.key.encode() + b"\0")
        digest.update(hashlib.sha256(document.text.encode("utf-8")).digest())
    return digest.hexdigest()[:16]
