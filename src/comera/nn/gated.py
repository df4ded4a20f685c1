"""The base of every comera module stored as a train of cores with a rank gate ``g_k`` (length ``r_k``) on
each bond, the masked gate ``g_k * 1[|g_k| > tau]`` folded into the right-rank axis of core ``k``, and the
inference cache that reuses values built from cores and gates in eval mode without autograd. Details:
docs/method.md section 3, docs/internals.md, "The inference cache"."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn
from torch.nn import functional
from torch.optim.optimizer import register_optimizer_step_post_hook

from comera.nn.layer import ComeraLayer
from comera.tt.cores import num_train_parameters
from comera.tt.merge import fold_gates
from comera.tt.shapes import requested_ranks

__all__ = ["DEFAULT_RANK", "GatedTrain", "mask_gate", "DEFAULT_TAU", "invalidate_inference_caches"]

DEFAULT_RANK = 16
"""Max rank per bond of a new layer when none is given (layers and TensorizeConfig)."""
DEFAULT_TAU = 1e-2
_Cached = TypeVar("_Cached")


_cache_generation = [0]
"""Bumped by every optimizer step in the process and by :func:`invalidate_inference_caches`; part of every
inference-cache key."""


def invalidate_inference_caches() -> None:
    """Make every comera module rebuild its inference cache on its next eval-mode call (cheap: no cache is
    touched, their keys stop matching)."""
    _cache_generation[0] += 1


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    invalidate_inference_caches()


register_optimizer_step_post_hook(_count_optimizer_step)


def mask_gate(gate: torch.Tensor, tau: float) -> torch.Tensor:
    """``gate`` where ``|gate| > tau``, else 0, with gradient 1 on live entries and 0 on dead ones, by
    ``hardshrink``: one kernel each way where ``gate * (|gate| > tau)`` takes four, which counts on a GPU."""
    return functional.hardshrink(gate, tau)


def check_float_dtype(dtype: torch.dtype | None, name: str = "dtype") -> None:
    """Raise ``ValueError`` unless ``dtype`` is None or a floating-point dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{name} must be a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}")


def autocast_output(output: torch.Tensor) -> torch.Tensor:
    """``output`` in the autocast dtype when autocast is on for its device, as ``nn.Linear`` returns it;
    unchanged otherwise. Contraction orders end in different ops (some autocast-eligible, some not), so the
    layer output is cast once here and its dtype never depends on the order or the batch size."""
    device_type = output.device.type
    if output.is_floating_point() and torch.is_autocast_enabled(device_type):
        return output.to(torch.get_autocast_dtype(device_type))
    return output


