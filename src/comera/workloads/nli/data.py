"""Sentence-pair classification data: MNLI readers (GLUE ``.tsv``, JSON lines), and :func:`build_nli_data`,
what a recipe calls: MNLI when given a data path, else the embedded docstring task, tokenised, with counts
and baselines. Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from comera.atomic import atomic_write_bytes
from comera.checks import check_int
from comera.data.cache import read_entry
from comera.data.files import check_regular_file, numbered_lines, open_data, utf8_problem
from comera.data.sources import JSONL_SUFFIXES
from comera.data.tokenize import (
    MAX_VOCAB_SIZE,
    MIN_PAIR_LENGTH,
    SPECIAL_TOKENS,
    PairTokenizer,
    load_tokenizer,
    tokenizer_digest,
    train_wordpiece,
)
from comera.workloads.nli.pairs import (
    PAIR_LABELS,
    PadCollate,
    PairDataset,
    PairExamples,
    build_docstring_pairs,
)

__all__ = [
    "MNLI_LABELS",
    "GLUE_FILES",
    "NLIData",
    "MNLI_VOCAB_SIZE",
    "EMBEDDED_VOCAB_SIZE",
    "build_nli_data",
    "read_glue_tsv",
    "read_jsonl",
    "read_mnli",
]

MNLI_LABELS = ("entailment", "neutral", "contradiction")
GLUE_FILES = {
    "train": "train.tsv",
    "validation_matched": "dev_matched.tsv",
    "validation_mismatched": "dev_mismatched.tsv",
}
MNLI_VOCAB_SIZE = 30522
EMBEDDED_VOCAB_SIZE = 8192
_GLUE_COLUMNS = ("sentence1", "sentence2", "gold_label")
_MISSING_LABELS = ("", "-", "-1", None, -1)


class _Malformed(ValueError):
    pass


def _decoded(line: bytes) -> str:
    """One line as text; :class:`_Malformed` naming the byte when it is not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _Malformed(utf8_problem(error)) from None


