"""Token ids packed into the masked LM's fixed-length blocks.

Packing (:func:`pack_documents`): documents are joined into one stream, each followed by ``</s>``; the
stream is cut into blocks of ``seq_len - 1`` tokens and each block starts with ``<s>``. Every document token
is in exactly one block, in order. The last block, when short, is padded with ``<pad>`` (``tail="pad"``,
attention mask 0 there) or dropped (``tail="drop"``, the dropped tokens counted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from comera.data.bpe import SpecialIds

__all__ = ["TAILS", "PackedBlocks", "pack_documents"]

TAILS = ("pad", "drop")


@dataclass(frozen=True)
class PackedBlocks(Dataset):
    """Fixed-length token blocks of one split (a map-style dataset).

    Attributes:
        tokens: ``(N, seq_len)`` int32 token ids, ``<pad>`` after ``lengths``.
        lengths: ``(N,)`` int64 number of real tokens per block.
        fixed_masking: mask each block the same way every time (evaluation) or anew per batch (training).
        dropped_tokens: document tokens left out by ``tail="drop"``.

    Items are ``{"input_ids": (seq_len,) int64, "length": int, "index": int, "fixed_masking": bool}``.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    fixed_masking: bool = False
    dropped_tokens: int = 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} blocks")
        index %= len(self)
        return {
            "input_ids": self.tokens[index].long(),
            "length": int(self.lengths[index]),
            "index": index,
            "fixed_masking": self.fixed_masking,
        }

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens over all blocks."""
        return int(self.lengths.sum())


def pack_documents(
    documents: Sequence[Sequence[int]],
    seq_len: int,
    ids: SpecialIds,
    *,
    tail: str = "pad",
    fixed_masking: bool = False,
) -> PackedBlocks:
    """Pack token-id lists into blocks ``<s> doc_1 </s> doc_2 </s> ...`` of ``seq_len`` tokens.

    Each document's tokens, then ``</s>``, enter one stream, cut into pieces of ``seq_len - 1`` tokens, each
    behind a ``<s>``. A short last piece is padded with ``<pad>`` (``tail="pad"``) or dropped
    (``tail="drop"``); empty documents add nothing.

    Returns:
        :class:`PackedBlocks` of shape ``(N, seq_len)``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (<s> and one token), got {seq_len!r}")
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    pieces = [
        torch.tensor(list(document) + [ids.eos], dtype=torch.int32) for document in documents if document
    ]
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
    body = seq_len - 1
    full, rest = divmod(stream.numel(), body)
    dropped = 0
    if rest and tail == "drop":
        dropped, stream = rest, stream[: full * body]
    elif rest:
        stream = torch.cat([stream, torch.full((body - rest,), ids.pad, dtype=torch.int32)])
        full += 1
    blocks = torch.cat([torch.full((full, 1), ids.bos, dtype=torch.int32), stream.reshape(full, body)], dim=1)
    lengths = torch.full((full,), seq_len, dtype=torch.int64)
    if rest and tail == "pad":
        lengths[-1] = 1 + rest
    return PackedBlocks(blocks, lengths, fixed_masking, dropped)
