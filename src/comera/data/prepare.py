"""Tokenize a corpus once into token shards on disk (:mod:`comera.data.token_shards`), streaming, in bounded
memory, resumable shard by shard: :func:`prepare_corpus`, behind ``comera prepare llm``. Details:
docs/llm.md, 'Bringing a corpus'.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from comera.atomic import atomic_write_bytes, remove_stale_temporaries
from comera.checks import check_bool, check_int, check_number
from comera.data.bpe import SPECIAL_TOKENS, check_tokenizer_file, special_ids, train_tokenizer
from comera.data.corpus import (
    TEXT_FIELD,
    WHOLE_FILES,
    SkipLog,
    corpus_files,
    corpus_inputs,
    read_corpus,
)
from comera.data.corpus_sample import sample_documents
from comera.data.encode_pool import EncodePool, available_cores
from comera.data.progress import Progress, silent
from comera.data.saved_dataset import (
    held_out_rule,
    held_out_rule_text,
    held_out_split_name,
    is_saved_dataset,
    saved_dataset_documents,
    saved_dataset_files,
)
from comera.data.shard_check import record_written_shards
from comera.data.sources import CodeDocument, SkippedDocument
from comera.data.special_tokens import (
    CONVENTIONAL_NAMES,
    given_tokenizer_sha256,
    load_given_tokenizer,
    special_token_names,
)
from comera.data.token_shards import (
    INDEX_FILE,
    INDEX_FORMAT,
    SPLITS,
    TOKENIZER_FILE,
    ShardWriter,
    file_sha256,
    shard_name,
    shard_problem,
    token_dtype,
)
from comera.data.tokenize import tokenizer_digest

__all__ = [
    "BATCH_BYTES",
    "BATCH_DOCUMENTS",
    "DEFAULT_SHARD_TOKENS",
    "WORKER_BATCH",
    "DocumentReader",
    "SPLIT_RULE",
    "PrepareSettings",
    "PrepareSummary",
    "input_files",
    "prepare_corpus",
    "prepare_documents",
]

DEFAULT_SHARD_TOKENS = 2**26
"""Tokens a shard reaches before it is closed (67,108,864: 128 MiB of ``uint16``)."""
BATCH_DOCUMENTS = 1024
"""Documents encoded per ``encode_batch`` call in the preparing process (``workers=0``)."""
BATCH_BYTES = 16 * 2**20
"""Characters of text after which a batch is encoded even if it holds fewer documents (``workers=0``)."""
WORKER_BATCH = (256, 2**20)
"""Documents and characters of a batch sent to a worker process: small, as up to two per worker are in
flight and each worker holds one batch's encodings."""
SPLIT_RULE = (
    "a document is in validation when the first 8 bytes of SHA-256 of 'split' + '\\x1f' + its key, as a "
    "fraction of 2**64, are below validation_fraction; the key is a .txt file's path relative to --data, a "
    "JSON line's repo/path when it has both fields else file:line, a Parquet row's file:row (rows from 1)"
)
"""The split rule, as ``index.json`` states it (:func:`comera.data.sources.split_of`)."""


