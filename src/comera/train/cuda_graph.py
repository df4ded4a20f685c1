"""Whole-step CUDA Graph: forward, CoMERA objective, backward and AdamW step replayed as one graph
(docs/method.md section 7).

:class:`CudaGraphStep` captures one training step into a ``torch.cuda.CUDAGraph`` and replays it for every
later batch, so the many small kernels of a tensorized model cost one launch. What a graph needs, and how this
module provides it:

- **Static inputs.** The graph reads its batch from fixed device buffers. Each batch is copied into them
  (host-to-device copies are issued asynchronously). Batches whose sequence length varies are padded along
  ``length_dim`` to the smallest of a few ``buckets`` (one graph per bucket); the entries named in ``pad``
  are padded with their value (e.g. ``{"input_ids": 0, "attention_mask": 0, "labels": -100}``), every
  other entry must keep the shape it had at capture (use ``drop_last=True`` batching). The loss must ignore
  the padded positions (attention mask, ``ignore_index``); this module only pads.
- **No host syncs inside.** The captured step is ``loss_fn``, :meth:`comera.RankAdaptation.loss`, backward,
  the gradient norm, optional clipping and ``optimizer.step()``, all device-side. The non-finite guard runs
  on the device too: the step's update is applied only when ``objective + grad_norm`` is finite; otherwise
  parameters, optimizer state and the loss average are put back from copies taken at the start of the step
  (``torch.where``), so a bad batch leaves no trace, as in the eager trainer. The host reads the step's four
  numbers (task loss, objective, gradient norm, applied flag) after the replay, which is one sync per step.
- **Capturable AdamW.** The optimizer must be ``torch.optim.AdamW`` or ``Adam`` with ``capturable=True`` in
  every group (step counters live on the device). Learning rates given as Python floats are baked into
  the graph: changing one needs :meth:`CudaGraphStep.invalidate`.
- **Warm-up whose effects are undone.** Before each capture, ``warmup`` steps run on a side stream (this
  creates the optimizer state and lets kernels pick their algorithms). Model tensors, optimizer state, the
  loss average and the RNG states are snapshotted in memory first and written back in place afterwards;
  optimizer state that the warm-up created is zeroed, which is exactly AdamW's fresh state. Writing in place
  keeps every tensor's address, which the graph relies on.
- **Recapture.** A graph holds raw addresses and baked constants. Call :meth:`CudaGraphStep.invalidate`
  after :func:`comera.prune_` (it reallocates parameters and optimizer state), after
  :meth:`comera.RankAdaptation.begin_late_stage` (the objective changes), after loading a checkpoint into the
  optimizer, and after changing learning rates; the next :meth:`CudaGraphStep.step` recaptures.

Each bucket's graph has its own memory pool, so memory grows with the number of buckets. Gradients live in
the graph's pool: between steps ``param.grad`` holds the last replay's gradients; do not set them to None
while the graph is in use. Autocast (``autocast_dtype``) runs with its weight cache disabled, as graph
capture requires. Single process only (no DDP).

This module has not been run on a GPU yet: its CUDA tests are skipped on machines without CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from comera.rank.adaptation import RankAdaptation
from comera.train.guard import total_grad_norm

__all__ = [
    "capturable_adam",
    "STEP_VALUES",
    "CudaGraphStep",
    "check_buckets",
    "choose_bucket",
    "batch_length",
    "pad_to",
    "pad_batch",
    "fill_static",
]

STEP_VALUES = ("task", "objective", "grad_norm", "applied")
"""Order of the numbers in the tensor :meth:`CudaGraphStep.step` returns (``applied`` is 1.0 or 0.0)."""
_ADAM_TYPES = (torch.optim.AdamW, torch.optim.Adam)


def capturable_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is ``AdamW``/``Adam`` with ``capturable=True`` in every group (graph capture)."""
    return isinstance(optimizer, _ADAM_TYPES) and all(
        group.get("capturable", False) for group in optimizer.param_groups
    )


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


def _entries(batch: Any) -> list[tuple[Hashable, Any]]:
    if isinstance(batch, Mapping):
        return list(batch.items())
    if isinstance(batch, (list, tuple)):
        return list(enumerate(batch))
    raise TypeError(f"batch must be a dict, list or tuple of tensors, got {type(batch).__name__}")