def _label_id(value: object, labels: Sequence[str]) -> int | None:
    """The label's index; None for a missing gold label; raises :class:`_Malformed` for anything else."""
    if value in _MISSING_LABELS:
        return None
    if isinstance(value, str) and value in labels:
        return labels.index(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(labels):
        return value
    raise _Malformed(f"label {value!r} is not one of {list(labels)} or 0..{len(labels) - 1}")


def _keep(examples: PairExamples, first: str, second: str, label: int | None) -> None:
    if label is None:
        examples.skip("no gold label")
    elif not first.strip() or not second.strip():
        examples.skip("empty sentence")
    else:
        examples.add(first, second, label)


def _malformed(examples: PairExamples, path: Path, number: int, error: Exception, skip: bool) -> None:
    if not skip:
        raise ValueError(f"{path}:{number}: malformed line: {error}") from None
    examples.skip("malformed")


def read_glue_tsv(path: str | os.PathLike, *, skip_malformed: bool = False) -> PairExamples:
    """The labelled pairs of a GLUE MNLI ``.tsv`` file (header line first; columns found by name), or of its
    gzip; a line is malformed when it is not UTF-8, its field count differs from the header's or its label
    is unknown.
    """
    path = Path(path)
    examples = PairExamples()
    with open_data(path) as file:
        lines = numbered_lines(file, path)
        try:
            header = _decoded(next(lines, (1, b""))[1]).rstrip("\r\n").split("\t")
        except _Malformed as error:
            raise ValueError(f"{path}:1: header {error}") from None
        missing = [name for name in _GLUE_COLUMNS if name not in header]
        if missing:
            raise ValueError(f"{path}:1: header lacks the column(s) {missing}; found {header}")
        first, second, gold = (header.index(name) for name in _GLUE_COLUMNS)
        for number, line in lines:
            if not line.strip():  # blank, or spaces and tabs only (as in the JSON lines reader)
                continue
            examples.read += 1
            try:
                fields = _decoded(line).rstrip("\r\n").split("\t")
                if len(fields) != len(header):
                    raise _Malformed(f"{len(fields)} tab-separated fields, the header has {len(header)}")
                label = _label_id(fields[gold], MNLI_LABELS)
            except _Malformed as error:
                _malformed(examples, path, number, error, skip_malformed)
                continue
            _keep(examples, fields[first], fields[second], label)
    return examples


def read_jsonl(path: str | os.PathLike, *, skip_malformed: bool = False) -> PairExamples:
    """The labelled pairs of a JSON lines file (or its gzip) of ``{"premise": ..., "hypothesis": ..., "label":
    ...}``; a line is malformed when it is not UTF-8, not a JSON object, lacks a string premise or
    hypothesis, or has an unknown label.
    """
    path = Path(path)
    examples = PairExamples()
    with open_data(path) as file:
        for number, line in numbered_lines(file, path):
            if not line.strip():
                continue
            examples.read += 1
            try:
                try:
                    record = json.loads(_decoded(line))
                except json.JSONDecodeError as error:
                    raise _Malformed(f"not valid JSON ({error.msg})") from None
                if not isinstance(record, dict):
                    raise _Malformed(f"expected a JSON object, got {type(record).__name__}")
                texts = [record.get(key) for key in ("premise", "hypothesis")]
                if not all(isinstance(text, str) for text in texts):
                    raise _Malformed("'premise' and 'hypothesis' must be strings")
                label = _label_id(record.get("label"), MNLI_LABELS)
            except _Malformed as error:
                _malformed(examples, path, number, error, skip_malformed)
                continue
            _keep(examples, texts[0], texts[1], label)
    return examples


def _split_by_line(examples: PairExamples, every: int) -> tuple[PairExamples, PairExamples]:
    """Every ``every``-th pair to validation, the rest to train (deterministic). Each split counts the lines
    of its pairs as read; the skipped lines, which belong to no pair, are counted with train, so that the
    two splits' ``read`` add up to the file's lines and each split reads its pairs plus its skipped lines."""
    train, validation = PairExamples(), PairExamples()
    for index, pair in enumerate(zip(examples.first, examples.second, examples.labels)):
        (validation if index % every == every - 1 else train).add(*pair)
    validation.read = len(validation)
    train.read, train.skipped, train.skipped_reasons = (
        examples.read - validation.read,
        examples.skipped,
        examples.skipped_reasons,
    )
    return train, validation


def read_mnli(
    data_path: str | os.PathLike, *, skip_malformed: bool = False, validation_every: int = 10
) -> dict[str, PairExamples]:
    """Splits of an MNLI-style data set, ``{"train": ..., <evaluation split>: ..., ...}``, from a GLUE MNLI
    folder, a folder of ``.jsonl`` files (plain or gzip) or one ``.jsonl`` file (every
    ``validation_every``-th pair to validation).

    Raises:
        FileNotFoundError: no such path. ValueError: a folder of neither kind, a folder without an evaluation
            split, or a split's file that is not a regular file (a pipe, a broken or looping link).
    """
    path = Path(data_path)
    if path.is_file():
        if _jsonl_split(path) is None:
            raise ValueError(
                f"data path {path} must be a GLUE MNLI folder, a folder of .jsonl files or a .jsonl file "
                "(.jsonl.gz too)"
            )
        check_int(validation_every, "validation_every", 2)
        train, validation = _split_by_line(read_jsonl(path, skip_malformed=skip_malformed), validation_every)
        return {"train": train, "validation": validation}
    if not path.is_dir():
        check_regular_file(path)
        raise FileNotFoundError(f"data path {path} does not exist")
    if _present(path / GLUE_FILES["train"]):
        files = {split: path / name for split, name in GLUE_FILES.items() if _present(path / name)}
        read = read_glue_tsv
    elif _present(path / "train.jsonl") or _present(path / "train.jsonl.gz"):
        visible = sorted(file for file in path.iterdir() if not file.name.startswith("."))
        named = [(split, file) for file in visible if (split := _jsonl_split(file))]
        splits = [split for split, _ in named]
        repeated = sorted({split for split in splits if splits.count(split) > 1})
        if repeated:
            raise ValueError(
                f"data path {path} holds splits both as NAME.jsonl and NAME.jsonl.gz: {repeated}"
            )
        files = dict(sorted(named, key=lambda item: (item[0] != "train", item[0])))
        read = read_jsonl
    else:
        raise ValueError(f"data path {path} holds neither train.tsv (GLUE MNLI) nor train.jsonl")
    for file in files.values():
        check_regular_file(file)
    if len(files) == 1:
        (train,) = files.values()
        way_out = (
            "add dev_matched.tsv or dev_mismatched.tsv"
            if read is read_glue_tsv
            else f"add another NAME.jsonl, or pass {train} alone (every {validation_every}th pair held out)"
        )
        raise ValueError(
            f"data path {path} holds {train.name} but no evaluation split, so the run would have nothing "
            f"to evaluate; {way_out}"
        )
    return {split: read(file, skip_malformed=skip_malformed) for split, file in files.items()}


def _jsonl_split(path: Path) -> str | None:
    """The split a ``NAME.jsonl`` or ``NAME.jsonl.gz`` file holds (``NAME``); None for other names."""
    for suffix in JSONL_SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return None


def _present(path: Path) -> bool:
    """Whether a data file is there under that name, even as a pipe or a broken or looping link (which
    :func:`~comera.data.files.check_regular_file` then names)."""
    return path.is_symlink() or path.exists()


@dataclass
class NLIData:
    """What :func:`build_nli_data` returns (the fields of a recipe's data).

    Attributes:
        train: the training :class:`~comera.workloads.nli.pairs.PairDataset`.
        evals: evaluation datasets by split name ("validation", or "validation_matched" /
            "validation_mismatched" for GLUE MNLI).
        collate_fn: a :class:`~comera.workloads.nli.pairs.PadCollate` for the tokenizer's padding id.
        info: "splits" ``{split: {"read": lines, "skipped": lines, "skipped_reasons": {reason: lines},
            "examples": pairs kept, "majority_accuracy": accuracy of always answering the split's most
            frequent label}}``, and "task", "label_names", "num_classes", "vocab_size", "pad_token_id",
            "max_length", "source" (the data path or the library read).
    """

    train: PairDataset
    evals: dict[str, PairDataset]
    collate_fn: PadCollate
    info: dict


def _split_facts(examples: PairExamples) -> dict:
    """Lines read and skipped (by reason), examples kept, and the accuracy of the most frequent label."""
    majority = max(Counter(examples.labels).values()) / len(examples) if len(examples) else 0.0
    return {
        **examples.counts(),
        "skipped_reasons": dict(examples.skipped_reasons),
        "examples": len(examples),
        "majority_accuracy": majority,
    }


def _trained_tokenizer(
    train: PairExamples, cache_dir: Path, key: str, vocab_size: int, max_length: int
) -> PairTokenizer:
    """A WordPiece vocabulary trained on the training pairs, cached under ``cache_dir`` by ``key`` (trained
    again and replaced where the cached file cannot be read: :func:`comera.data.cache.read_entry`)."""
    file = cache_dir / f"wordpiece-{key}.json"
    cached = read_entry(file, lambda entry: load_tokenizer(entry).tokenizer)
    if cached is not None:  # read alone, then the settings applied: a bad one is no damaged entry
        return PairTokenizer(cached, max_length)
    tokenizer = train_wordpiece(train.first + train.second, vocab_size)
    atomic_write_bytes(file, tokenizer.to_str(pretty=True).encode())
    return load_tokenizer(file, max_length=max_length)


def _source_key(path: Path, vocab_size: int) -> str:
    """Identifies a data source by its files' content (names relative to the folder, SHA-256 of the bytes):
    a touched, linked, moved or renamed copy of the same data finds the vocabulary trained on it (training
    it again may give another one, which a resumed run's model cannot read)."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    stamp = []
    for file in files:
        if file.is_file():
            with file.open("rb") as handle:
                digest = hashlib.file_digest(handle, "sha256").hexdigest()
            stamp.append((file.relative_to(path).as_posix() if path.is_dir() else "", digest))
    return hashlib.sha256(json.dumps([stamp, vocab_size]).encode()).hexdigest()[:16]


def build_nli_data(
    data_path: str | os.PathLike | None,
    cache_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    max_length: int = 128,
    lowercase: bool = True,
    vocab_size: int | None = None,
    skip_malformed: bool = False,
    validation_every: int = 10,
    train_pairs: int = 4000,
    validation_pairs: int = 2000,
    same_module_negatives: float = 1.0,
    seed: int = 0,
) -> NLIData:
    """The sentence-pair data of a run: MNLI from ``data_path``, or the embedded docstring task when None.

    Args:
        data_path: a GLUE MNLI folder, a folder of ``.jsonl`` files, a ``.jsonl`` file (see
            :func:`read_mnli`), or None for the embedded task
            (:func:`~comera.workloads.nli.pairs.build_docstring_pairs`).
        cache_dir: where trained vocabularies and the embedded task are cached.
        tokenizer: a local ``vocab.txt`` / ``tokenizer.json`` (or folder) for MNLI; None trains a WordPiece
            vocabulary of ``vocab_size`` on the training split (cached). The embedded task always trains its
            own.
        max_length: longest encoding, special tokens included (pairs are truncated longest-first).
        lowercase: lower-case text for a ``vocab.txt`` tokenizer.
        vocab_size: size of a vocabulary trained here; None for the default, BERT's 30522 for MNLI and
            :data:`EMBEDDED_VOCAB_SIZE` for the embedded task.
        skip_malformed: skip and count malformed lines instead of raising.
        validation_every: for a single ``.jsonl`` file, every n-th pair goes to validation.
        train_pairs / validation_pairs / same_module_negatives / seed: settings of the embedded task
            (:func:`~comera.workloads.nli.pairs.build_docstring_pairs`).

    Returns:
        An :class:`NLIData`.
    """
    check_int(max_length, "max_length", MIN_PAIR_LENGTH)
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError(
            f"tokenizer must be the path of a vocab.txt or tokenizer.json (or of a folder holding one), got "
            f"{tokenizer!r}"
        )
    if vocab_size is not None:
        check_int(vocab_size, "vocab_size", len(SPECIAL_TOKENS) + 1, MAX_VOCAB_SIZE)
    if tokenizer is not None and data_path is None:
        raise ValueError(
            f"tokenizer {str(tokenizer)!r} is read with --data (MNLI) only; the embedded pairs train their "
            "own vocabulary (data.vocab_size): drop data.tokenizer or give --data"
        )
    cache = Path(cache_dir)
    if data_path is None:
        splits, pair_tokenizer, task_info = build_docstring_pairs(
            cache,
            train_pairs=train_pairs,
            validation_pairs=validation_pairs,
            vocab_size=vocab_size or EMBEDDED_VOCAB_SIZE,
            max_length=max_length,
            same_module_negatives=same_module_negatives,
            seed=seed,
        )
        info = {"task": "docstring-code pairs", "label_names": list(PAIR_LABELS), **task_info}
    else:
        splits = read_mnli(data_path, skip_malformed=skip_malformed, validation_every=validation_every)
        if tokenizer is not None:
            pair_tokenizer = load_tokenizer(tokenizer, max_length=max_length, lowercase=lowercase)
        else:
            size = vocab_size or MNLI_VOCAB_SIZE
            key = _source_key(Path(data_path), size)
            pair_tokenizer = _trained_tokenizer(splits["train"], cache, key, size, max_length)
        info = {"task": "mnli", "label_names": list(MNLI_LABELS), "source": str(data_path)}
    if not len(splits["train"]):
        raise ValueError(f"data path {data_path}: the training split has no labelled pairs")
    datasets = {name: PairDataset(examples, pair_tokenizer) for name, examples in splits.items()}
    info.update(
        num_classes=len(info["label_names"]),
        vocab_size=pair_tokenizer.vocab_size,
        pad_token_id=pair_tokenizer.pad_id,
        max_length=max_length,
        splits={name: _split_facts(examples) for name, examples in splits.items()},
        identity={"tokenizer": tokenizer_digest(pair_tokenizer.tokenizer)},
    )
    train = datasets.pop("train")
    return NLIData(train=train, evals=datasets, collate_fn=PadCollate(pair_tokenizer.pad_id), info=info)
