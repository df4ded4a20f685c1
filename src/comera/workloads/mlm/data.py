"""The masked-LM workload's data built in memory: source code read and split, a local BPE tokenizer, token ids
cached per split, packed into blocks and masked by the collate function: :func:`build_code_data`. Details:
docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from comera.data.bpe import SpecialIds, check_tokenizer_file, load_or_train_tokenizer, special_ids
from comera.data.sources import (
    DEFAULT_EXTENSIONS,
    CodeDocument,
    default_source_dir,
    read_code,
    read_counts,
    require_documents,
    split_of,
)
from comera.data.token_cache import encode_cached
from comera.data.tokenize import tokenizer_digest
from comera.workloads.mlm.masking import MaskingCollator
from comera.workloads.mlm.packing import PackedBlocks, ShardBlocks, pack_documents

__all__ = ["CodeData", "build_code_data", "check_code_data_settings"]


@dataclass
class CodeData:
    """Everything :func:`build_code_data` prepares.

    Attributes:
        train, validation: the packed splits (validation with fixed masking): :class:`PackedBlocks` in
            memory, or :class:`~comera.workloads.mlm.packing.ShardBlocks` over a prepared corpus's shards.
        collator: the masking ``collate_fn`` for both.
        tokenizer, tokenizer_path: the tokenizer and its ``tokenizer.json``.
        ids: its special ids and vocabulary size.
        info: counts per split (:func:`read_counts`, skipped entries assigned to splits by their key;
            ``tokens``, ``blocks``, ``dropped_tokens``), the vocabulary size, the tokenizer path and
            whether it came from the cache.
    """

    train: PackedBlocks | ShardBlocks
    validation: PackedBlocks | ShardBlocks
    collator: MaskingCollator
    tokenizer: Tokenizer
    tokenizer_path: Path
    ids: SpecialIds
    info: dict[str, Any]


def check_code_data_settings(validation_fraction: object, tokenizer_file: object) -> None:
    """``ValueError`` naming the split fraction or the tokenizer file when out of range
    (``FileNotFoundError`` for a tokenizer file that is not there), before any document is read."""
    bad = isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float))
    if bad or not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be a float in (0, 1), got {validation_fraction!r}")
    check_tokenizer_file(tokenizer_file)


def build_code_data(
    path: str | Path | None = None,
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None = None,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    validation_fraction: float = 0.05,
    max_files: int | None = None,
    max_bytes: int | None = None,
    skip_bad_lines: bool = False,
    tail: str = "pad",
    mask_probability: float = 0.15,
    seed: int = 0,
) -> CodeData:
    """Read, split, tokenize and pack code for masked-LM pre-training.

    Args:
        path: data file or folder (None: the standard library); see :func:`read_code`.
        cache_dir: where the trained tokenizer and the token ids of each split are cached.
        seq_len: tokens per block (the model's maximum length).
        vocab_size: BPE vocabulary size to train (ignored with ``tokenizer_file``).
        tokenizer_file: a ``tokenizer.json`` to use instead of training one.
        extensions, max_files, max_bytes, skip_bad_lines: as :func:`read_code`.
        validation_fraction: share of documents (by key hash) in validation, in ``(0, 1)``.
        tail: ``"pad"`` or ``"drop"`` for the short last block of each split (:func:`pack_documents`).
        mask_probability, seed: of the :class:`MaskingCollator`.

    Raises:
        ValueError: a split has no documents (naming the counts), or a bad argument or input line.
    """
    check_code_data_settings(validation_fraction, tokenizer_file)
    documents, skipped = read_code(
        path, extensions=extensions, skip_bad_lines=skip_bad_lines, max_files=max_files, max_bytes=max_bytes
    )
    splits: dict[str, list[CodeDocument]] = {"train": [], "validation": []}
    for document in documents:
        splits[split_of(document.key, validation_fraction)].append(document)
    counts = {
        name: read_counts(
            split, [entry for entry in skipped if split_of(entry.key, validation_fraction) == name]
        )
        for name, split in splits.items()
    }
    require_documents(
        splits, path or default_source_dir(), validation_fraction, max_files, max_bytes, extensions
    )
    tokenizer, tokenizer_path, cached = load_or_train_tokenizer(
        splits["train"], vocab_size, cache_dir, tokenizer_file
    )
    ids = special_ids(tokenizer)
    packed = {
        name: pack_documents(
            encode_cached(tokenizer, split, cache_dir),
            seq_len,
            ids,
            tail=tail,
            fixed_masking=name == "validation",
        )
        for name, split in splits.items()
    }
    info: dict[str, Any] = {
        name: {
            **counts[name],
            "tokens": blocks.num_tokens,
            "blocks": len(blocks),
            "dropped_tokens": blocks.dropped_tokens,
        }
        for name, blocks in packed.items()
    }
    info.update(
        vocab_size=ids.vocab_size,
        tokenizer=str(tokenizer_path),
        tokenizer_cached=cached,
        identity={"tokenizer": tokenizer_digest(tokenizer)},
    )
    collator = MaskingCollator(ids, mask_probability=mask_probability, seed=seed)
    return CodeData(packed["train"], packed["validation"], collator, tokenizer, tokenizer_path, ids, info)