def check_tau(tau: float) -> float:
    """Raise ``ValueError`` unless ``tau`` is a finite number >= 0."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
        raise ValueError(f"tau must be a finite float >= 0, got {tau!r}")
    return float(tau)


class GatedTrain(ComeraLayer, nn.Module):
    """Cores in ``self.cores`` (``nn.ParameterList``) and gates in ``self.gates``, one per bond; subclasses
    set ``bond_sizes`` (``n_k`` for TT, ``m_k * n_k`` for TTM) and ``dense_num_parameters()`` and follow the
    layer protocol (:mod:`comera.nn.layer`).

    Examples:
        >>> import torch
        >>> import comera
        >>> layer = comera.TTLinear(256, 256, rank=8)
        >>> isinstance(layer, comera.GatedTrain), len(layer.cores), len(layer.gates)  # one gate per bond
        (True, 4, 3)
        >>> layer.ranks  # live entries of each gate
        (8, 8, 8)
        >>> with torch.no_grad():
        ...     layer.gates[1][4:] = 0.0  # entries with |g| <= tau are dead
        >>> layer.ranks
        (8, 4, 8)
    """

    cores: nn.ParameterList
    gates: nn.ParameterList
    tau: float

    if TYPE_CHECKING:  # every subclass defines them

        def reset_parameters(self) -> None: ...

        def to_dense(self) -> torch.Tensor: ...

    def _build_train(
        self,
        core_shapes: Sequence[Sequence[int]],
        tau: float,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        self.tau = check_tau(tau)
        self.cores = nn.ParameterList(
            [nn.Parameter(torch.empty(tuple(shape), device=device, dtype=dtype)) for shape in core_shapes]
        )
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(shape[-1], device=device, dtype=dtype)) for shape in core_shapes[:-1]]
        )

    def _restore_stored_ranks(self, rank: int | Sequence[int]) -> None:
        """Give the train exactly the per-bond ``rank`` of a spec, with fresh values (``reset_parameters``),
        for a layer rebuilt from it. The constructor clips a bond to what its neighbours can use (``r_k <=
        c_{k+1} r_{k+1}``, :func:`comera.tt.shapes.resolve_ranks`); pruning trims each bond by its own gates
        and can leave one above that bound (a bond of 14 beside one of 3 on a mode of 4), and the saved cores
        have those shapes. An int ``rank`` (the same maximum on every bond) means the constructor's clipped
        ranks and changes nothing; a sequence is read by :func:`comera.tt.shapes.requested_ranks`."""
        if isinstance(rank, int):
            return
        ranks = requested_ranks(rank, len(self.gates))
        if ranks == self.max_ranks:
            return
        bounds = (1, *ranks, 1)
        with torch.no_grad():
            for k, core in enumerate(self.core_list()):
                shape = (bounds[k], *core.shape[1:-1], bounds[k + 1])
                self.cores[k] = nn.Parameter(core.new_empty(shape), requires_grad=core.requires_grad)
            for k, gate in enumerate(self.gate_list()):
                self.gates[k] = nn.Parameter(gate.new_empty(ranks[k]), requires_grad=gate.requires_grad)
            if not self.is_meta():
                self.reset_parameters()

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        """Per-core factor ``c_k`` of the parameter count."""
        raise NotImplementedError

    def dense_num_parameters(self) -> int:
        """Parameters of the dense tensor this train stands for (without padding)."""
        raise NotImplementedError

    def core_list(self) -> list[nn.Parameter]:
        """The cores in order (a plain list; iterating the ``ParameterList`` costs ~1.5 us per item)."""
        return list(self.cores._parameters.values())  # type: ignore[arg-type]  # a ParameterList holds no None

    def gate_list(self) -> list[nn.Parameter]:
        """The gate vectors in order, one per bond (a plain list)."""
        return list(self.gates._parameters.values())  # type: ignore[arg-type]  # a ParameterList holds no None

    def masked_gates(self) -> list[torch.Tensor]:
        """The gate vectors with dead entries zeroed, one per bond (differentiable, no host sync)."""
        return [mask_gate(gate, self.tau) for gate in self.gate_list()]

    def gated_cores(self) -> list[torch.Tensor]:
        """Cores with each bond's masked gate folded into the right-rank axis of the core on its left."""
        return fold_gates(self.core_list(), self.masked_gates())

    def serves_from_cache(self) -> bool:
        """Whether this call may use the inference cache: eval mode, autograd off, not being compiled."""
        return not self.training and not torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _parameter_key(self, tensors: tuple[torch.Tensor, ...]) -> tuple:
        return (
            _cache_generation[0],
            self.tau,
            tuple(tensor._version for tensor in tensors),
            tuple(tensor.data_ptr() for tensor in tensors),
            tuple(tensor.shape for tensor in tensors),
            tuple(tensor.dtype for tensor in tensors),
        )

    def inference_cached(self, name: Hashable, build: Callable[[], _Cached]) -> _Cached:
        """``build()``, reused while the cores, gates and ``tau`` are unchanged (docs/internals.md, "The
        inference cache"); it holds aliases of the storages it was built from."""
        tensors = (*self.core_list(), *self.gate_list())
        key = self._parameter_key(tensors)
        cache = self.__dict__.get("_inference_cache")
        if cache is None or cache["key"] != key:
            storages = tuple(tensor.detach() for tensor in tensors)
            cache = {"key": key, "storages": storages, "values": {}}
            self.__dict__["_inference_cache"] = cache
        values = cache["values"]
        if name not in values:
            values[name] = build()
        return values[name]

    def clear_cache(self) -> None:
        """Drop the inference cache (rebuilt on the next eval-mode, no-grad call)."""
        self.__dict__.pop("_inference_cache", None)

    def weight_parameters(self) -> list[nn.Parameter]:
        """The cores and gates (what :meth:`num_parameters` counts at the active ranks)."""
        return [*self.core_list(), *self.gate_list()]

    @torch.no_grad()
    def match_scale_(self, weight: torch.Tensor) -> None:
        """Scale the cores so the entries of :meth:`to_dense` have the standard deviation of ``weight`` (a
        host model's initialisation, e.g. std 0.02 embeddings); a zero or meta-device ``weight``, or a train
        on the meta device, leaves the cores as they are (:meth:`scale_to_std_` serves there)."""
        if weight.is_meta or self.is_meta():
            return
        target = weight.detach().double().std()
        current = self.to_dense().detach().double().std()
        if target > 0 and current > 0:
            factor = float(target / current) ** (1.0 / len(self.cores))
            for core in self.cores:
                core.mul_(factor)

    @torch.no_grad()
    def reconstruction_rms(self) -> float:
        """Root mean square of the entries of the (padded) gated train, from the cores alone: the squared
        Frobenius norm is the final ``1 x 1`` of ``M <- sum_p G[a, p, c] G[b, p, d] M[a, b]`` from
        ``M = [[1]]`` (mode axes flattened into ``p``); raises ``ValueError`` on the meta device."""
        if self.is_meta():
            raise ValueError("the cores are on the meta device: there are no values to measure")
        gram = torch.ones(1, 1, dtype=torch.float64, device=self.core_list()[0].device)
        entries = 1
        for core in self.gated_cores():
            flat = core.detach().double().reshape(core.shape[0], -1, core.shape[-1])
            left_rank, modes, right_rank = flat.shape
            entries *= modes
            # T[b, p, c] = sum_a M[a, b] G[a, p, c]; then M'[c, d] = sum_{b, p} T[b, p, c] G[b, p, d]
            half = gram.t() @ flat.reshape(left_rank, modes * right_rank)
            rows = left_rank * modes
            gram = half.reshape(rows, right_rank).t() @ flat.reshape(rows, right_rank)
        return math.sqrt(max(float(gram.item()), 0.0) / entries)

    @torch.no_grad()
    def scale_to_std_(self, std: float) -> None:
        """Scale the cores (each by the same factor) so that :meth:`reconstruction_rms` equals ``std``, the
        standard deviation of a zero-mean initialisation of the dense tensor. Used for fresh random cores
        where there is no dense weight to measure (a model built on the meta device); a train representing
        zero is left as it is. ``ValueError`` for a ``std`` that is not a finite number > 0."""
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not math.isfinite(std) or std <= 0:
            raise ValueError(f"std must be a finite float > 0, got {std!r}")
        current = self.reconstruction_rms()
        if current > 0:
            factor = (std / current) ** (1.0 / len(self.cores))
            for core in self.core_list():
                core.mul_(factor)

    def is_meta(self) -> bool:
        """Whether the cores live on the meta device (shapes only, no values)."""
        return self.core_list()[0].is_meta

    def shapes_only(self, input: torch.Tensor) -> bool:
        """Whether a call with ``input`` only propagates shapes: True for a meta ``input`` (the caller then
        returns an empty meta tensor of the output's shape); ``ValueError`` for a real ``input`` while the
        cores are on the meta device."""
        if input.is_meta:
            return True
        if self.is_meta():
            raise ValueError(
                f"the layer's cores are on the meta device (shapes only) but input is on {input.device}; "
                "call it with meta tensors, or materialise it first (to_empty(device=...) then "
                "reset_parameters())"
            )
        return False

    @property
    def max_ranks(self) -> tuple[int, ...]:
        """The stored (physical) rank of every bond."""
        return tuple(core.shape[-1] for core in self.core_list()[:-1])

    @property
    def ranks(self) -> tuple[int, ...]:
        """The active rank of every bond: its number of live gate entries (syncs with the device; the stored
        ranks on the meta device, where gates have no values)."""
        if self.is_meta():
            return self.max_ranks
        return tuple(int((gate.detach().abs() > self.tau).sum()) for gate in self.gates)

    def num_parameters(self) -> int:
        """Core entries of the active-rank train, ``sum_k c_k r_{k-1} r_k`` (0 if a bond is dead); gates and
        biases are not counted (gates fold into the cores on export)."""
        return num_train_parameters(self.bond_sizes, self.ranks)

    @property
    def compression(self) -> float:
        """Dense parameters over active core parameters (``inf`` when a bond is dead)."""
        active = self.num_parameters()
        return math.inf if active == 0 else self.dense_num_parameters() / active
