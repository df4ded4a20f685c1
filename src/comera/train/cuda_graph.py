"""Whole-step CUDA Graph: forward, objective, backward, on-device non-finite guard and capturable AdamW step
captured once per length bucket and replayed for every later batch, one host sync a step. Details:
docs/training.md, 'Whole-step CUDA Graph'.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from comera.checks import check_int, check_number
from comera.train.guard import total_grad_norm
from comera.train.objective import Objective
from comera.train.padding import (
    batch_length,
    check_buckets,
    choose_bucket,
    entries,
    fill_static,
    pad_batch,
    rebuild,
)
from comera.train.schedule import rates_as_tensors

__all__ = ["capturable_adam", "STEP_VALUES", "CudaGraphStep"]

STEP_VALUES = ("task", "objective", "grad_norm", "applied")
"""Order of the numbers in the tensor :meth:`CudaGraphStep.step` returns (``applied`` is 1.0 or 0.0)."""
_ADAM_TYPES = (torch.optim.AdamW, torch.optim.Adam)


def capturable_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is ``AdamW``/``Adam`` with ``capturable=True`` in every group (graph capture)."""
    return isinstance(optimizer, _ADAM_TYPES) and all(
        group.get("capturable", False) for group in optimizer.param_groups
    )


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: Any
    values: torch.Tensor


class CudaGraphStep:
    """One CoMERA training step as a replayed CUDA graph, one graph per length bucket; :meth:`step` takes one
    tensor or a dict, list or tuple of tensors and non-tensor values, whose unpadded entries keep the
    shapes and values seen at capture.

    Args:
        model: the model on one CUDA device (unwrapped, no DDP).
        loss_fn: ``loss_fn(model, batch) -> 0-dim task loss``; it receives the static device buffers and must
            not sync with the host.
        optimizer: ``torch.optim.AdamW`` or ``Adam`` built with ``capturable=True``.
        objective: the run's :class:`comera.train.objective.Objective` (captured at its current stage; its
            ``device_state`` is undone like the parameters).
        buckets: sequence lengths to pad to (strictly increasing), or None for fixed-shape batches.
        pad: with ``buckets``, the batch entries (dict keys or tuple indices) to pad and their pad values.
        length_dim: the dimension padded (default 1: ``(batch, length, ...)``).
        grad_clip: clip the total gradient norm to this (> 0), or None.
        warmup: warm-up steps before each capture (>= 1); their effects are undone.
        autocast_dtype: run forward and objective under ``torch.autocast("cuda", dtype=...)``, or None.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        optimizer: torch.optim.Optimizer,
        objective: Objective,
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
        if not isinstance(objective, Objective):
            raise TypeError(
                f"objective must be a comera.train.objective.Objective, got {type(objective).__name__}"
            )
        if (buckets is None) != (pad is None):
            raise ValueError(
                "buckets and pad go together: give both (padded lengths) or neither (fixed shapes)"
            )
        self.buckets = None if buckets is None else check_buckets(buckets)
        if pad is not None and (not isinstance(pad, Mapping) or not pad):
            raise ValueError(f"pad must be a non-empty mapping of batch key -> pad value, got {pad!r}")
        self.pad = None if pad is None else dict(pad)
        check_int(length_dim, "length_dim", 0)
        if grad_clip is not None:
            check_number(grad_clip, "grad_clip", 0.0, open_low=True)
        check_int(warmup, "warmup", 1)
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
        self.objective = objective
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
            for _, value in entries(self._padded(batch, bucket))
        ]
        return rebuild(batch, values)

    # the step
    def _guarded(self) -> list[torch.Tensor]:
        tensors = [param for group in self.optimizer.param_groups for param in group["params"]]
        for state in self.optimizer.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
        return [*tensors, *self.objective.device_state()]

    def _body(self, static: Any) -> torch.Tensor:
        guarded = self._guarded()
        with torch.no_grad():
            backup = [tensor.clone() for tensor in guarded]
        enabled = self.autocast_dtype is not None
        with torch.autocast("cuda", dtype=self.autocast_dtype, enabled=enabled, cache_enabled=False):
            task = self.loss_fn(self.model, static)
            objective = self.objective.loss(task)
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
        objective = self.objective.snapshot()
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device))
        return model, optimizer, objective, rng

    @torch.no_grad()
    def _restore(self, snapshot: tuple[dict, dict, list, tuple]) -> None:
        model, optimizer, objective, rng = snapshot
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
        self.objective.restore(objective)
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1], self.device)

    def _capture(self, bucket: int | None, batch: Any) -> _Captured:
        rates_as_tensors(self.optimizer, self.device)  # the graph reads each rate from its tensor
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
