"""The language-model workload's data from token shards: a corpus prepared by ``comera prepare llm``, a raw
``--data`` corpus or the embedded one prepared into the cache, read as blocks through memory maps, every
shard checked against the index first. Details: docs/llm.md, 'Bringing a corpus' ('Training').
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from comera.data.bpe import special_ids
from comera.data.cached_preparation import check_layout, prepare_into_cache, read_cap
from comera.data.embedded import prepare_embedded
from comera.data.prepare import PrepareSettings
from comera.data.saved_dataset import held_out_rule
from comera.data.shard_check import check_shards
from comera.data.sources import CodeDocument, default_source_dir, read_counts, require_documents
from comera.data.token_blocks import TokenBlocks, spread_blocks
from comera.data.token_shards import TOKENIZER_FILE, open_shard, read_index, split_counts
from comera.data.tokenize import tokenizer_digest
from comera.workloads.llm.data import (
    LMData,
    check_lm_data_settings,
    held_out_split,
    read_caps,
    read_lm_documents,
)

__all__ = [
    "build_embedded_lm_data",
    "build_prepared_lm_data",
    "build_raw_lm_data",
]


def _split_blocks(
    folder: Path, index: dict[str, Any], split: str, seq_len: int, **options: Any
) -> TokenBlocks:
    dtype = np.dtype(index["dtype"])
    shards = [open_shard(folder, entry, dtype) for entry in index["splits"][split]["shards"]]
    return TokenBlocks(shards, seq_len, **options)


def _validation_facts(blocks: TokenBlocks, pad: int) -> tuple[int, str]:
    """The predicted tokens of ``blocks`` (positions 1.. that are not ``pad``) and the SHA-256 of their ids
    as one ``(N, seq_len)`` int32 array (as :func:`comera.workloads.llm.data.build_lm_data` digests its
    own)."""
    digest = hashlib.sha256()
    targets = 0
    for number in range(len(blocks)):
        block = blocks[number].numpy()
        targets += int(np.count_nonzero(block[1:] != pad))
        digest.update(block.astype(np.int32).tobytes())
    return targets, digest.hexdigest()


def build_prepared_lm_data(
    folder: str | Path,
    *,
    cache_dir: str | Path,
    seq_len: int,
    max_validation_blocks: int | None = None,
    tokenizer_file: str | Path | None = None,
    **prepared_settings: Any,
) -> LMData:
    """The blocks of the prepared corpus in ``folder``.

    Args:
        folder: a folder written by ``comera prepare llm`` (``index.json``, ``tokenizer.json``, shards).
        cache_dir: where the record of checked shards is kept (:mod:`comera.data.shard_check`).
        seq_len: tokens per block (>= 2).
        max_validation_blocks: validation blocks kept, spread evenly (None: all).
        tokenizer_file: must be None (the prepared tokenizer is the one).
        prepared_settings: the other ``data`` settings, which the preparation decided (not used).

    Raises:
        ValueError: an index that is unfinished or unreadable, a shard that does not match the index (named),
            a tokenizer that is not the recorded one, ``tokenizer_file`` set, a bad argument.
    """
    folder = Path(folder)
    if tokenizer_file is not None:
        raise ValueError(
            f"data.tokenizer_file does not apply to the prepared corpus {folder}: its shards were encoded "
            f"with {folder / TOKENIZER_FILE}; unset data.tokenizer_file, or prepare the corpus with it"
        )
    blocks = max_validation_blocks
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
        raise ValueError(f"max_validation_blocks must be an int >= 1 or None, got {blocks!r}")
    index = read_index(folder)
    if not index.get("complete"):
        source = index.get("source", {}).get("path", "SOURCE")
        raise ValueError(
            f"--data {folder}: the preparation did not finish; complete it with comera prepare llm --data "
            f"{source} --out {folder} (the same settings)"
        )
    hashed = check_shards(folder, index, cache_dir)
    tokenizer_path = folder / TOKENIZER_FILE
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:
        raise ValueError(f"--data {folder}: {TOKENIZER_FILE} cannot be read ({error})") from None
    if tokenizer_digest(tokenizer) != index["tokenizer"]["sha256"]:
        raise ValueError(
            f"--data {folder}: {TOKENIZER_FILE} is not the tokenizer the shards were encoded with (its "
            "digest differs from the index's); prepare the corpus again"
        )
    ids = special_ids(tokenizer, index["tokenizer"].get("special_tokens"))
    if (ids.eos, ids.pad) != (index["eos_id"], index["pad_id"]):
        raise ValueError(f"--data {folder}: the tokenizer's </s> and <pad> ids differ from the index's")
    train = _split_blocks(folder, index, "train", seq_len)
    whole = _split_blocks(folder, index, "validation", seq_len, pad_id=ids.pad)
    selection = spread_blocks(whole.blocks, max_validation_blocks)
    validation = _split_blocks(folder, index, "validation", seq_len, pad_id=ids.pad, selection=selection)
    targets, validation_digest = _validation_facts(validation, ids.pad)
    info: dict[str, Any] = {}
    for name, split in (("train", train), ("validation", validation)):
        recorded = index["splits"][name]
        info[name] = {
            **split_counts(index, name),
            "stream_tokens": split.stream_tokens,
            "tokens": min(split.stream_tokens, len(split) * seq_len),
            "blocks": len(split),
            "shards": len(recorded["shards"]),
            "dropped_tokens": split.dropped_tokens,
        }
    info["validation"]["targets"] = targets
    skipped = index.get("skipped", {})
    info.update(
        validation_tokens=targets,
        vocab_size=ids.vocab_size,
        tokenizer=str(tokenizer_path),
        tokenizer_cached=True,
        prepared={
            "folder": str(folder.resolve()),
            "skipped": skipped.get("total", 0),
            **{f"skipped_{reason}": count for reason, count in skipped.get("by_reason", {}).items()},
            "shards_hashed": hashed,
            "settings": index.get("settings", {}),
        },
        identity={"tokenizer": index["tokenizer"]["sha256"], "validation": validation_digest},
    )
    return LMData(train, validation, tokenizer, tokenizer_path, ids, info)


def build_raw_lm_data(
    path: str | Path,
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
    layout: str = "stream",
) -> LMData:
    """A ``--data`` corpus that is not prepared (text files, JSON lines, Parquet files) prepared into token
    shards in the cache and read through their memory maps: ``layout="stream"`` as ``comera prepare llm``
    does, ``layout="whole"`` as :func:`comera.workloads.llm.data.build_lm_data` does in memory (what older
    run folders resume with).

    Args:
        path: the corpus file or folder.
        layout: ``"stream"`` or ``"whole"``.
        cache_dir, seq_len, vocab_size, tokenizer_file, validation_fraction, max_validation_blocks,
            max_files, max_bytes, skip_bad_lines: as :func:`~comera.workloads.llm.data.build_lm_data`.

    Raises:
        ValueError: a bad argument (named), a split without documents, a bad JSON line (named) unless
            skipped. FileNotFoundError: ``path`` does not exist. ImportError: a Parquet file without pyarrow.
    """
    check_lm_data_settings(validation_fraction, max_validation_blocks, tokenizer_file, skip_bad_lines)
    if check_layout(layout) == "whole":
        return _build_whole(
            path,
            cache_dir=cache_dir,
            seq_len=seq_len,
            vocab_size=vocab_size,
            tokenizer_file=tokenizer_file,
            validation_fraction=validation_fraction,
            max_validation_blocks=max_validation_blocks,
            max_files=max_files,
            max_bytes=max_bytes,
            skip_bad_lines=skip_bad_lines,
        )
    settings = PrepareSettings(
        vocab_size=vocab_size,
        validation_fraction=validation_fraction,
        tokenizer_file=tokenizer_file,
        skip_bad_lines=skip_bad_lines,
    )
    cached = prepare_into_cache(
        path,
        cache_dir,
        "lm",
        settings,
        max_files=read_cap(max_files, "max_files"),
        max_bytes=read_cap(max_bytes, "max_bytes"),
    )
    lm = build_prepared_lm_data(
        cached.folder, cache_dir=cache_dir, seq_len=seq_len, max_validation_blocks=max_validation_blocks
    )
    lm.info["prepared"].update(from_data=str(Path(path).resolve()), prepared_now=cached.prepared_now)
    return lm


def build_embedded_lm_data(
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
    layout: str = "stream",
) -> LMData:
    """The embedded corpus (the standard library and its documentation topics) prepared into token shards in
    the cache and read through their memory maps: the blocks, tokenizer and ``info`` of
    :func:`comera.workloads.llm.data.build_lm_data`, plus ``info["prepared"]``.

    Args:
        cache_dir, seq_len, vocab_size, tokenizer_file, validation_fraction, max_validation_blocks,
            max_files, max_bytes: as :func:`~comera.workloads.llm.data.build_lm_data`.
        skip_bad_lines: checked, not used (the embedded corpus has no JSON lines).
        layout: checked, not used (the embedded corpus is always read whole).

    Raises:
        ValueError: a bad argument (named), a split without documents.
    """
    check_lm_data_settings(validation_fraction, max_validation_blocks, tokenizer_file, skip_bad_lines)
    check_layout(layout)
    return _build_whole(
        None,
        cache_dir=cache_dir,
        seq_len=seq_len,
        vocab_size=vocab_size,
        tokenizer_file=tokenizer_file,
        validation_fraction=validation_fraction,
        max_validation_blocks=max_validation_blocks,
        max_files=max_files,
        max_bytes=max_bytes,
        skip_bad_lines=skip_bad_lines,
    )


def _build_whole(
    path: str | Path | None,
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None,
    validation_fraction: float,
    max_validation_blocks: int | None,
    max_files: int | None,
    max_bytes: int | None,
    skip_bad_lines: bool,
) -> LMData:
    """The documents of ``path`` (None: the embedded corpus) read whole, in key order, prepared into the
    cache (:func:`comera.data.embedded.prepare_embedded`) and read through the memory maps."""
    documents, skipped = read_lm_documents(
        path, max_files=max_files, max_bytes=max_bytes, skip_bad_lines=skip_bad_lines
    )
    documents = sorted(documents, key=lambda document: document.key)
    held_out = held_out_split(path, [entry.key for entry in [*documents, *skipped]])
    split_by = held_out_rule(held_out, validation_fraction)
    splits: dict[str, list[CodeDocument]] = {"train": [], "validation": []}
    for document in documents:
        name = split_by(document.key)
        if name is not None:
            splits[name].append(document)
    require_documents(
        splits, path or default_source_dir(), validation_fraction, **read_caps(path, max_files, max_bytes)
    )
    if path is None:
        name = f"the standard library and documentation topics of Python {platform.python_version()}"
    else:
        name = f"--data {Path(path).resolve()}, read whole"
    embedded = prepare_embedded(
        [document for document in documents if split_by(document.key) is not None],
        name=name,
        cache_dir=cache_dir,
        prefix="lm",
        vocab_size=vocab_size,
        validation_fraction=validation_fraction,
        tokenizer_file=tokenizer_file,
        held_out=held_out,
    )
    del documents
    lm = build_prepared_lm_data(
        embedded.folder, cache_dir=cache_dir, seq_len=seq_len, max_validation_blocks=max_validation_blocks
    )
    info = lm.info
    for name, split in splits.items():
        left_out = [entry for entry in skipped if split_by(entry.key) == name]
        facts = info[name]
        blocks = facts["blocks"]
        info[name] = {
            **read_counts(split, left_out),
            "stream_tokens": facts["stream_tokens"],
            "tokens": facts["tokens"],
            "blocks": blocks,
            "targets": facts["targets"] if name == "validation" else blocks * (seq_len - 1),
            "dropped_tokens": facts["dropped_tokens"],
        }
    info.update(
        tokenizer=str(embedded.tokenizer_path if tokenizer_file is None else info["tokenizer"]),
        tokenizer_cached=embedded.tokenizer_cached,
        prepared={
            "folder": str(embedded.folder),
            "embedded": path is None,
            "layout": "whole",
            "prepared_now": embedded.prepared_now,
        },
    )
    return LMData(lm.train, lm.validation, embedded.tokenizer, Path(info["tokenizer"]), lm.ids, info)
