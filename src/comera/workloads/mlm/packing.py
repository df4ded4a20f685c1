"""Token ids packed into the masked LM's fixed-length blocks ``<s>`` + ``seq_len - 1`` tokens of the stream
``doc_1 </s> doc_2 </s> ...``, the short last block padded or dropped, in memory (:func:`pack_documents`)
or over memory-mapped shards (:class:`ShardBlocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from comera.data.bpe import SpecialIds
from comera.data.token_blocks import TokenBlocks
from comera.data.token_cache import join_documents

__all__ = ["TAILS", "PackedBlocks", "ShardBlocks", "pack_documents"]

TAILS = ("pad", "drop")


@dataclass(frozen=True)
class PackedBlocks(Dataset):
    """Fixed-length token blocks of one split (a map-style dataset of ``{"input_ids": (seq_len,) int64,
    "length": int, "index": int, "fixed_masking": bool}`` items).

    Attributes:
        tokens: ``(N, seq_len)`` int32 token ids, ``<pad>`` after ``lengths``.
        lengths: ``(N,)`` int64 number of real tokens per block.
        fixed_masking: mask each block the same way every time (evaluation) or anew per batch (training).
        dropped_tokens: document tokens left out by ``tail="drop"``.
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
    """Pack token-id lists into blocks ``<s> doc_1 </s> doc_2 </s> ...`` of ``seq_len`` tokens, the short last
    piece padded with ``<pad>`` (``tail="pad"``) or dropped (``tail="drop"``).

    Returns:
        :class:`PackedBlocks` of shape ``(N, seq_len)``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2 (<s> and one token), got {seq_len!r}")
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    stream = torch.from_numpy(join_documents(documents, ids.eos))
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


class ShardBlocks(Dataset):
    """:func:`pack_documents`'s blocks of a token stream held in memory-mapped shards
    (:class:`comera.data.token_blocks.TokenBlocks`): block ``i`` is ``<s>`` and the stream's tokens ``[i *
    (seq_len - 1), (i + 1) * (seq_len - 1))``, the short last piece padded with ``<pad>`` or dropped, read
    when it is asked for. Items are :class:`PackedBlocks`'s, so the same collate function masks them.

    Args:
        shards: the stream's pieces in order (``doc_1 </s> doc_2 </s> ...``), ``numpy.memmap`` arrays.
        seq_len: tokens per block (>= 3: ``<s>`` and at least two stream tokens).
        ids: the tokenizer's special ids (``bos`` leads each block, ``pad`` fills a padded tail).
        tail: ``"pad"`` or ``"drop"``.
        fixed_masking: as :class:`PackedBlocks`.

    Attributes:
        num_tokens: real tokens over all blocks, ``<s>`` included (as :attr:`PackedBlocks.num_tokens`).
        dropped_tokens: stream tokens left out by ``tail="drop"``.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        seq_len: int,
        ids: SpecialIds,
        *,
        tail: str = "pad",
        fixed_masking: bool = False,
    ) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 3:
            raise ValueError(f"seq_len must be an int >= 3 (<s> and two tokens), got {seq_len!r}")
        if tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
        self.blocks = TokenBlocks(shards, seq_len - 1, pad_id=ids.pad if tail == "pad" else None)
        self.seq_len, self.bos, self.fixed_masking = seq_len, ids.bos, fixed_masking
        self.dropped_tokens = self.blocks.dropped_tokens
        self.num_tokens = min(self.blocks.stream_tokens, len(self.blocks) * (seq_len - 1)) + len(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} blocks")
        index %= len(self)
        body = self.blocks.block(index)
        start = index * (self.seq_len - 1)
        real = min(self.seq_len - 1, self.blocks.stream_tokens - start)
        input_ids = torch.empty(self.seq_len, dtype=torch.int64)
        input_ids[0] = self.bos
        input_ids[1:] = torch.from_numpy(body)
        return {
            "input_ids": input_ids,
            "length": 1 + real,
            "index": index,
            "fixed_masking": self.fixed_masking,
        }
