"""Fixed-length blocks of a token stream held in memory-mapped shards (:mod:`comera.data.token_shards`): a
map-style dataset whose size on the heap does not grow with the corpus. Details: docs/llm.md, 'Bringing a
corpus' ('Training').
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from comera.checks import check_int

__all__ = ["TokenBlocks", "spread_blocks"]


def spread_blocks(count: int, keep: int | None) -> np.ndarray | None:
    """Block numbers ``(i * count) // keep`` for ``i < keep``: ``keep`` blocks spread evenly over ``count``
    (None when ``keep`` is None or keeps them all), as :func:`comera.workloads.llm.data.pack_stream` keeps
    its validation blocks."""
    if keep is None or keep >= count:
        return None
    return np.arange(keep, dtype=np.int64) * count // keep


class TokenBlocks(Dataset):
    """Blocks of ``seq_len`` tokens of memory-mapped shards: block ``b`` is the stream's tokens ``[b *
    seq_len, (b + 1) * seq_len)``, one ``(seq_len,)`` int64 tensor per item (collated to ``(B, seq_len)``).

    Args:
        shards: the stream's pieces in order: ``(n_i,)`` integer arrays, ``numpy.memmap`` for a corpus on
            disk; kept as given, never copied.
        seq_len: tokens per block (>= 2).
        pad_id: None drops the stream's short tail; an id pads it into one last block.
        selection: the block numbers to serve, in order (None: every block).

    Attributes:
        stream_tokens: tokens of the stream.
        blocks: blocks of the stream (before ``selection``).
        dropped_tokens: the dropped tail's tokens (0 when padded).
    """

    def __init__(
        self,
        shards: Sequence[np.ndarray],
        seq_len: int,
        *,
        pad_id: int | None = None,
        selection: np.ndarray | None = None,
    ) -> None:
        self.seq_len = check_int(seq_len, "seq_len", 2)
        self.shards = list(shards)
        self.pad_id = pad_id
        sizes = np.array([len(shard) for shard in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.stream_tokens = int(self.offsets[-1])
        full, rest = divmod(self.stream_tokens, seq_len)
        self.blocks = full + (1 if rest and pad_id is not None else 0)
        self.dropped_tokens = rest if pad_id is None else 0
        chosen = np.zeros(0, dtype=np.int64) if selection is None else np.asarray(selection)
        if chosen.size and (chosen.min() < 0 or chosen.max() >= self.blocks):
            raise ValueError(f"selection must hold block numbers in [0, {self.blocks}), got {selection!r}")
        self.selection = selection

    def __len__(self) -> int:
        return self.blocks if self.selection is None else len(self.selection)

    def block(self, number: int) -> np.ndarray:
        """Block ``number`` of the stream as a ``(seq_len,)`` int64 array (padded past the stream's end)."""
        start = number * self.seq_len
        end = min(start + self.seq_len, self.stream_tokens)
        out = np.full(self.seq_len, -1 if self.pad_id is None else self.pad_id, dtype=np.int64)
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        filled = 0
        while start + filled < end:
            first = start + filled - int(self.offsets[shard])
            take = min(end - start - filled, len(self.shards[shard]) - first)
            out[filled : filled + take] = self.shards[shard][first : first + take]
            filled += take
            shard += 1
        return out

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block index {index} out of range for {len(self)} blocks")
        index %= len(self)
        number = index if self.selection is None else int(self.selection[index])
        return torch.from_numpy(self.block(number))