@dataclass(frozen=True)
class PrepareSettings:
    """What a preparation depends on besides its inputs (a resume must give the same).

    Attributes:
        vocab_size: the BPE vocabulary to train (at most; not used with ``tokenizer_file``).
        validation_fraction: share of document keys in validation, in ``(0, 1)``.
        tokenizer_file: a ``tokenizer.json`` to use instead of training one.
        skip_bad_lines: skip and record bad JSON lines instead of stopping at the first.
        shard_tokens: tokens a shard reaches before it is closed (>= 1).
        sample_bytes: UTF-8 bytes of training text the tokenizer is trained on (>= 1).
        whole_files: endings of the files read as one document each (``.txt``; ``.py`` for the masked LM).
        text_fields: the JSON fields (and Parquet columns) that may hold a document's text, the first
            present used (``text``; the masked LM also reads CodeSearchNet's ``code``).
        needs_mask: refuse a tokenizer without a mask token (the masked LM's), before anything is encoded;
            not recorded (it changes no token).
    """

    vocab_size: int
    validation_fraction: float = 0.05
    tokenizer_file: str | Path | None = None
    skip_bad_lines: bool = False
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    sample_bytes: int = 100 * 10**6
    whole_files: tuple[str, ...] = WHOLE_FILES
    text_fields: tuple[str, ...] = (TEXT_FIELD,)
    needs_mask: bool = False

    def check(self) -> None:
        """``ValueError`` naming the first setting out of its range."""
        for name, values in (("whole_files", self.whole_files), ("text_fields", self.text_fields)):
            if isinstance(values, str) or not values or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of non-empty strings, got {values!r}")
        bad = [ending for ending in self.whole_files if not ending.startswith(".") or len(ending) < 2]
        if bad:
            raise ValueError(
                f"whole_files must be file endings starting with '.', like '.txt', got {bad[0]!r}"
            )
        check_int(self.vocab_size, "data.vocab_size", len(SPECIAL_TOKENS) + 257)
        fraction = self.validation_fraction
        check_number(fraction, "data.validation_fraction", 0, 1)
        if not 0 < fraction < 1:
            raise ValueError(f"data.validation_fraction must be a float in (0, 1), got {fraction!r}")
        check_bool(self.skip_bad_lines, "data.skip_bad_lines")
        check_int(self.shard_tokens, "--shard-tokens", 1)
        check_int(self.sample_bytes, "tokenizer sample bytes (--sample-mb)", 1)
        try:
            check_tokenizer_file(self.tokenizer_file)
        except (ValueError, FileNotFoundError) as error:  # its messages open with the key alone
            raise type(error)(f"data.{error}") from None


@dataclass
class PrepareSummary:
    """What :func:`prepare_corpus` did.

    Attributes:
        index: the complete ``index.json``.
        written: shards written in this call (new or redone), by name.
        kept: recorded shards that matched and were kept.
        redone: the recorded shards that were missing or damaged, and why.
        seconds: wall time.
    """

    index: dict[str, Any]
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    redone: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def _settings_record(settings: PrepareSettings, given_digest: str | None) -> dict[str, Any]:
    return {
        "vocab_size": None if given_digest else settings.vocab_size,
        "validation_fraction": settings.validation_fraction,
        "tokenizer_file_sha256": given_digest,
        "skip_bad_lines": settings.skip_bad_lines,
        "shard_tokens": settings.shard_tokens,
        "tokenizer_sample_bytes": None if given_digest else settings.sample_bytes,
        "whole_files": list(settings.whole_files),
        "text_fields": list(settings.text_fields),
    }