def _rebuild(batch: Any, values: list[Any]) -> Any:
    if isinstance(batch, Mapping):
        return dict(zip(batch.keys(), values))
    return type(batch)(values) if isinstance(batch, list) else tuple(values)


def _padded_tensor(batch: Any, key: Hashable, length_dim: int) -> torch.Tensor:
    entries = dict(_entries(batch))
    if key not in entries:
        raise ValueError(f"pad names {key!r}, which the batch lacks (batch keys: {list(entries)})")
    tensor = entries[key]
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
        pad_to(value, length_dim, size, pad[key]) if key in pad else value for key, value in _entries(batch)
    ]
    return _rebuild(batch, values)


def fill_static(
    static: Any, batch: Any, pad: Mapping[Hashable, float] | None = None, length_dim: int = 1
) -> None:
    """Copy ``batch`` into the same-structured buffers ``static`` in place (asynchronously across devices).

    Entries named in ``pad`` may be shorter than their buffer along ``length_dim``: the rest of the buffer is
    filled with the pad value. Every other tensor must have its buffer's exact shape, and non-tensor entries
    must equal the buffer's. Raises ``ValueError`` naming the entry otherwise.
    """
    static_keys = [key for key, _ in _entries(static)]
    batch_keys = [key for key, _ in _entries(batch)]
    if static_keys != batch_keys:
        raise ValueError(f"batch has entries {batch_keys}, the captured graph expects {static_keys}")
    for (key, target), (_, value) in zip(_entries(static), _entries(batch)):
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


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: Any
    values: torch.Tensor


