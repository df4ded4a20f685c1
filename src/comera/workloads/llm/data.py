"""The language-model workload's data built in memory (the reference of the token-shard path): documents read
and split by key, a local byte-level BPE, token ids joined with ``</s>`` and cut into fixed blocks, evenly
spaced validation blocks: :func:`build_lm_data`. Details: docs/llm.md, 'Data'.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from comera.data.bpe import SpecialIds, check_tokenizer_file, load_or_train_tokenizer, special_ids
from comera.data.files import check_data_path
from comera.data.saved_dataset import HELD_OUT_SPLITS, held_out_rule, is_saved_dataset
from comera.data.sources import (
    CodeDocument,
    SkippedDocument,
    default_source_dir,
    read_code,
    read_counts,
    require_documents,
)
from comera.data.token_cache import encode_cached, join_documents
from comera.data.tokenize import tokenizer_digest

__all__ = [
    "TOPICS_KEY",
    "LMBlocks",
    "LMData",
    "build_lm_data",
    "check_lm_data_settings",
    "held_out_split",
    "pack_stream",
    "read_caps",
    "read_lm_documents",
    "topic_documents",
]

TOPICS_KEY = "pydoc_data/topics"
"""The key prefix of the documentation topics (and the source file that holds them, left out)."""
_TEXT_FIELDS = ("text",)


@dataclass(frozen=True)
class LMBlocks(Dataset):
    """Fixed-length token blocks of one split (a map-style dataset of ``(seq_len,)`` int64 items, collated to
    ``(B, seq_len)``).

    Attributes:
        tokens: ``(N, seq_len)`` int32 token ids.
        targets: predicted tokens over all blocks (positions 1.. of each block that are not ``<pad>``).
        dropped_tokens: stream tokens left out (the training stream's short tail).
    """

    tokens: torch.Tensor
    targets: int
    dropped_tokens: int = 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index].long()


def pack_stream(
    documents: Sequence[Sequence[int]],
    seq_len: int,
    ids: SpecialIds,
    *,
    tail: str,
    max_blocks: int | None = None,
) -> LMBlocks:
    """Join token-id lists into ``doc_1 </s> doc_2 </s> ...`` and cut it into blocks of ``seq_len`` tokens.

    Args:
        documents: token ids of each document, in order; empty ones add nothing.
        seq_len: tokens per block (>= 2: one input and one target).
        ids: the tokenizer's special ids (``eos`` ends each document, ``pad`` fills a padded tail).
        tail: ``"drop"`` the short last piece (counted in ``dropped_tokens``) or ``"pad"`` it.
        max_blocks: keep this many blocks, evenly spaced over the stream (block ``(i * N) // max_blocks``
            of the ``N`` blocks for ``i = 0 .. max_blocks - 1``; all when None or ``>= N``).

    Returns:
        :class:`LMBlocks` ``(N, seq_len)``, whose rows concatenated are the stream (up to the tail).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (one input and one target), got {seq_len!r}")
    if tail not in ("drop", "pad"):
        raise ValueError(f"tail must be one of ('drop', 'pad'), got {tail!r}")
    if max_blocks is not None and (
        isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1
    ):
        raise ValueError(f"max_blocks must be an int >= 1 or None, got {max_blocks!r}")
    stream = torch.from_numpy(join_documents(documents, ids.eos))
    full, rest = divmod(stream.numel(), seq_len)
    dropped = 0
    if rest and tail == "drop":
        dropped, stream = rest, stream[: full * seq_len]
    elif rest:
        stream = torch.cat([stream, torch.full((seq_len - rest,), ids.pad, dtype=torch.int32)])
        full += 1
    blocks = stream.reshape(full, seq_len)
    if max_blocks is not None and max_blocks < full:
        blocks = blocks[torch.arange(max_blocks) * full // max_blocks].clone()
    targets = int((blocks[:, 1:] != ids.pad).sum())
    return LMBlocks(blocks, targets, dropped)


def topic_documents() -> list[CodeDocument]:
    """The running Python's documentation topics (``pydoc_data.topics``), one document each, by name."""
    topics = importlib.import_module("pydoc_data.topics").topics
    named = sorted(topics.items())
    return [CodeDocument(f"{TOPICS_KEY}/{name}", text) for name, text in named if text.strip()]


def _saved_dataset_documents(path: Path) -> tuple[list[CodeDocument], list[SkippedDocument]]:
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise ImportError(
            f"--data {path} is a dataset written by datasets.save_to_disk; reading it needs the 'datasets' "
            "package, which is not installed (pip install datasets), or give a folder of .txt / .jsonl files"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    splits = loaded if isinstance(loaded, datasets.DatasetDict) else {"data": loaded}
    documents, skipped = [], []
    for name, split in splits.items():
        if "text" not in split.column_names:
            raise ValueError(
                f"--data {path}: split {name!r} has no 'text' column (columns: {split.column_names})"
            )
        for index, text in enumerate(split["text"]):
            key = f"{name}/{index}"
            if isinstance(text, str) and text.strip():
                documents.append(CodeDocument(key, text))
            else:
                skipped.append(SkippedDocument(key, "empty"))
    return documents, skipped


def held_out_split(path: str | Path | None, keys: Sequence[str]) -> str | None:
    """The split of a saved ``DatasetDict`` at ``path`` that is the validation split, from
    the keys of its records (``split/index``, read or skipped): ``"validation"``, else ``"test"``; None when
    ``path`` is no saved dataset or it has neither split (then the split is by hash)."""
    if path is None or not is_saved_dataset(Path(path)):
        return None
    names = {key.partition("/")[0] for key in keys}
    return next((name for name in HELD_OUT_SPLITS if name in names), None)


def read_caps(path: str | Path | None, max_files: int | None, max_bytes: int | None) -> dict[str, Any]:
    """The read caps :func:`read_lm_documents` applies to ``path``, and the file endings it reads there, as
    :func:`comera.data.sources.require_documents` takes them (a saved dataset is read whole)."""
    if path is not None and is_saved_dataset(Path(path)):
        return {}
    extensions = (".py",) if path is None else (".txt",)
    return {"max_files": max_files, "max_bytes": max_bytes, "extensions": extensions}


def read_lm_documents(
    path: str | Path | None = None,
    *,
    max_files: int | None = None,
    max_bytes: int | None = None,
    skip_bad_lines: bool = False,
) -> tuple[list[CodeDocument], list[SkippedDocument]]:
    """The documents of ``path`` (None: the standard library and its topics) and those skipped;
    ``skip_bad_lines`` skips (and counts) a bad or too long JSON line instead of raising.

    Raises:
        FileNotFoundError: ``path`` does not exist (named). ValueError: it is a looping or broken link, it
            holds no ``.txt`` / ``.jsonl`` document, or a bad JSON line (file and line named) unless skipped.
            ImportError: a saved dataset without the ``datasets`` package.
    """
    if path is None:
        documents, skipped = read_code(None, extensions=(".py",), max_files=max_files, max_bytes=max_bytes)
        documents = [document for document in documents if document.key != f"{TOPICS_KEY}.py"]
        return documents + topic_documents(), skipped
    root = check_data_path(path)
    if is_saved_dataset(root):
        return _saved_dataset_documents(root)
    documents, skipped = read_code(
        root,
        extensions=(".txt",),
        max_files=max_files,
        max_bytes=max_bytes,
        text_fields=_TEXT_FIELDS,
        skip_bad_lines=skip_bad_lines,
    )
    if not documents:
        raise ValueError(
            f"--data {root}: no document found ({len(skipped)} skipped); give a folder of .txt files or "
            ".jsonl(.gz) files with a 'text' field, or a dataset saved with datasets.save_to_disk"
        )
    return documents, skipped


@dataclass
class LMData:
    """Everything :func:`build_lm_data` prepares.

    Attributes:
        train, validation: the packed splits (:class:`LMBlocks`; for a prepared corpus
            :class:`comera.data.token_blocks.TokenBlocks`): map-style datasets of ``(seq_len,)`` int64 blocks.
        tokenizer, tokenizer_path: the tokenizer and its ``tokenizer.json``.
        ids: its special ids and vocabulary size.
        info: per split the counts of :func:`comera.data.sources.read_counts`, ``stream_tokens`` (the
            split's documents and their ``</s>``), ``tokens`` (those in its blocks), ``blocks``, ``targets``
            (predicted tokens), ``dropped_tokens`` (the training tail); ``validation_tokens``
            (the validation targets, the tokens a perplexity averages over), the vocabulary size, the
            tokenizer's path, whether it came from the cache, and ``identity``.
    """

    train: Dataset
    validation: Dataset
    tokenizer: Tokenizer
    tokenizer_path: Path
    ids: SpecialIds
    info: dict[str, Any]


def check_lm_data_settings(
    validation_fraction: object,
    max_validation_blocks: object,
    tokenizer_file: object,
    skip_bad_lines: object,
) -> None:
    """``ValueError`` naming the first of these settings out of its range (``FileNotFoundError`` for a
    tokenizer file that is not there), checked before any document is read."""
    if isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float)):
        raise ValueError(f"validation_fraction must be a float in (0, 1), got {validation_fraction!r}")
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be a float in (0, 1), got {validation_fraction!r}")
    blocks = max_validation_blocks
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
        raise ValueError(f"max_validation_blocks must be an int >= 1 or None, got {blocks!r}")
    check_tokenizer_file(tokenizer_file)
    if not isinstance(skip_bad_lines, bool):
        raise ValueError(f"skip_bad_lines must be true or false, got {skip_bad_lines!r}")


def build_lm_data(
    path: str | Path | None = None,
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None = None,
    validation_fraction: float = 0.05,
    max_validation_blocks: int | None = None,
    max_files: int | None = None,
    max_bytes: int | None = None,
    skip_bad_lines: bool = False,
) -> LMData:
    """Read, split, tokenize and pack text for causal language-model training.

    Args:
        path: a folder or file of ``.txt`` / ``.jsonl`` documents or a saved dataset (None: the standard
            library and its topics).
        cache_dir: where the trained tokenizer and the token ids of each split are cached.
        seq_len: tokens per block.
        vocab_size: BPE vocabulary size to train (at most; ignored with ``tokenizer_file``).
        tokenizer_file: a ``tokenizer.json`` or ``save_pretrained`` folder to use instead of training one (its
            special tokens mapped: :mod:`comera.data.special_tokens`).
        validation_fraction: share of document keys (by hash) in validation, in ``(0, 1)`` (not used for a
            saved ``DatasetDict`` with its own validation or test split).
        max_validation_blocks: keep this many validation blocks, evenly spaced over the stream (None: all).
        max_files, max_bytes: caps of what is read (:func:`comera.data.sources.read_code`; 0 or None: no cap).
        skip_bad_lines: skip (and count) bad JSON lines instead of raising (:func:`read_lm_documents`).

    Raises:
        ValueError: a split without documents (naming the counts), or a bad argument.
    """
    check_lm_data_settings(validation_fraction, max_validation_blocks, tokenizer_file, skip_bad_lines)
    documents, skipped = read_lm_documents(
        path, max_files=max_files, max_bytes=max_bytes, skip_bad_lines=skip_bad_lines
    )
    held_out = held_out_split(path, [entry.key for entry in [*documents, *skipped]])
    split_by = held_out_rule(held_out, validation_fraction)
    splits: dict[str, list[CodeDocument]] = {"train": [], "validation": []}
    for document in sorted(documents, key=lambda document: document.key):
        name = split_by(document.key)
        if name is not None:
            splits[name].append(document)
    require_documents(
        splits, path or default_source_dir(), validation_fraction, **read_caps(path, max_files, max_bytes)
    )
    tokenizer, tokenizer_path, cached = load_or_train_tokenizer(
        splits["train"], vocab_size, cache_dir, tokenizer_file
    )
    ids = special_ids(tokenizer)
    encoded = {name: encode_cached(tokenizer, docs, cache_dir, prefix="lm") for name, docs in splits.items()}
    packed = {
        "train": pack_stream(encoded["train"], seq_len, ids, tail="drop"),
        "validation": pack_stream(
            encoded["validation"], seq_len, ids, tail="pad", max_blocks=max_validation_blocks
        ),
    }
    info: dict[str, Any] = {}
    for name, split in splits.items():
        left_out = [entry for entry in skipped if split_by(entry.key) == name]
        blocks = packed[name]
        stream = sum(len(ids) + 1 for ids in encoded[name] if len(ids))
        info[name] = {
            **read_counts(split, left_out),
            "stream_tokens": stream,
            "tokens": min(stream, blocks.tokens.numel()),
            "blocks": len(blocks),
            "targets": blocks.targets,
            "dropped_tokens": blocks.dropped_tokens,
        }
    info.update(
        validation_tokens=packed["validation"].targets,
        vocab_size=ids.vocab_size,
        tokenizer=str(tokenizer_path),
        tokenizer_cached=cached,
        identity={
            "tokenizer": tokenizer_digest(tokenizer),
            "validation": hashlib.sha256(packed["validation"].tokens.numpy().tobytes()).hexdigest(),
        },
    )
    return LMData(packed["train"], packed["validation"], tokenizer, tokenizer_path, ids, info)