def _earlier_index(out: Path, inputs: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, Any] | None:
    """The index of an earlier preparation in ``out`` to continue: None when there is none or it cannot be
    read (the preparation starts over); ``ValueError`` when it was made from other inputs or settings."""
    try:
        index = json.loads((out / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        return None
    if index.get("settings") != record:
        then = index.get("settings", {})
        changed = sorted(key for key in record if then.get(key) != record[key])
        raise ValueError(
            f"--out {out} holds a preparation made with other settings ({', '.join(changed)}); give the same "
            "settings to continue it, or another --out"
        )
    recorded = {entry["name"]: entry["bytes"] for entry in index.get("source", {}).get("files", [])}
    current = {entry["name"]: entry["bytes"] for entry in inputs}
    if recorded != current:
        name = next(iter(sorted(set(recorded) ^ set(current)) or sorted(recorded)))
        if name in recorded and name in current:
            name = next(n for n in sorted(current) if recorded.get(n) != current[n])
        raise ValueError(
            f"--out {out} holds a preparation of other files ({name}: {recorded.get(name, 'absent')} bytes "
            f"then, {current.get(name, 'absent')} now); give the same --data, or another --out"
        )
    return index


def _load_tokenizer(path: Path, what: str, names: dict[str, str | None] | None) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:
        raise ValueError(f"{what} {path}: not a tokenizers tokenizer.json ({error})") from None
    special_ids(tokenizer, names)
    return tokenizer


DocumentReader = Callable[[SkipLog, Callable[[int], None] | None], Iterator[CodeDocument]]
"""``read(skipped, on_bytes)``: the documents of a corpus in reading order, those left out appended to
``skipped``, ``on_bytes`` (if not None) told how many input bytes were read; callable more than once."""


def _tokenizer(
    read: DocumentReader,
    what: str,
    out: Path,
    settings: PrepareSettings,
    earlier: dict[str, Any] | None,
    progress: Progress,
    total_bytes: int | None,
    split_by: Callable[[str], str | None],
) -> tuple[Tokenizer, dict[str, Any], bool]:
    """The tokenizer, its index record, and whether the earlier shards can be kept (the
    earlier tokenizer is still there, unchanged)."""
    path = out / TOKENIZER_FILE
    if earlier is not None and path.is_file() and file_sha256(path) == earlier["tokenizer"]["file_sha256"]:
        names = earlier["tokenizer"].get("special_tokens")
        return _load_tokenizer(path, "the prepared tokenizer", names), earlier["tokenizer"], True
    if settings.tokenizer_file is not None:
        given = load_given_tokenizer(settings.tokenizer_file, what="data.tokenizer_file")
        tokenizer = given.tokenizer
        record: dict[str, Any] = {
            "given": str(Path(settings.tokenizer_file).resolve()),
            "given_files": [file.name for file in given.files],
            "special_tokens": given.names,
            "added_tokens": list(given.added),
        }
    else:
        skipped = SkipLog(keep=0)
        with progress.phase("reading the tokenizer's sample", total_bytes) as phase:
            train = (
                document for document in read(skipped, phase.advance_to) if split_by(document.key) == "train"
            )
            sample = sample_documents(train, settings.sample_bytes)
        if not sample:
            raise ValueError(f"{what}: the training split has no documents to train a tokenizer on")
        sample_bytes = sum(len(document.text.encode("utf-8")) for document in sample)
        with progress.phase("training the tokenizer", sample_bytes) as phase:
            tokenizer = train_tokenizer((document.text for document in sample), settings.vocab_size)
            phase.advance_to(sample_bytes)
        record = {
            "trained_on": {
                "documents": len(sample),
                "bytes": sample_bytes,
                "rule": "the training documents of lowest sample hash (SHA-256 of 'sample' + '\\x1f' + key) "
                "whose texts hold at most tokenizer_sample_bytes bytes",
            }
        }
        del sample
        record["special_tokens"] = special_token_names(tokenizer)
    atomic_write_bytes(path, tokenizer.to_str().encode())
    record.update(
        file=TOKENIZER_FILE,
        file_sha256=file_sha256(path),
        sha256=tokenizer_digest(tokenizer),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )
    return tokenizer, record, False


class _SplitShards:
    """The shards of one split: the recorded ones (kept or redone) and the new ones after them."""

    def __init__(
        self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, recorded: list[dict]
    ) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.entries: list[dict[str, Any]] = list(recorded)
        self.recorded_documents = sum(entry["documents"] for entry in recorded)
        self.bad: dict[int, str] = {}  # position in entries -> what is wrong
        self.documents = 0
        self._position = 0  # the recorded entry the next recorded document is in
        self._writer: ShardWriter | None = None

    def needs(self, ordinal: int) -> bool:
        """Whether document ``ordinal`` of the split must be encoded (it is not in a matching shard)."""
        if ordinal >= self.recorded_documents:
            return True
        while (
            ordinal
            >= self.entries[self._position]["first_document"] + self.entries[self._position]["documents"]
        ):
            self._position += 1
        return self._position in self.bad

    def add(self, ordinal: int, ids: np.ndarray, on_close: Callable[[int, dict], None]) -> None:
        """Append the ids (``</s>`` included) of document ``ordinal``, which :meth:`needs` said to encode."""
        if ordinal < self.recorded_documents:
            position = next(
                p
                for p in self.bad
                if self.entries[p]["first_document"]
                <= ordinal
                < self.entries[p]["first_document"] + self.entries[p]["documents"]
            )
            entry = self.entries[position]
            if self._writer is None:
                self._writer = ShardWriter(self.out, entry["name"], self.dtype, entry["first_document"])
            self._writer.write(ids, 1)
            if ordinal == entry["first_document"] + entry["documents"] - 1:
                on_close(position, self._close())
            return
        if self._writer is None:
            self._writer = ShardWriter(
                self.out, shard_name(self.split, len(self.entries)), self.dtype, ordinal
            )
        self._writer.write(ids, 1)
        if self._writer.tokens >= self.shard_tokens:
            self.entries.append({})
            on_close(len(self.entries) - 1, self._close())

    def finish(self, on_close: Callable[[int, dict], None]) -> None:
        """Close the last new shard, if it holds anything; ``ValueError`` when the split has fewer documents
        than the recorded shards hold (the inputs changed without changing size)."""
        if self.documents < self.recorded_documents or self.bad:
            self.abort()
            raise ValueError(
                f"the {self.split} split now has {self.documents:,} documents, the recorded shards hold "
                f"{self.recorded_documents:,}: the input files changed since the index was written; prepare "
                "the corpus into another --out"
            )
        if self._writer is not None and self._writer.tokens:
            self.entries.append({})
            on_close(len(self.entries) - 1, self._close())
        elif self._writer is not None:
            self._writer.abort()
            self._writer = None

    def abort(self) -> None:
        """Delete the open shard's temporary file, if one is open."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None

    def _close(self) -> dict[str, Any]:
        assert self._writer is not None
        entry = self._writer.close()
        self._writer = None
        return entry


def prepare_corpus(
    source: str | Path,
    out: str | Path,
    settings: PrepareSettings,
    *,
    report: Callable[[str], None] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    max_files: int | None = None,
    max_bytes: int | None = None,
) -> PrepareSummary:
    """Tokenize the corpus at ``source`` into token shards and ``index.json`` in ``out``, or continue or
    repair an earlier preparation there.

    Args:
        source: a corpus file or folder (:mod:`comera.data.corpus`), or a folder written by
            ``datasets.save_to_disk`` (:mod:`comera.data.saved_dataset`).
        out: the prepared corpus's folder (created if missing).
        settings: the tokenizer, split and shard settings.
        report: called with one line per shard written, kept or redone (default: ``progress.line``).
        workers: tokenizing processes (>= 0; None: one per usable core, 0: in this process); the shards do
            not depend on it.
        progress: where the phases' progress goes (:mod:`comera.data.progress`; default: nowhere).
        max_files, max_bytes: read only the first ``max_files`` files, and stop after the document that
            brings the text read to ``max_bytes`` UTF-8 bytes (None: all).

    Raises:
        ValueError: a bad setting (named), a corpus without documents in a split, a bad JSON line (file and
            line named) without ``skip_bad_lines``, an earlier preparation in ``out`` of other inputs or
            settings. FileNotFoundError: ``source`` or the tokenizer file does not exist. ImportError: a
            Parquet file without ``pyarrow``.
    """
    settings.check()
    if max_files is not None:
        check_int(max_files, "data.max_files", 1)
    if max_bytes is not None:
        check_int(max_bytes, "data.max_bytes", 1)
    source = Path(source)
    if is_saved_dataset(source):
        return _prepare_saved_dataset(
            source, out, settings, report=report, workers=workers, progress=progress
        )
    files = corpus_files(source, settings.whole_files)[:max_files]
    inputs = corpus_inputs(source, files)

    def read(skipped: SkipLog, on_bytes: Callable[[int], None] | None) -> Iterator[CodeDocument]:
        documents = read_corpus(
            source,
            files,
            skipped,
            skip_bad_lines=settings.skip_bad_lines,
            whole_files=settings.whole_files,
            text_fields=settings.text_fields,
            on_bytes=on_bytes,
        )
        return documents if max_bytes is None else _capped(documents, max_bytes)

    caps = {} if max_files is None and max_bytes is None else {"max_files": max_files, "max_bytes": max_bytes}
    return prepare_documents(
        read,
        out,
        settings,
        source={"path": str(source.resolve()), "files": inputs, **caps},
        report=report,
        workers=workers,
        progress=progress,
    )


def input_files(source: str | Path, settings: PrepareSettings, max_files: int | None = None) -> list[Path]:
    """The files :func:`prepare_corpus` reads of ``source``: a saved dataset's Arrow files (the read caps do
    not apply to it), else the corpus's files (:func:`comera.data.corpus.corpus_files`), the first
    ``max_files`` of them."""
    if is_saved_dataset(source):
        return [file for _, file in saved_dataset_files(source)]
    return corpus_files(source, settings.whole_files)[:max_files]


def _prepare_saved_dataset(
    source: Path,
    out: str | Path,
    settings: PrepareSettings,
    *,
    report: Callable[[str], None] | None,
    workers: int | None,
    progress: Progress | None,
) -> PrepareSummary:
    """:func:`prepare_corpus` of a ``datasets.save_to_disk`` folder (:mod:`comera.data.saved_dataset`): its
    own ``validation`` (else ``test``) split is the validation split, recorded in the index's ``source``
    as ``held_out_split``; without one the split is by hash of the ``split/row`` keys."""
    files = saved_dataset_files(source)
    inputs = [
        {"name": file.relative_to(source).as_posix(), "bytes": file.stat().st_size} for _, file in files
    ]
    held_out = held_out_split_name(source)

    def read(skipped: SkipLog, on_bytes: Callable[[int], None] | None) -> Iterator[CodeDocument]:
        return saved_dataset_documents(source, skipped, settings.text_fields, on_bytes)

    rule = (
        held_out_rule_text(held_out)
        if held_out is not None
        else SPLIT_RULE
        + "; a saved dataset's record's key is split/row (rows from 0; data/row for a Dataset)"
    )
    return prepare_documents(
        read,
        out,
        settings,
        source={"path": str(source.resolve()), "files": inputs, "held_out_split": held_out},
        report=report,
        workers=workers,
        progress=progress,
        split_by=held_out_rule(held_out, settings.validation_fraction),
        split_rule=rule,
    )


def _capped(documents: Iterator[CodeDocument], max_bytes: int) -> Iterator[CodeDocument]:
    """``documents`` up to the one that brings their texts to ``max_bytes`` UTF-8 bytes."""
    held = 0
    for document in documents:
        yield document
        held += len(document.text.encode("utf-8"))
        if held >= max_bytes:
            return


def prepare_documents(
    read: DocumentReader,
    out: str | Path,
    settings: PrepareSettings,
    *,
    source: dict[str, Any],
    report: Callable[[str], None] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    split_by: Callable[[str], str | None] | None = None,
    split_rule: str = SPLIT_RULE,
) -> PrepareSummary:
    """:func:`prepare_corpus` over the documents ``read`` gives (a :data:`DocumentReader`), in its order: what
    the embedded corpora are prepared with (:mod:`comera.data.embedded`).

    Args:
        read: the documents, read twice when a tokenizer is trained (its sample, then the encoding).
        out, settings, report, workers, progress: as :func:`prepare_corpus`.
        source: ``index.json``'s ``source``: ``path`` (what ``--data`` named) and ``files``, a list of
            ``{"name", "bytes"}`` (a resume over other files is refused).
        split_by: ``key -> "train" | "validation" | None`` (None: the document is left out); default
            :func:`comera.data.sources.split_of` at ``settings.validation_fraction``.
        split_rule: the rule as ``index.json`` states it.
    """
    started = time.perf_counter()
    settings.check()
    if split_by is None:
        split_by = held_out_rule(None, settings.validation_fraction)
    progress = progress if progress is not None else silent()
    report = report if report is not None else progress.line
    workers = available_cores() if workers is None else check_int(workers, "workers", 0)
    out = Path(out)
    inputs = source["files"]
    total_bytes = sum(int(entry["bytes"]) for entry in inputs) or None
    what = f"--data {source['path']}"
    given = None if settings.tokenizer_file is None else given_tokenizer_sha256(settings.tokenizer_file)
    record = _settings_record(settings, given)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a folder for the prepared corpus")
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    earlier = _earlier_index(out, inputs, record)
    tokenizer, tokenizer_record, same_tokenizer = _tokenizer(
        read, what, out, settings, earlier, progress, total_bytes, split_by
    )
    if not same_tokenizer:
        earlier = None  # shards encoded with a tokenizer that is gone are written again
    ids = special_ids(tokenizer, tokenizer_record.get("special_tokens"))
    if settings.needs_mask and ids.mask is None:
        raise ValueError(
            f"the masked LM needs a mask token, and the tokenizer {tokenizer_record.get('given', '')} has "
            f"none: none of {list(CONVENTIONAL_NAMES['mask'])} is in its vocabulary (a transformers "
            "folder may name it as mask_token in special_tokens_map.json)"
        )
    del tokenizer  # the workers load their own
    dtype = token_dtype(tokenizer_record["vocab_size"])
    summary = PrepareSummary(index={})
    splits = {}
    for split in SPLITS:
        recorded = [] if earlier is None else earlier["splits"][split]["shards"]
        splits[split] = _SplitShards(out, split, dtype, settings.shard_tokens, recorded)
        for position, entry in enumerate(recorded):
            problem = shard_problem(out, entry)
            if problem is None:
                summary.kept.append(entry["name"])
                report(f"{entry['name']}: kept ({entry['tokens']:,} tokens)")
            else:
                splits[split].bad[position] = problem
                summary.redone[entry["name"]] = problem
                report(f"{entry['name']}: {problem}; encoding it again")
    skipped = SkipLog(split_by=split_by)
    base = {
        "format": INDEX_FORMAT,
        "source": source,
        "settings": record,
        "split_rule": split_rule,
        "tokenizer": tokenizer_record,
        "dtype": dtype.name,
        "eos_id": ids.eos,
        "pad_id": ids.pad,
    }

    def write_index(complete: bool) -> dict[str, Any]:
        index = {**base, "complete": complete, "splits": {}}
        for split, shards in splits.items():
            entries = [entry for entry in shards.entries if entry]
            index["splits"][split] = {
                "documents": shards.documents if complete else None,
                "tokens": sum(entry["tokens"] for entry in entries),
                "shards": entries,
            }
            if complete:
                index["splits"][split]["skipped"] = dict(sorted(skipped.by_split.get(split, {}).items()))
        if complete:
            index["skipped"] = {
                "total": skipped.total,
                "by_reason": dict(sorted(skipped.counts.items())),
                "first": [{"key": entry.key, "reason": entry.reason} for entry in skipped.entries],
            }
        atomic_write_bytes(out / INDEX_FILE, (json.dumps(index, indent=1) + "\n").encode())
        return index

    def closed(split: str) -> Callable[[int, dict], None]:
        def on_close(position: int, entry: dict[str, Any]) -> None:
            shards = splits[split]
            before = shards.entries[position]
            shards.entries[position] = entry
            shards.bad.pop(position, None)
            summary.written.append(entry["name"])
            changed = " (its tokens differ from the recorded ones)" if before and before != entry else ""
            counts = f"{entry['tokens']:,} tokens, {entry['documents']:,} documents"
            report(f"{entry['name']}: written ({counts}){changed}")
            write_index(complete=False)

        return on_close

    on_close = {split: closed(split) for split in SPLITS}
    batch_documents, batch_bytes = (BATCH_DOCUMENTS, BATCH_BYTES) if workers == 0 else WORKER_BATCH

    def batches(on_bytes: Callable[[int], None]) -> Iterator[tuple[list[tuple[str, int]], list[str]]]:
        """The documents to encode, in batches ``([(split, ordinal)], [text])``."""
        tags: list[tuple[str, int]] = []
        texts: list[str] = []
        held = 0
        for document in read(skipped, on_bytes):
            split = split_by(document.key)
            if split is None:
                skipped.append(SkippedDocument(document.key, "held_out"))
                continue
            shards = splits[split]
            ordinal = shards.documents
            shards.documents += 1
            if not shards.needs(ordinal):
                continue
            tags.append((split, ordinal))
            texts.append(document.text)
            held += len(document.text)
            if len(texts) >= batch_documents or held >= batch_bytes:
                yield tags, texts
                tags, texts, held = [], [], 0
        if texts:
            yield tags, texts

    eos = np.array([ids.eos], dtype=dtype)
    try:
        with (
            EncodePool(out / TOKENIZER_FILE, dtype, workers) as pool,
            progress.phase("encoding", total_bytes) as phase,
        ):
            for tags, encoded in pool.encode(batches(phase.advance_to)):
                for (split, ordinal), document_ids in zip(tags, encoded):
                    splits[split].add(ordinal, np.concatenate([document_ids, eos]), on_close[split])
        for split, shards in splits.items():
            shards.finish(on_close[split])
    except BaseException:
        for shards in splits.values():
            shards.abort()
        raise
    _require_documents(what, splits)
    summary.index = write_index(complete=True)
    record_written_shards(out, summary.index)
    summary.seconds = time.perf_counter() - started
    return summary


def _require_documents(what: str, splits: dict[str, _SplitShards]) -> None:
    for split, shards in splits.items():
        if shards.documents == 0:
            counts = ", ".join(f"{name} {each.documents}" for name, each in splits.items())
            raise ValueError(
                f"{what}: the {split} split has no documents ({counts}); add data or change "
                "data.validation_fraction"
            )
