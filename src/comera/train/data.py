"""Batches of one epoch in a reproducible order, starting at any position (for exact resume): a map-style
dataset is batched and shuffled here from ``(seed, epoch)`` and sharded by rank, any other re-iterable of
batches is iterated with the global RNG seeded from ``(seed, epoch)`` while its iterator starts. Details:
docs/training.md, 'The loop'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

__all__ = ["EpochData", "epoch_seed"]

_PRIME = 1_000_003


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s data order."""
    return (seed * _PRIME + epoch) % (2**63 - 1)


def _is_map_dataset(data: object) -> bool:
    return (
        hasattr(data, "__len__")
        and hasattr(data, "__getitem__")
        and not isinstance(data, (IterableDataset, list, tuple))
        and not isinstance(data, torch.utils.data.DataLoader)
    )


class EpochData:
    """Yields the batches of an epoch from position ``start``.

    Args:
        data: a map-style dataset or a re-iterable of batches.
        batch_size, shuffle, drop_last: batching of a map-style dataset (ignored for iterables).
        seed: base seed of the data order.
        collate_fn: turns a list of samples into a batch (default ``torch.utils.data.default_collate``).
        rank, world_size: this process's shard of a map-style dataset.
        equal_shards: cut the order to a multiple of ``world_size`` (training) or keep every sample (eval).
    """

    def __init__(
        self,
        data: Any,
        *,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        seed: int,
        collate_fn: Callable[[list], Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        equal_shards: bool = True,
    ) -> None:
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.collate_fn = collate_fn or default_collate
        self.rank = rank
        self.world_size = world_size
        self.equal_shards = equal_shards
        self.is_dataset = _is_map_dataset(data)
        if not self.is_dataset and not isinstance(data, Iterable):
            raise TypeError(
                f"data must be a map-style dataset or an iterable of batches, got {type(data).__name__}"
            )

    def __len__(self) -> int:
        """Batches per epoch; ``TypeError`` for an iterable without ``len``."""
        if self.is_dataset:
            count = self.shard_size()
            return count // self.batch_size if self.drop_last else -(-count // self.batch_size)
        return len(self.data)

    def shard_size(self) -> int:
        """Samples of this process's shard of a map-style dataset."""
        count = len(self.data)
        if self.equal_shards:
            return count // self.world_size
        return len(range(self.rank, count, self.world_size))

    def has_length(self) -> bool:
        """Whether :meth:`__len__` is known."""
        try:
            len(self)
        except TypeError:
            return False
        return True

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The batches of ``epoch``, skipping the first ``start``."""
        if self.is_dataset:
            return self._dataset_epoch(epoch, start)
        return self._iterable_epoch(epoch, start)

    def _dataset_epoch(self, epoch: int, start: int) -> Iterator[Any]:
        count = len(self.data)
        # the order stays a tensor of int32 (4 bytes a sample, not a Python list's ~36; int64 from 2**31
        # samples): a corpus of millions of blocks is ordered without growing the heap by a list of that size,
        # and randperm draws the same permutation in either dtype
        dtype = torch.int32 if count < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(count, generator=generator, dtype=dtype)
        else:
            order = torch.arange(count, dtype=dtype)
        if self.equal_shards:
            order = order[: count - count % self.world_size]
        order = order[self.rank :: self.world_size]
        for batch in range(start, len(self)):
            indices = order[batch * self.batch_size : (batch + 1) * self.batch_size].tolist()
            yield self.collate_fn([self.data[index] for index in indices])

    def _iterable_epoch(self, epoch: int, start: int) -> Iterator[Any]:
        with torch.random.fork_rng(devices=[]):
            # The CPU generator only: ``torch.manual_seed`` would also reseed every CUDA generator, which
            # ``fork_rng(devices=[])`` does not restore (a resumed run's dropout would then differ).
            torch.default_generator.manual_seed(epoch_seed(self.seed, epoch))
            iterator = iter(self.data)
            first = list(islice(iterator, 1))
        if start == 0:
            yield from first
        else:
            next(islice(iterator, start - 1, start - 1), None)
        yield from iterator
