"""Token ids of documents, encoded with a ``tokenizers`` tokenizer and cached on disk: shared by the
language-model workloads (the masked LM's and the causal LM's data).

The cache file is ``{prefix}-tokens-{digest}.npz`` in a cache folder: plain arrays (the concatenated ids and
the offsets of each document), keyed by the tokenizer (:func:`comera.data.tokenize.tokenizer_digest`) and
the documents (keys and contents, :func:`comera.data.sources.documents_digest`), read back without pickle.
A file that cannot be read, or whose arrays do not describe as many documents, is encoded again and replaced
(:func:`comera.data.cache.read_entry`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from comera.atomic import atomic_write_bytes
from comera.data.cache import read_entry
from comera.data.sources import CodeDocument, documents_digest
from comera.data.tokenize import tokenizer_digest

__all__ = ["encode_documents", "encode_cached"]


def encode_documents(tokenizer: Tokenizer, documents: Sequence[CodeDocument]) -> list[list[int]]:
    """Each document's token ids, without special tokens."""
    encodings = tokenizer.encode_batch_fast(
        [document.text for document in documents], add_special_tokens=False
    )
    return [encoding.ids for encoding in encodings]


def encode_cached(
    tokenizer: Tokenizer, documents: Sequence[CodeDocument], cache_dir: str | Path, prefix: str = "code"
) -> list[list[int]]:
    """Token ids of ``documents`` (:func:`encode_documents`), read from or written to ``cache_dir`` (module
    docstring; ``prefix`` names the file)."""
    digest = tokenizer_digest(tokenizer)
    path = Path(cache_dir) / f"{prefix}-tokens-{documents_digest(documents, 'tokens', digest)}.npz"
    cached = read_entry(path, lambda file: _read_ids(file, len(documents)))
    if cached is not None:
        return cached
    encoded = encode_documents(tokenizer, documents)
    offsets = np.cumsum([0] + [len(ids) for ids in encoded], dtype=np.int64)
    flat = np.fromiter((token for ids in encoded for token in ids), dtype=np.int32, count=int(offsets[-1]))
    buffer = io.BytesIO()
    np.savez(buffer, ids=flat, offsets=offsets)
    atomic_write_bytes(path, buffer.getvalue())
    return encoded


def _read_ids(path: Path, count: int) -> list[list[int]]:
    """The token ids of ``count`` documents stored in ``path``; ``ValueError`` where its arrays describe
    another number of documents."""
    with np.load(path, allow_pickle=False) as stored:
        ids, offsets = stored["ids"], stored["offsets"]
    bounds_ok = offsets.shape == (count + 1,) and offsets[0] == 0 and offsets[-1] == ids.size
    if ids.ndim != 1 or not bounds_ok or np.any(np.diff(offsets) < 0):
        raise ValueError(f"its arrays do not describe the token ids of {count} documents")
    return [ids[start:end].tolist() for start, end in zip(offsets[:-1], offsets[1:])]
