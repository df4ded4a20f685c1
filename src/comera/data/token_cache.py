"""Token ids of documents, encoded with a ``tokenizers`` tokenizer a batch of text at a time (about 4 bytes a
token held) and cached as ``{prefix}-tokens-{digest}.npz`` keyed by the tokenizer and the documents; shared
by the language-model workloads. Details: docs/llm.md, 'Data'.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from comera.atomic import atomic_write
from comera.data.cache import read_entry
from comera.data.sources import CodeDocument, documents_digest
from comera.data.tokenize import tokenizer_digest

__all__ = ["ENCODE_BATCH_BYTES", "encode_cached", "encode_documents", "join_documents"]

ENCODE_BATCH_BYTES = 2**20
"""The text (UTF-8 bytes, at least one document) handed to the tokenizer in one call by
:func:`encode_documents`."""


def _batches(documents: Sequence[CodeDocument], limit: int) -> Iterator[list[str]]:
    """The texts of ``documents`` in order, in runs of at most ``limit`` UTF-8 bytes (a longer text alone)."""
    batch: list[str] = []
    size = 0
    for document in documents:
        length = len(document.text.encode("utf-8"))
        if batch and size + length > limit:
            yield batch
            batch, size = [], 0
        batch.append(document.text)
        size += length
    if batch:
        yield batch


def encode_documents(
    tokenizer: Tokenizer, documents: Sequence[CodeDocument], batch_bytes: int = ENCODE_BATCH_BYTES
) -> list[np.ndarray]:
    """Each document's token ids without special tokens, an ``int32`` array of shape ``(tokens,)``, encoded
    ``batch_bytes`` of text at a time."""
    encoded: list[np.ndarray] = []
    for texts in _batches(documents, batch_bytes):
        for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False):
            encoded.append(np.array(encoding.ids, dtype=np.int32))
    return encoded


def join_documents(documents: Sequence[Sequence[int]], eos: int) -> np.ndarray:
    """The stream ``doc_1 eos doc_2 eos ...`` of ``documents``' token ids as one ``int32`` array of shape
    ``(sum(len(doc) + 1),)`` over the non-empty documents (an empty one adds nothing)."""
    kept = [np.asarray(document, dtype=np.int32) for document in documents if len(document)]
    stream = np.empty(sum(ids.size + 1 for ids in kept), dtype=np.int32)
    position = 0
    for ids in kept:
        stream[position : position + ids.size] = ids
        stream[position + ids.size] = eos
        position += ids.size + 1
    return stream


def _views(ids: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [ids[start:end] for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def encode_cached(
    tokenizer: Tokenizer, documents: Sequence[CodeDocument], cache_dir: str | Path, prefix: str = "code"
) -> list[np.ndarray]:
    """Token ids of ``documents`` (:func:`encode_documents`: one ``int32`` array each), read from or written
    to ``cache_dir`` (``prefix`` names the file)."""
    digest = tokenizer_digest(tokenizer)
    path = Path(cache_dir) / f"{prefix}-tokens-{documents_digest(documents, 'tokens', digest)}.npz"
    cached = read_entry(path, lambda file: _read_ids(file, len(documents)))
    if cached is not None:
        return cached
    encoded = encode_documents(tokenizer, documents)
    offsets = np.cumsum([0] + [ids.size for ids in encoded], dtype=np.int64)
    flat = np.concatenate(encoded) if encoded else np.zeros(0, dtype=np.int32)
    del encoded
    atomic_write(path, lambda file: np.savez(file, ids=flat, offsets=offsets))
    return _views(flat, offsets)


def _read_ids(path: Path, count: int) -> list[np.ndarray]:
    """The token ids of ``count`` documents stored in ``path``; ``ValueError`` where its arrays describe
    another number of documents."""
    with np.load(path, allow_pickle=False) as stored:
        ids, offsets = stored["ids"], stored["offsets"]
    bounds_ok = offsets.shape == (count + 1,) and offsets[0] == 0 and offsets[-1] == ids.size
    if ids.ndim != 1 or not bounds_ok or np.any(np.diff(offsets) < 0):
        raise ValueError(f"its arrays do not describe the token ids of {count} documents")
    return _views(ids, offsets)
