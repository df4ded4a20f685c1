"""A corpus given to ``comera train llm|mlm --data PATH`` as text files prepared into token shards in the
cache folder the first time a run reads it (entry ``{prefix}-data-{key}/``, keyed by the files and the
settings that change the tokens; continued, repaired and locked as it is prepared), and found there by the
next run: :func:`prepare_into_cache`. Details: docs/llm.md, 'Bringing a corpus'.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comera.data.prepare import PrepareSettings, PrepareSummary, input_files, prepare_corpus
from comera.data.progress import Progress
from comera.data.shard_check import check_shards
from comera.data.special_tokens import given_tokenizer_sha256
from comera.data.token_shards import INDEX_FORMAT, read_index

__all__ = [
    "CACHE_LAYOUT",
    "IN_PROCESS_BYTES",
    "LAYOUTS",
    "CachedCorpus",
    "cache_key",
    "check_layout",
    "preparation_problem",
    "prepare_into_cache",
    "read_cap",
]

CACHE_LAYOUT = 1
"""The version of the cached preparation's layout, in its key: a change of layout prepares again."""
IN_PROCESS_BYTES = 16 * 2**20
"""A corpus of fewer input bytes is encoded in the training process (starting worker processes costs more
than it saves); a larger one on every core (:mod:`comera.data.encode_pool`). The shards are the same."""


@dataclass(frozen=True)
class CachedCorpus:
    """A corpus prepared in the cache.

    Attributes:
        folder: the prepared corpus (``index.json``, ``tokenizer.json``, shards).
        prepared_now: whether shards were written in this call (False: the entry was complete and used).
        summary: what the preparation did (None when nothing was prepared).
    """

    folder: Path
    prepared_now: bool
    summary: PrepareSummary | None = None


LAYOUTS = ("stream", "whole")
"""The values of ``data.layout``: ``stream`` (:func:`prepare_into_cache`) or ``whole`` (the documents read
into memory first, as runs started before ``--data`` was prepared read them, :mod:`comera.data.embedded`)."""


def check_layout(layout: object) -> str:
    """``layout`` when it is one of :data:`LAYOUTS`, else ``ValueError`` naming ``data.layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def read_cap(value: object, name: str) -> int | None:
    """A read cap as the data settings give it (an int >= 1, or 0 or None for none) as
    :func:`comera.data.prepare.prepare_corpus` takes it (None for none); ``ValueError`` naming ``name``."""
    if value is None or (value == 0 and type(value) is int):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, or 0 or None for no cap, got {value!r}")
    return value


def preparation_problem(folder: Path, cache_dir: Path) -> str | None:
    """None when the prepared corpus in ``folder`` is complete and its shards match its index, else why
    not (one phrase)."""
    try:
        index = read_index(folder)
        if not index.get("complete"):
            return "its preparation did not finish"
        check_shards(folder, index, cache_dir)
    except (OSError, ValueError, KeyError, TypeError) as error:
        return str(error)
    return None


def cache_key(source: Path, settings: PrepareSettings, max_files: int | None, max_bytes: int | None) -> str:
    """The digest that names the cache entry of ``source`` prepared with ``settings`` and these caps
    (16 hexadecimal digits)."""
    files = input_files(source, settings, max_files)
    root = source.resolve()
    identity: dict[str, Any] = {
        "path": str(root),
        "files": [
            [
                file.name if source.is_file() else file.relative_to(source).as_posix(),
                stat.st_size,
                stat.st_mtime_ns,
            ]
            for file in files
            for stat in [file.stat()]
        ],
        "settings": {
            "vocab_size": settings.vocab_size,
            "validation_fraction": settings.validation_fraction,
            "tokenizer_file_sha256": None
            if settings.tokenizer_file is None
            else given_tokenizer_sha256(settings.tokenizer_file),
            "skip_bad_lines": settings.skip_bad_lines,
            "sample_bytes": settings.sample_bytes,
            "shard_tokens": settings.shard_tokens,
            "whole_files": list(settings.whole_files),
            "text_fields": list(settings.text_fields),
            "max_files": max_files,
            "max_bytes": max_bytes,
        },
        "format": INDEX_FORMAT,
        "layout": CACHE_LAYOUT,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _stderr_line(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def prepare_into_cache(
    source: str | Path,
    cache_dir: str | Path,
    prefix: str,
    settings: PrepareSettings,
    *,
    max_files: int | None = None,
    max_bytes: int | None = None,
    report: Callable[[str], None] | None = None,
) -> CachedCorpus:
    """The prepared corpus of ``source`` in ``cache_dir``: used when complete, else prepared (or continued)
    there.

    Args:
        source: a corpus file or folder (:mod:`comera.data.corpus`).
        cache_dir: the cache folder.
        prefix: the entry's name prefix (``"lm"``, ``"code"``).
        settings: the preparation's settings.
        max_files, max_bytes: the read caps (:func:`comera.data.prepare.prepare_corpus`; None: all).
        report: where the preparation's lines go (default: standard error).

    Raises:
        as :func:`comera.data.prepare.prepare_corpus`.
    """
    source, cache_dir = Path(source), Path(cache_dir)
    settings.check()
    folder = cache_dir / f"{prefix}-data-{cache_key(source, settings, max_files, max_bytes)}"
    if folder.is_dir() and preparation_problem(folder, cache_dir) is None:
        return CachedCorpus(folder, False)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _entry_lock(folder):  # a run preparing the same entry in another process: wait for it, then use it
        problem = preparation_problem(folder, cache_dir) if folder.is_dir() else None
        if folder.is_dir() and problem is None:
            return CachedCorpus(folder, False)
        if problem is not None:
            warnings.warn(
                f"cache entry {folder} is prepared again from --data {source} ({problem})",
                RuntimeWarning,
                stacklevel=2,
            )
        write = report if report is not None else _stderr_line
        write(f"preparing --data {source} into {folder} (once: later runs read it)")
        total = sum(file.stat().st_size for file in input_files(source, settings, max_files))
        summary = prepare_corpus(
            source,
            folder,
            settings,
            workers=0 if total < IN_PROCESS_BYTES else None,
            progress=Progress(write=write),
            max_files=max_files,
            max_bytes=max_bytes,
        )
    return CachedCorpus(folder, True, summary)


@contextmanager
def _entry_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``FOLDER.lock`` beside the cache entry, held while it is prepared."""
    with folder.with_name(folder.name + ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
