"""Click logs as arrays (``dense`` ``(N, 13)`` float32, ``ids`` ``(N, 26)``, ``labels`` ``(N,)``), and whole
batches ``(dense (B, 13), ids (26, B) int64, labels (B,))`` gathered from them with one numpy fancy index
per array. Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from comera.checks import check_int

__all__ = ["ClickBatch", "ClickData", "collate_clicks"]


class ClickBatch(NamedTuple):
    """One batch: ``dense`` ``(B, F_dense)`` float32, ``ids`` ``(F_sparse, B)`` int64, ``labels`` ``(B,)``
    float32."""

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ClickBatch:
        """The batch on ``device``."""
        return ClickBatch(*(t.to(device, non_blocking=non_blocking) for t in self))


class ClickData(Dataset):
    """``N`` click-log samples held as arrays; indexing returns ``(self, row)`` for :func:`collate_clicks`,
    :meth:`rows` gives a view of a slice of rows.

    Args:
        dense: ``(N, F_dense)`` float32 features.
        ids: ``(N, F_sparse)`` non-negative integer ids (any integer dtype).
        labels: ``(N,)`` 0/1 labels (any numeric dtype).
    """

    def __init__(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> None:
        if dense.ndim != 2 or ids.ndim != 2 or labels.ndim != 1:
            raise ValueError(
                "dense, ids and labels must have shapes (N, F_dense), (N, F_sparse) and (N,), got "
                f"{dense.shape}, {ids.shape} and {labels.shape}"
            )
        if not dense.shape[0] == ids.shape[0] == labels.shape[0]:
            raise ValueError(
                f"dense, ids and labels must have the same number of rows, got {dense.shape[0]}, "
                f"{ids.shape[0]} and {labels.shape[0]}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"ids must be an integer array, got dtype {ids.dtype}")
        self.dense, self.ids, self.labels = dense, ids, labels

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> tuple[ClickData, int]:
        """A handle ``(self, index)`` on one row, for :func:`collate_clicks`."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index must be in [{-len(self)}, {len(self) - 1}], got {index}")
        return self, index % len(self)

    def rows(self, start: int, stop: int) -> ClickData:
        """Rows ``start:stop`` as a view (a memmap stays a memmap)."""
        return ClickData(self.dense[start:stop], self.ids[start:stop], self.labels[start:stop])

    def gather(self, rows: np.ndarray) -> ClickBatch:
        """The batch of ``rows`` (1-D integer array), in that order."""
        if rows.size and rows.min() >= 0 and rows.max() - rows.min() + 1 == rows.size and _ascending(rows):
            picked = slice(int(rows[0]), int(rows[-1]) + 1)
        else:
            picked = rows
        # np.array copies: the batch never shares memory with (possibly read-only, memmapped) storage
        return ClickBatch(
            torch.from_numpy(np.array(self.dense[picked], dtype=np.float32, order="C")),
            torch.from_numpy(np.array(self.ids[picked].T, dtype=np.int64, order="C")),
            torch.from_numpy(np.array(self.labels[picked], dtype=np.float32, order="C")),
        )

    def batches(
        self, batch_size: int, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> Iterator[ClickBatch]:
        """Batches of ``batch_size`` rows, in file order or shuffled by ``seed``."""
        check_int(batch_size, "batch_size", 1)
        count = len(self)
        order = np.random.default_rng(seed).permutation(count) if shuffle else np.arange(count)
        stop = count - count % batch_size if drop_last else count
        for start in range(0, stop, batch_size):
            yield self.gather(order[start : start + batch_size])


def _ascending(rows: np.ndarray) -> bool:
    return bool(np.all(rows[1:] > rows[:-1]))


def collate_clicks(items: Sequence[tuple[ClickData, int]]) -> ClickBatch:
    """One :class:`ClickBatch` from ``ClickData[i]`` handles, all of the same ``ClickData``."""
    if not items:
        raise ValueError("collate_clicks needs at least one item")
    data = items[0][0]
    if not isinstance(data, ClickData) or any(item[0] is not data for item in items):
        raise ValueError("collate_clicks items must all be (data, row) handles of one ClickData")
    return data.gather(np.fromiter((row for _, row in items), dtype=np.int64, count=len(items)))
