"""Batches of one shape for a captured step: length buckets, padding of the named entries along
``length_dim``, and copying into static buffers; a batch is a dict, list or tuple of tensors and non-tensor
values, or one tensor. Details: docs/training.md, 'Whole-step CUDA Graph'.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "check_buckets",
    "choose_bucket",
    "batch_length",
    "pad_to",
    "pad_batch",
    "fill_static",
    "entries",
    "rebuild",
]


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` as a tuple after checking it is a non-empty, strictly increasing sequence of ints >= 1."""
    values = tuple(buckets) if isinstance(buckets, (list, tuple)) else None
    ok = bool(values) and all(not isinstance(v, bool) and isinstance(v, int) and v >= 1 for v in values)
    if not ok or any(a >= b for a, b in zip(values, values[1:])):
        raise ValueError(f"buckets must be a strictly increasing list of ints >= 1, got {buckets!r}")
    return values


def choose_bucket(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ``>= length`` (``buckets`` as accepted by :func:`check_buckets`)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    raise ValueError(
        f"batch length {length} exceeds the largest bucket {buckets[-1]} (buckets={list(buckets)})"
    )


def pad_to(tensor: torch.Tensor, dim: int, size: int, value: float) -> torch.Tensor:
    """``tensor`` extended along ``dim`` to ``size`` entries of ``value`` (unchanged if already ``size``)."""
    current = tensor.shape[dim]
    if current > size:
        raise ValueError(f"cannot pad dim {dim} of size {current} down to {size}")
    if current == size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size - current
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


def entries(batch: Any) -> list[tuple[Hashable, Any]]:
    """``(key, value)`` pairs of a dict batch, ``(index, value)`` pairs of a list or tuple batch, ``[(0,
    batch)]`` for a batch that is one tensor."""
    if isinstance(batch, torch.Tensor):
        return [(0, batch)]
    if isinstance(batch, Mapping):
        return list(batch.items())
    if isinstance(batch, (list, tuple)):
        return list(enumerate(batch))
    raise TypeError(
        f"batch must be a tensor, or a dict, list or tuple of tensors, got {type(batch).__name__}"
    )


def rebuild(batch: Any, values: list[Any]) -> Any:
    """A batch of ``batch``'s structure (dict, list, tuple, named tuple or one tensor) holding ``values`` in
    its order; a named tuple stays of its type, so a loss that reads ``batch.field`` runs on it."""
    if isinstance(batch, torch.Tensor):
        return values[0]
    if isinstance(batch, Mapping):
        return dict(zip(batch.keys(), values))
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):
        return type(batch)(*values)
    return type(batch)(values) if isinstance(batch, list) else tuple(values)


def _padded_tensor(batch: Any, key: Hashable, length_dim: int) -> torch.Tensor:
    by_key = dict(entries(batch))
    if key not in by_key:
        raise ValueError(f"pad names {key!r}, which the batch lacks (batch keys: {list(by_key)})")
    tensor = by_key[key]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() <= length_dim:
        raise ValueError(
            f"batch[{key!r}] must be a tensor with more than {length_dim} dims to pad along length_dim="
            f"{length_dim}, got {tensor!r}"
        )
    return tensor


def batch_length(batch: Any, pad: Mapping[Hashable, float], length_dim: int = 1) -> int:
    """The common size along ``length_dim`` of the batch entries named in ``pad``."""
    lengths = {key: _padded_tensor(batch, key, length_dim).shape[length_dim] for key in pad}
    if not lengths or len(set(lengths.values())) != 1:
        raise ValueError(
            f"the entries named in pad must share one length along dim {length_dim}, got {lengths}"
        )
    return next(iter(lengths.values()))


def pad_batch(batch: Any, pad: Mapping[Hashable, float], size: int, length_dim: int = 1) -> Any:
    """A copy of ``batch`` (dict, list or tuple) with every entry named in ``pad`` padded along
    ``length_dim`` to ``size`` with its value; other entries are passed through."""
    for key in pad:
        _padded_tensor(batch, key, length_dim)
    values = [
        pad_to(value, length_dim, size, pad[key]) if key in pad else value for key, value in entries(batch)
    ]
    return rebuild(batch, values)


def fill_static(
    static: Any, batch: Any, pad: Mapping[Hashable, float] | None = None, length_dim: int = 1
) -> None:
    """Copy ``batch`` into the same-structured buffers ``static`` in place (asynchronously across devices),
    filling the rest of a ``pad`` entry's buffer with its pad value.

    Raises:
        ValueError: an unpadded tensor without its buffer's exact shape, or a non-tensor entry unequal to the
            buffer's (naming the entry).
    """
    static_keys = [key for key, _ in entries(static)]
    batch_keys = [key for key, _ in entries(batch)]
    if static_keys != batch_keys:
        raise ValueError(f"batch has entries {batch_keys}, the captured graph expects {static_keys}")
    for (key, target), (_, value) in zip(entries(static), entries(batch)):
        if not isinstance(target, torch.Tensor):
            if value != target:
                raise ValueError(f"batch[{key!r}] = {value!r} differs from {target!r} seen at capture")
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"batch[{key!r}] must be a tensor like at capture, got {type(value).__name__}")
        expected = list(target.shape)
        padded = pad is not None and key in pad
        if padded and value.dim() > length_dim:
            expected[length_dim] = value.shape[length_dim]
        if list(value.shape) != expected or (padded and value.shape[length_dim] > target.shape[length_dim]):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}, the captured graph expects "
                f"{tuple(target.shape)}{' up to the padded length' if padded else ''}; batch with "
                "drop_last=True, or pad this entry"
            )
        if padded:
            length = value.shape[length_dim]
            target.narrow(length_dim, 0, length).copy_(value, non_blocking=True)
            target.narrow(length_dim, length, target.shape[length_dim] - length).fill_(pad[key])
        else:
            target.copy_(value, non_blocking=True)