class CudaGraphStep:
    """One CoMERA training step as a replayed CUDA graph, one graph per length bucket.

    Args:
        model: the model on one CUDA device (unwrapped, no DDP).
        loss_fn: ``loss_fn(model, batch) -> 0-dim task loss``; it receives the static device buffers (a
            ``.to(device)`` inside is a no-op) and must not sync with the host.
        optimizer: ``torch.optim.AdamW`` or ``Adam`` built with ``capturable=True``.
        rank: the :class:`comera.RankAdaptation` of ``model`` (its objective is captured with the stage
            it has at capture time).
        buckets: sequence lengths to pad to (strictly increasing), or None for fixed-shape batches.
        pad: with ``buckets``, the batch entries (dict keys or tuple indices) to pad and their pad values.
        length_dim: the dimension padded (default 1: ``(batch, length, ...)``).
        grad_clip: clip the total gradient norm to this (> 0), or None.
        warmup: warm-up steps before each capture (>= 1); their effects are undone.
        autocast_dtype: run forward and objective under ``torch.autocast("cuda", dtype=...)``, or None.

    The batch given to :meth:`step` is a dict, list or tuple of tensors (on any device) and non-tensor
    values; non-tensor values and the shapes of the unpadded entries must equal those seen at capture.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        rank: RankAdaptation,
        *,
        buckets: Sequence[int] | None = None,
        pad: Mapping[Hashable, float] | None = None,
        length_dim: int = 1,
        grad_clip: float | None = None,
        warmup: int = 3,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}"
            )
        if not isinstance(optimizer, _ADAM_TYPES):
            raise TypeError(
                "optimizer must be torch.optim.AdamW or torch.optim.Adam (their fresh state is zeros, which "
                f"the warm-up undo relies on), got {type(optimizer).__name__}"
            )
        if not capturable_adam(optimizer):
            raise ValueError("optimizer must be built with capturable=True in every param group")
        if not isinstance(rank, RankAdaptation):
            raise TypeError(f"rank must be a comera.RankAdaptation, got {type(rank).__name__}")
        if (buckets is None) != (pad is None):
            raise ValueError(
                "buckets and pad go together: give both (padded lengths) or neither (fixed shapes)"
            )
        self.buckets = None if buckets is None else check_buckets(buckets)
        if pad is not None and (not isinstance(pad, Mapping) or not pad):
            raise ValueError(f"pad must be a non-empty mapping of batch key -> pad value, got {pad!r}")
        self.pad = None if pad is None else dict(pad)
        if isinstance(length_dim, bool) or not isinstance(length_dim, int) or length_dim < 0:
            raise ValueError(f"length_dim must be an int >= 0, got {length_dim!r}")
        if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
            raise ValueError(f"grad_clip must be a number > 0 or None, got {grad_clip!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
        if autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype}"
            )
        devices = {param.device for param in model.parameters()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(
                f"model parameters must all be on one CUDA device, got {sorted(map(str, devices))}"
            )
        self.device = next(iter(devices))
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.rank = rank
        self.length_dim = length_dim
        self.grad_clip = None if grad_clip is None else float(grad_clip)
        self.warmup = warmup
        self.autocast_dtype = autocast_dtype
        self._graphs: dict[int | None, _Captured] = {}

    @property
    def captured_buckets(self) -> tuple[int | None, ...]:
        """Buckets with a captured graph (``(None,)`` for fixed shapes once captured)."""
        return tuple(self._graphs)

    def invalidate(self) -> None:
        """Drop every graph (and the gradients in their pools); the next :meth:`step` recaptures."""
        for captured in self._graphs.values():
            captured.graph.reset()
        self._graphs.clear()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, batch: Any) -> torch.Tensor:
        """Run one training step on ``batch``; capture its bucket's graph first if needed.

        Returns:
            A ``(4,)`` fp32 device tensor in the order of :data:`STEP_VALUES`; nothing has synced yet.
        """
        bucket = None
        if self.buckets is not None:
            bucket = choose_bucket(batch_length(batch, self.pad, self.length_dim), self.buckets)
        captured = self._graphs.get(bucket)
        if captured is None:
            captured = self._capture(bucket, batch)
            self._graphs[bucket] = captured
        else:
            fill_static(captured.static, batch, self.pad, self.length_dim)
        captured.graph.replay()
        return captured.values.clone()

    # static buffers
    def _padded(self, batch: Any, bucket: int | None) -> Any:
        return batch if bucket is None else pad_batch(batch, self.pad, bucket, self.length_dim)

    def _new_static(self, batch: Any, bucket: int | None) -> Any:
        values = [
            value.to(self.device, copy=True) if isinstance(value, torch.Tensor) else value
            for _, value in _entries(self._padded(batch, bucket))
        ]
        return _rebuild(batch, values)

    # the step
    def _guarded(self) -> list[torch.Tensor]:
        tensors = [param for group in self.optimizer.param_groups for param in group["params"]]
        for state in self.optimizer.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
        return [*tensors, self.rank._ema_sum, self.rank._ema_weight]

    def _body(self, static: Any) -> torch.Tensor:
        guarded = self._guarded()
        with torch.no_grad():
            backup = [tensor.clone() for tensor in guarded]
        enabled = self.autocast_dtype is not None
        with torch.autocast("cuda", dtype=self.autocast_dtype, enabled=enabled, cache_enabled=False):
            task = self.loss_fn(self.model, static)
            objective = self.rank.loss(task)
        objective.backward()
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        with torch.no_grad():
            norm = total_grad_norm(params).float()
            finite = torch.isfinite(objective.detach().float() + norm)
            if self.grad_clip is not None:
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm)
        self.optimizer.step()
        with torch.no_grad():
            for tensor, old in zip(guarded, backup):
                tensor.copy_(torch.where(finite, tensor, old))
            return torch.stack([task.detach().float(), objective.detach().float(), norm, finite.float()])

    # capture
    def _snapshot(self) -> tuple[dict, dict, list, tuple]:
        model = {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}
        optimizer = {
            (id(param), key): value.detach().clone()
            for param, state in self.optimizer.state.items()
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        }
        rank = [self.rank._ema_sum.clone(), self.rank._ema_weight.clone(), self.rank.switch.clone()]
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device))
        return model, optimizer, rank, rng

    @torch.no_grad()
    def _restore(self, snapshot: tuple[dict, dict, list, tuple]) -> None:
        model, optimizer, rank, rng = snapshot
        for name, tensor in self.model.state_dict().items():
            tensor.copy_(model[name])
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    saved = optimizer.get((id(param), key))
                    if saved is None:
                        value.zero_()
                    else:
                        value.copy_(saved)
        for tensor, saved in zip((self.rank._ema_sum, self.rank._ema_weight, self.rank.switch), rank):
            tensor.copy_(saved)
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1], self.device)

    def _capture(self, bucket: int | None, batch: Any) -> _Captured:
        static = self._new_static(batch, bucket)
        snapshot = self._snapshot()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.optimizer.zero_grad(set_to_none=True)
                self._body(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._restore(snapshot)
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            values = self._body(static)
        return _Captured(graph=graph, static=static, values=values)
