"""The masked-LM workload's data read from token shards (a ``comera prepare mlm`` folder, a raw ``--data``
corpus or the embedded corpus prepared into the cache) as :class:`ShardBlocks`, masked on the fly by the
same collate function as in memory. Details: docs/llm.md, 'Bringing a corpus' ('The masked LM').
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from comera.data.bpe import special_ids
from comera.data.cached_preparation import check_layout, prepare_into_cache, read_cap
from comera.data.embedded import prepare_embedded
from comera.data.prepare import PrepareSettings
from comera.data.shard_check import check_shards
from comera.data.sources import (
    DEFAULT_EXTENSIONS,
    CodeDocument,
    default_source_dir,
    read_code,
    read_counts,
    require_documents,
    split_of,
)
from comera.data.special_tokens import CONVENTIONAL_NAMES
from comera.data.token_shards import TOKENIZER_FILE, open_shard, read_index, split_counts
from comera.data.tokenize import tokenizer_digest
from comera.workloads.mlm.data import CodeData, check_code_data_settings
from comera.workloads.mlm.masking import MaskingCollator
from comera.workloads.mlm.packing import ShardBlocks

__all__ = ["MLM_TEXT_FIELDS", "build_embedded_code_data", "build_prepared_code_data", "build_raw_code_data"]

MLM_TEXT_FIELDS = ("code", "original_string", "text")
"""The JSON fields (and Parquet columns) a masked-LM corpus's text is read from when it is prepared, the
first present: the workload's CodeSearchNet fields, then C4's ``text``."""


def _open(
    folder: Path, cache_dir: str | Path, seq_len: int, tail: str, mask_probability: float, seed: int
) -> tuple[dict[str, ShardBlocks], MaskingCollator, Tokenizer, dict[str, Any], int]:
    """The two splits' blocks of the prepared corpus in ``folder``, the collator, the tokenizer, the index
    and the number of shards hashed."""
    index = read_index(folder)
    if not index.get("complete"):
        source = index.get("source", {}).get("path", "SOURCE")
        raise ValueError(
            f"--data {folder}: the preparation did not finish; complete it with comera prepare mlm --data "
            f"{source} --out {folder} (the same settings)"
        )
    hashed = check_shards(folder, index, cache_dir)
    try:
        tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    except Exception as error:
        raise ValueError(f"--data {folder}: {TOKENIZER_FILE} cannot be read ({error})") from None
    if tokenizer_digest(tokenizer) != index["tokenizer"]["sha256"]:
        raise ValueError(
            f"--data {folder}: {TOKENIZER_FILE} is not the tokenizer the shards were encoded with (its "
            "digest differs from the index's); prepare the corpus again"
        )
    names = index["tokenizer"].get("special_tokens")
    ids = special_ids(tokenizer, names)
    if (ids.eos, ids.pad) != (index["eos_id"], index["pad_id"]):
        raise ValueError(f"--data {folder}: the tokenizer's </s> and <pad> ids differ from the index's")
    if ids.mask is None:
        raise ValueError(
            f"--data {folder}: the masked LM needs a mask token, and the tokenizer the corpus was prepared "
            f"with has none (none of {list(CONVENTIONAL_NAMES['mask'])}); prepare it with a tokenizer that "
            "has one"
        )
    dtype = np.dtype(index["dtype"])
    splits = {
        name: ShardBlocks(
            [open_shard(folder, entry, dtype) for entry in index["splits"][name]["shards"]],
            seq_len,
            ids,
            tail=tail,
            fixed_masking=name == "validation",
        )
        for name in ("train", "validation")
    }
    collator = MaskingCollator(ids, mask_probability=mask_probability, seed=seed)
    return splits, collator, tokenizer, index, hashed


def _facts(blocks: ShardBlocks) -> dict[str, int]:
    return {"tokens": blocks.num_tokens, "blocks": len(blocks), "dropped_tokens": blocks.dropped_tokens}


def build_prepared_code_data(
    folder: str | Path,
    *,
    cache_dir: str | Path,
    seq_len: int,
    tail: str = "pad",
    mask_probability: float = 0.15,
    seed: int = 0,
    tokenizer_file: str | Path | None = None,
    **prepared_settings: Any,
) -> CodeData:
    """The masked-LM blocks of the prepared corpus in ``folder``.

    Args:
        folder: a folder written by ``comera prepare mlm`` (or ``llm``: the layout is the same).
        cache_dir: where the record of checked shards is kept.
        seq_len: tokens per block, ``<s>`` included (>= 3).
        tail: ``"pad"`` or ``"drop"`` the short last block of each split.
        mask_probability, seed: of the :class:`MaskingCollator`.
        tokenizer_file: must be None (the prepared tokenizer is the one).
        prepared_settings: the other ``data`` settings, which the preparation decided (not used).

    Raises:
        ValueError: an unfinished or unreadable index, a shard that does not match it (named), a tokenizer
            that is not the recorded one, ``tokenizer_file`` set, a bad argument.
    """
    folder = Path(folder)
    if tokenizer_file is not None:
        raise ValueError(
            f"data.tokenizer_file does not apply to the prepared corpus {folder}: its shards were encoded "
            f"with {folder / TOKENIZER_FILE}; unset data.tokenizer_file, or prepare the corpus with it"
        )
    splits, collator, tokenizer, index, hashed = _open(
        folder, cache_dir, seq_len, tail, mask_probability, seed
    )
    info: dict[str, Any] = {
        name: {**split_counts(index, name), **_facts(blocks)} for name, blocks in splits.items()
    }
    skipped = index.get("skipped", {})
    info.update(
        vocab_size=tokenizer.get_vocab_size(),
        tokenizer=str(folder / TOKENIZER_FILE),
        tokenizer_cached=True,
        identity={"tokenizer": index["tokenizer"]["sha256"]},
        prepared={
            "folder": str(folder.resolve()),
            "skipped": skipped.get("total", 0),
            "shards_hashed": hashed,
            "settings": index.get("settings", {}),
        },
    )
    ids = special_ids(tokenizer, index["tokenizer"].get("special_tokens"))
    return CodeData(
        splits["train"], splits["validation"], collator, tokenizer, folder / TOKENIZER_FILE, ids, info
    )


def build_raw_code_data(
    path: str | Path,
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None = None,
    extensions: tuple[str, ...] | list[str] = DEFAULT_EXTENSIONS,
    validation_fraction: float = 0.05,
    max_files: int | None = None,
    max_bytes: int | None = None,
    skip_bad_lines: bool = False,
    layout: str = "stream",
    tail: str = "pad",
    mask_probability: float = 0.15,
    seed: int = 0,
) -> CodeData:
    """A ``--data`` corpus that is not prepared (source files, JSON lines, Parquet files) prepared into token
    shards in the cache and read through their memory maps: ``layout="stream"`` as ``comera prepare mlm``
    reads it, ``layout="whole"`` in :func:`comera.data.sources.read_code`'s order with the tokenizer
    trained on the whole training split (what older run folders resume with); other arguments as
    :func:`comera.workloads.mlm.data.build_code_data`.
    """
    check_code_data_settings(validation_fraction, tokenizer_file)
    if check_layout(layout) == "whole":
        return _build_whole(
            path,
            cache_dir=cache_dir,
            seq_len=seq_len,
            vocab_size=vocab_size,
            tokenizer_file=tokenizer_file,
            extensions=extensions,
            validation_fraction=validation_fraction,
            max_files=max_files,
            max_bytes=max_bytes,
            skip_bad_lines=skip_bad_lines,
            tail=tail,
            mask_probability=mask_probability,
            seed=seed,
        )
    settings = PrepareSettings(
        vocab_size=vocab_size,
        validation_fraction=validation_fraction,
        tokenizer_file=tokenizer_file,
        skip_bad_lines=skip_bad_lines,
        whole_files=tuple(extensions),
        text_fields=MLM_TEXT_FIELDS,
        needs_mask=True,
    )
    cached = prepare_into_cache(
        path,
        cache_dir,
        "code",
        settings,
        max_files=read_cap(max_files, "max_files"),
        max_bytes=read_cap(max_bytes, "max_bytes"),
    )
    code = build_prepared_code_data(
        cached.folder,
        cache_dir=cache_dir,
        seq_len=seq_len,
        tail=tail,
        mask_probability=mask_probability,
        seed=seed,
    )
    code.info["prepared"].update(from_data=str(Path(path).resolve()), prepared_now=cached.prepared_now)
    return code


def build_embedded_code_data(
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None = None,
    extensions: tuple[str, ...] | list[str] = DEFAULT_EXTENSIONS,
    validation_fraction: float = 0.05,
    max_files: int | None = None,
    max_bytes: int | None = None,
    skip_bad_lines: bool = False,
    layout: str = "stream",
    tail: str = "pad",
    mask_probability: float = 0.15,
    seed: int = 0,
) -> CodeData:
    """The embedded corpus (the standard library's sources, read by
    :func:`comera.data.sources.read_code` in its reading order) prepared into token shards in the cache
    (:func:`comera.data.embedded.prepare_embedded`) and read through their memory maps: the blocks, masks,
    tokenizer and ``info`` of :func:`comera.workloads.mlm.data.build_code_data` on the same documents, plus
    ``info["prepared"]`` naming the cached folder. Arguments as there; ``layout`` is checked, not used (the
    embedded corpus is always read whole).
    """
    check_code_data_settings(validation_fraction, tokenizer_file)
    check_layout(layout)
    return _build_whole(
        None,
        cache_dir=cache_dir,
        seq_len=seq_len,
        vocab_size=vocab_size,
        tokenizer_file=tokenizer_file,
        extensions=extensions,
        validation_fraction=validation_fraction,
        max_files=max_files,
        max_bytes=max_bytes,
        skip_bad_lines=skip_bad_lines,
        tail=tail,
        mask_probability=mask_probability,
        seed=seed,
    )


def _build_whole(
    path: str | Path | None,
    *,
    cache_dir: str | Path,
    seq_len: int,
    vocab_size: int,
    tokenizer_file: str | Path | None,
    extensions: tuple[str, ...] | list[str],
    validation_fraction: float,
    max_files: int | None,
    max_bytes: int | None,
    skip_bad_lines: bool,
    tail: str,
    mask_probability: float,
    seed: int,
) -> CodeData:
    """The documents of ``path`` (None: the standard library) read whole by
    :func:`comera.data.sources.read_code`, prepared in its order into the cache
    (:func:`comera.data.embedded.prepare_embedded`) and read through the memory maps."""
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
    if path is None:
        name = f"the standard library sources ({', '.join(extensions)})"
    else:
        name = f"--data {Path(path).resolve()}, read whole"
    embedded = prepare_embedded(
        documents,
        name=name,
        cache_dir=cache_dir,
        prefix="code",
        vocab_size=vocab_size,
        validation_fraction=validation_fraction,
        tokenizer_file=tokenizer_file,
    )
    del documents, splits
    blocks, collator, tokenizer, index, _ = _open(
        embedded.folder, cache_dir, seq_len, tail, mask_probability, seed
    )
    info: dict[str, Any] = {name: {**counts[name], **_facts(each)} for name, each in blocks.items()}
    info.update(
        vocab_size=tokenizer.get_vocab_size(),
        tokenizer=str(embedded.tokenizer_path),
        tokenizer_cached=embedded.tokenizer_cached,
        identity={"tokenizer": tokenizer_digest(embedded.tokenizer)},
        prepared={
            "folder": str(embedded.folder),
            "embedded": path is None,
            "layout": "whole",
            "prepared_now": embedded.prepared_now,
        },
    )
    ids = special_ids(tokenizer, index["tokenizer"].get("special_tokens"))
    return CodeData(
        blocks["train"],
        blocks["validation"],
        collator,
        embedded.tokenizer,
        embedded.tokenizer_path,
        ids,
        info,
    )
