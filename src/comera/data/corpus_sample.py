"""A bounded, deterministic sample of documents drawn across a whole corpus, read once: the documents of
lowest key hash whose texts hold at most ``budget_bytes``, what a prepared corpus's tokenizer is trained
on. Details: docs/llm.md, 'Bringing a corpus' ('The tokenizer').
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable

from comera.checks import check_int
from comera.data.sources import CodeDocument

__all__ = ["DEFAULT_SAMPLE_MB", "sample_hash", "sample_documents"]

DEFAULT_SAMPLE_MB = 100
"""The tokenizer's training sample, in MB (10**6 bytes of UTF-8 text), unless told otherwise."""


def sample_hash(key: str) -> int:
    """A document's sample hash: the first 8 bytes of SHA-256 of ``"sample\\x1f" + key``, as an int."""
    return int.from_bytes(hashlib.sha256(f"sample\x1f{key}".encode()).digest()[:8], "big")


def sample_documents(documents: Iterable[CodeDocument], budget_bytes: int) -> list[CodeDocument]:
    """The documents of lowest :func:`sample_hash` whose texts hold at most ``budget_bytes`` bytes together,
    in hash order.

    Args:
        documents: read once, in any order.
        budget_bytes: the most UTF-8 bytes of text in the sample (>= 1).
    """
    check_int(budget_bytes, "budget_bytes", 1)
    heap: list[tuple[int, str, str, int]] = []  # (-hash, key, text, bytes): the highest hash on top
    held = 0
    cut = None  # the lowest hash left out for the budget: no document from there on can be in the sample
    for document in documents:
        rank = sample_hash(document.key)
        if cut is not None and rank >= cut:
            continue
        size = len(document.text.encode("utf-8"))
        heapq.heappush(heap, (-rank, document.key, document.text, size))
        held += size
        while held > budget_bytes:
            negative, _, _, dropped = heapq.heappop(heap)
            held -= dropped
            cut = -negative if cut is None else min(cut, -negative)
    return [CodeDocument(key, text) for _, key, text, _ in sorted(heap, reverse=True)]
