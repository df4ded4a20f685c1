"""``TTLinear`` and ``TTMLinear``: drop-ins for ``nn.Linear`` (input ``(*, in_features)``, output
``(*, out_features)``) whose weight is a TT over ``in_shape + out_shape`` or a TTM over ``(m_k, n_k)`` pairs,
never stored dense, shapes padded where a size folds badly, the contraction order chosen per call. Details:
docs/method.md sections 2.3 and 5."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from comera.checks import check_int
from comera.nn.conv1d import (
    check_dense_kind,
    conv1d_mismatch,
    dense_kind_of,
    is_conv1d,
    linear_sizes,
    new_conv1d,
    weight_in_out,
)
from comera.nn.gated import DEFAULT_RANK, DEFAULT_TAU, GatedTrain, autocast_output, check_float_dtype
from comera.nn.layer import NameOf, Resolve, register_layer, spec_arguments
from comera.nn.removed import RemovedLinear
from comera.tt.autotune import autotune_enabled, cached_choice, size_bucket, tuned
from comera.tt.cores import core_std, spectral_std, tt_core_shapes, tt_full, ttm_core_shapes, ttm_full
from comera.tt.costs import (
    ORDERS,
    auto_tt_order,
    auto_ttm_order,
    contested_orders,
    tt_order_costs,
    ttm_merge_split,
    ttm_order_costs,
)
from comera.tt.fp8 import fp8_supported
from comera.tt.merge import fold_gates, merge_tt_left, merge_tt_right
from comera.tt.paths import FACTORS, GEMMS, tt_linear, ttm_linear
from comera.tt.shapes import auto_modes, auto_num_modes, check_modes, resolve_ranks
from comera.tt.svd import tt_svd, ttm_svd
from comera.tt.workspace import Workspace

__all__ = ["TTLinear", "TTMLinear"]

_ORDER_CHOICES = ("auto", *ORDERS)
_INITS = ("tt_svd", "random")


def pad_mode_counts(rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``rows`` and ``cols`` with the shorter one padded at the end by modes of size 1 to the same length
    (which leaves every entry's row-major index, and so the matrix, unchanged)."""
    length = max(len(rows), len(cols))
    return tuple(rows) + (1,) * (length - len(rows)), tuple(cols) + (1,) * (length - len(cols))


class _TrainLinear(GatedTrain):
    """Common part of the TT and TTM linear layers: features, bias, checks, init, conversion, and the layer
    protocol (:mod:`comera.nn.layer`)."""

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dense_type = nn.Linear
    role = "linear"
    shape_options = ("in_shape", "out_shape")
    dense_kind = "linear"
    """``"conv1d"`` for a layer converted from a ``transformers`` ``Conv1D`` (:mod:`comera.nn.conv1d`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        core_shapes: Sequence[Sequence[int]],
        tau: float,
        order: str,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.order = order
        self._build_train(core_shapes, tau, device, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    _order_choices: tuple[str, ...] = _ORDER_CHOICES

    @property
    def order(self) -> str:
        """Contraction order: ``"auto"`` (chosen per call) or one of ``"merge"``, ``"sequential"``,
        ``"dense"`` (and for ``TTLinear`` also ``"factors"``, :data:`comera.tt.paths.FACTORS`)."""
        return self._order

    @order.setter
    def order(self, value: str) -> None:
        if value not in self._order_choices:
            raise ValueError(f"order must be one of {self._order_choices}, got {value!r}")
        self._order = value

    def dense_num_parameters(self) -> int:
        return self.in_features * self.out_features

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Gaussian cores with reconstructed entry variance ``1 / (in + out)``; gates 1; bias as nn.Linear."""
        stds = core_std(1.0 / math.sqrt(self.in_features + self.out_features), self.max_ranks)
        for core, std in zip(self.cores, stds):
            core.normal_(0.0, std)
        for gate in self.gates:
            gate.fill_(1.0)
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias.uniform_(-bound, bound)

    def core_fans(self) -> list[tuple[int, int]]:
        """``(fan_in, fan_out)`` of every core read as the matrix it applies when an input is contracted
        core by core from the input side, at the cores' stored shapes (subclasses define the reading)."""
        raise NotImplementedError

    @torch.no_grad()
    def spectral_init_(self, zero_last: bool = False) -> None:
        """Redraw the cores under the spectral rule (:func:`comera.tt.cores.spectral_std` of each core's
        :meth:`core_fans`); gates back to 1, the bias kept. ``zero_last``: the last core starts at zero, so
        the layer starts as the zero map (for a layer that writes into a residual stream)."""
        for index, (core, (fan_in, fan_out)) in enumerate(zip(self.cores, self.core_fans())):
            if zero_last and index == len(self.cores) - 1:
                core.zero_()
            else:
                core.normal_(0.0, spectral_std(fan_in, fan_out))
        for gate in self.gates:
            gate.fill_(1.0)

    def _check_input(self, input: torch.Tensor) -> None:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
        if not input.is_floating_point():
            raise ValueError(f"input must have a floating-point dtype, got {input.dtype}")
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"input must have shape (*, {self.in_features}) (in_features={self.in_features}), "
                f"got {tuple(input.shape)}"
            )
        weight_dtype = self.core_list()[0].dtype
        if input.dtype != weight_dtype and not torch.is_autocast_enabled(input.device.type):
            raise ValueError(
                f"input dtype {input.dtype} does not match the layer's parameters ({weight_dtype}); "
                "convert one of them, e.g. layer.to(input.dtype)"
            )

    def order_costs(self, batch: int, backward: bool = True) -> dict[str, float]:
        """Estimated microseconds of each contraction order for ``batch`` rows (:mod:`comera.tt.costs`)."""
        raise NotImplementedError

    def _estimated_order(self, batch: int, backward: bool) -> str:
        raise NotImplementedError

    def chosen_order(self, input: torch.Tensor) -> str:
        """The contraction order an ``order="auto"`` call on ``input`` (``(*, in_features)``) runs now, under
        the current grad mode (measured now if autotuning has not timed this call shape yet)."""
        return self._order_for(input.reshape(-1, self.in_features))

    def _order_for(self, x: torch.Tensor) -> str:
        """The order of an ``order="auto"`` call on the 2-D ``x``: the cost model's, or the fastest measured
        one among those it cannot tell apart (:mod:`comera.tt.autotune`). A call shape measured before is
        answered from the cache without consulting the cost model (this runs on every call)."""
        batch, backward = x.shape[0], torch.is_grad_enabled()
        if not autotune_enabled():
            return self._estimated_order(batch, backward)
        key = (
            type(self).__name__,
            size_bucket(batch),
            self.in_shape,
            self.out_shape,
            self.max_ranks,
            self.bias is not None,
            getattr(self, "gemm", "fp32"),
            backward,
            x.requires_grad,
            x.dtype,
            x.device.type,
            torch.is_autocast_enabled(x.device.type),
            torch.get_num_threads(),
        )
        known = cached_choice(key)
        if known is not None:
            return known  # type: ignore[return-value]  # the cache holds this layer's order names
        return tuned(
            key,
            lambda: self.candidate_orders(batch, backward),
            self._estimated_order(batch, backward),
            self._trial(x, backward),
            x.device,
        )

    def candidate_orders(self, batch: int, backward: bool) -> tuple[str, ...]:
        """The orders autotuning measures for a call of ``batch`` rows (``backward``: with the gradients):
        those the cost model cannot tell apart (:func:`comera.tt.costs.contested_orders`), a tuple of names
        from :data:`comera.tt.costs.ORDERS` in that order, plus what a layer type adds; one name when the
        estimate is clear."""
        return contested_orders(self.order_costs(batch, backward))

    def _trial(self, x: torch.Tensor, backward: bool) -> Callable[[str], object]:
        """A runner of one order on detached copies of ``x`` and the parameters (forward, and with
        ``backward`` the gradients of every copy the call would differentiate), for
        :func:`comera.tt.autotune.tuned`; the copies are made at its first run."""
        made: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]] = []

        def copies():
            if not made:
                with torch.no_grad():
                    cores = [core.detach().requires_grad_(backward) for core in self.core_list()]
                    gates = [gate.detach().requires_grad_(backward) for gate in self.masked_gates()]
                    bias = None if self.bias is None else self.bias.detach().requires_grad_(backward)
                made.append((x.detach().requires_grad_(backward and x.requires_grad), cores, gates, bias))
            return made[0]

        def run(order: str) -> None:
            inputs, cores, gates, bias = copies()
            with torch.set_grad_enabled(backward):
                out = self._contract_with(inputs, order, cores, gates, bias)
                if backward:
                    leaves = [t for t in (inputs, *cores, *gates, bias) if t is not None and t.requires_grad]
                    torch.autograd.grad(out, leaves, torch.ones_like(out))

        return run

    def _contract(self, x: torch.Tensor, order: str) -> torch.Tensor:
        return self._contract_with(x, order, self.core_list(), self.masked_gates(), self.bias)

    def _contract_with(
        self,
        x: torch.Tensor,
        order: str,
        cores: Sequence[torch.Tensor],
        gates: Sequence[torch.Tensor],
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x @ W + bias`` by ``order`` for the 2-D ``x``, ``W`` given by ``cores`` and masked ``gates``."""
        raise NotImplementedError

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input @ W^T + bias``: ``(*, in_features) -> (*, out_features)``; under autocast the output has
        the autocast dtype whatever the contraction order, as ``nn.Linear``'s."""
        self._check_input(input)
        lead = input.shape[:-1]
        if self.shapes_only(input):
            return input.new_empty(*lead, self.out_features)
        flat = input.dim() == 2  # no reshape then: each is an autograd node, which counts for small batches
        x = input if flat else input.reshape(-1, self.in_features)
        if self._serves_from_cache():
            output = autocast_output(self._from_cache(x))
        else:
            order = self._order_for(x) if self.order == "auto" else self.order
            output = autocast_output(self._contract(x, order))
        return output if flat else output.reshape(*lead, self.out_features)

    def _serves_from_cache(self) -> bool:
        """Whether this call is answered from an inference cache (see :class:`TTLinear`)."""
        return False

    @property
    def workspace(self) -> Workspace:
        """Scratch buffers of the merge order's backward, reused across calls and sized to the largest."""
        workspace = self.__dict__.get("_workspace")
        if workspace is None:
            workspace = self.__dict__["_workspace"] = Workspace()
        return workspace

    def release_workspace(self) -> None:
        """Free the scratch buffers (e.g. after a peak batch); later calls regrow them."""
        self.workspace.release()

    def _from_cache(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dense_padded(self) -> torch.Tensor:
        raise NotImplementedError

    def to_dense(self) -> torch.Tensor:
        """The weight as ``nn.Linear.weight`` holds it: ``(out_features, in_features)``, gates applied."""
        return self._dense_padded()[: self.in_features, : self.out_features].t()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, in_shape={self.in_shape}, out_shape={self.out_shape}, "
            f"ranks={self.ranks}, max_ranks={self.max_ranks}, compression={self.compression:.1f}x"
        )

    @classmethod
    def converts(cls, module: nn.Module) -> bool:
        """Whether ``module`` is an ``nn.Linear`` or a ``transformers`` ``Conv1D``."""
        return isinstance(module, nn.Linear) or is_conv1d(module)

    @staticmethod
    def _padded_weight(linear: nn.Module, layer: _TrainLinear) -> torch.Tensor:
        weight = weight_in_out(linear).detach()
        rows, cols = math.prod(layer.in_shape), math.prod(layer.out_shape)
        return torch.nn.functional.pad(weight, (0, cols - weight.shape[1], 0, rows - weight.shape[0]))

    @staticmethod
    def _svd_cores(weight: torch.Tensor, layer: _TrainLinear) -> list[torch.Tensor]:
        """TT-SVD cores of the padded ``(in, out)`` weight at the layer's stored ranks."""
        raise NotImplementedError

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rank: int | Sequence[int] = DEFAULT_RANK,
        in_shape: Sequence[int] | None = None,
        out_shape: Sequence[int] | None = None,
        tau: float = DEFAULT_TAU,
    ):
        """A layer initialised from ``linear`` by TT-SVD (exact when ranks are maximal, else each bond keeps
        its leading singular directions); bias copied, device and dtype from ``linear.weight``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        layer = cls._like(linear, in_shape=in_shape, out_shape=out_shape, rank=rank, tau=tau)
        layer._load_svd(linear)
        return layer

    @classmethod
    def _like(cls, linear: nn.Module, **options: Any):
        """A layer with the sizes, device and dtype of ``linear`` (an ``nn.Linear`` or a ``Conv1D``), its
        bias copied; cores freshly initialised. ``options``: the constructor's keyword arguments (shapes,
        rank, tau, order)."""
        weight = cast(torch.Tensor, linear.weight)
        layer = cls(**linear_sizes(linear), device=weight.device, dtype=weight.dtype, **options)
        layer.dense_kind = dense_kind_of(linear)
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)  # type: ignore[arg-type]  # not None, checked above
        return layer

    def _load_svd(self, linear: nn.Linear) -> None:
        """Set the cores to the TT-SVD of ``linear``'s weight at the stored ranks."""
        cores = self._svd_cores(self._padded_weight(linear, self), self)
        with torch.no_grad():
            for param, core in zip(self.cores, cores):
                param.copy_(core)

    def spec(self, name_of: NameOf | None = None) -> dict[str, Any]:
        """``{"kind", in_features, out_features, bias, in_shape, out_shape, rank (stored), tau, order}``."""
        return {
            "kind": self.kind,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
            "in_shape": list(self.in_shape),
            "out_shape": list(self.out_shape),
            "rank": list(self.max_ranks),
            "tau": self.tau,
            "order": self.order,
            **({"dense_kind": self.dense_kind} if self.dense_kind != "linear" else {}),
        }

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        resolve: Resolve | None = None,
    ) -> _TrainLinear:
        """A fresh layer with the sizes, shapes, stored ranks and settings recorded in ``spec``."""
        arguments = spec_arguments(cls, spec)
        dense_kind = check_dense_kind(arguments.pop("dense_kind", "linear"))
        layer = cls(
            arguments.pop("in_features"),
            arguments.pop("out_features"),
            **arguments,
            device=device,
            dtype=dtype,
        )
        layer.dense_kind = dense_kind
        layer._restore_stored_ranks(spec["rank"])
        return layer

    @classmethod
    def from_dense(cls, module: nn.Module, *, init: str = "tt_svd", **options: Any) -> _TrainLinear:
        """The layer standing for the ``nn.Linear`` (or ``transformers`` ``Conv1D``) ``module``: its sizes,
        bias (copied), device, dtype and training mode; cores by TT-SVD of its weight (``init="tt_svd"``) or
        random at the weight's scale (``init="random"``). ``options``: constructor keywords (shapes, rank,
        tau, order)."""
        if not cls.converts(module):
            raise TypeError(
                f"module must be an nn.Linear or a transformers Conv1D, got {type(module).__name__}"
            )
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        layer = cls._like(module, **options)
        if init == "tt_svd":
            layer._load_svd(module)
        else:
            layer.match_scale_(module.weight)
        return layer.train(module.training)

    def to_dense_module(self, dense_of: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Module:
        """An ``nn.Linear`` (a ``Conv1D`` for a layer converted from one) with weight :meth:`to_dense` and a
        copy of the bias, in this layer's mode."""
        if self.dense_kind == "conv1d":
            return new_conv1d(self.to_dense(), self.bias).train(self.training)
        like = self.cores[0]
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=like.device,
            dtype=like.dtype,
        )
        with torch.no_grad():
            linear.weight.copy_(self.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear.train(self.training)

    def pruned_stand_in(self) -> RemovedLinear:
        """A :class:`RemovedLinear` of the same sizes holding this layer's bias (the same parameter)."""
        like = self.cores[0]
        removed = RemovedLinear(
            self.in_features,
            self.out_features,
            bias=False,
            dense_kind=self.dense_kind,
            device=like.device,
            dtype=like.dtype,
        )
        if self.bias is not None:
            removed.bias = self.bias
        return removed.train(self.training)

    def dense_attributes(self) -> dict[str, Any]:
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
        }

    def dense_mismatch(self, module: nn.Module) -> str | None:
        if is_conv1d(module):
            return conv1d_mismatch(self.dense_attributes(), module)
        return super().dense_mismatch(module)

    @property
    def mode_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (tuple(self.in_shape), tuple(self.out_shape))


@register_layer
class TTLinear(_TrainLinear):
    """Linear layer with a tensor-train weight over ``in_shape + out_shape`` modes; in eval mode without
    autograd (order ``"auto"`` or ``"merge"``, fp32 GEMMs) it answers with two GEMMs on cached merged halves
    (:meth:`clear_cache` after writes through ``.data``).

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias.
        in_shape: input modes (product ``>= in_features``, padding with zero rows); default balanced, padded.
        out_shape: output modes (product ``>= out_features``, padded outputs sliced off); default likewise.
        rank: max rank per bond (int) or one per bond (``len(in_shape) + len(out_shape) - 1`` ints);
            clipped to what the shapes allow.
        tau: gate threshold; gate entries with ``|g| <= tau`` are dead.
        order: contraction order, ``"auto"`` or one of :data:`comera.tt.costs.ORDERS`.
        gemm: ``"fp32"`` (GEMMs in the input dtype) or ``"fp8"`` (the merge order's six batch-sized GEMMs
            through ``torch._scaled_mm``, :mod:`comera.tt.fp8`).

    Shape:
        input ``(*, in_features)`` -> output ``(*, out_features)``.

    Examples:
        >>> import torch
        >>> import comera
        >>> layer = comera.TTLinear(768, 3072, rank=16)  # in place of nn.Linear(768, 3072)
        >>> layer.in_shape, layer.out_shape
        ((8, 8, 12), (16, 16, 12))
        >>> layer(torch.randn(4, 32, 768)).shape
        torch.Size([4, 32, 3072])
        >>> layer.to_dense().shape  # the weight, rebuilt for inspection: (out_features, in_features)
        torch.Size([3072, 768])
    """

    format = "tt"
    report_format = "tt"

    _order_choices = (*_ORDER_CHOICES, FACTORS)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        in_shape: Sequence[int] | None = None,
        out_shape: Sequence[int] | None = None,
        rank: int | Sequence[int] = DEFAULT_RANK,
        tau: float = DEFAULT_TAU,
        order: str = "auto",
        gemm: str = "fp32",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_int(in_features, "in_features", 1)
        check_int(out_features, "out_features", 1)
        check_float_dtype(dtype)
        self.in_shape = (
            auto_modes(in_features)
            if in_shape is None
            else check_modes(in_shape, in_features, "in_shape", allow_padding=True)
        )
        self.out_shape = (
            auto_modes(out_features, descending=True)
            if out_shape is None
            else check_modes(out_shape, out_features, "out_shape", allow_padding=True)
        )
        modes = self.in_shape + self.out_shape
        shapes = tt_core_shapes(modes, resolve_ranks(rank, modes))
        super().__init__(in_features, out_features, bias, shapes, tau, order, device, dtype)
        self.gemm = gemm

    def spec(self, name_of: NameOf | None = None) -> dict[str, Any]:
        """As :meth:`_TrainLinear.spec`, plus ``gemm``."""
        return {**super().spec(name_of), "gemm": self.gemm}

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        return self.in_shape + self.out_shape

    def core_fans(self) -> list[tuple[int, int]]:
        """A core ``(r_{k-1}, n_k, r_k)`` of an input mode reads ``r_{k-1} n_k`` values and writes ``r_k``;
        one of an output mode reads ``r_{k-1}`` and writes ``n_k r_k``."""
        inputs = len(self.in_shape)
        return [
            (left * mode, right) if index < inputs else (left, mode * right)
            for index, (left, mode, right) in enumerate(core.shape for core in self.cores)
        ]

    @property
    def gemm(self) -> str:
        """Number format of the merge order's batch-sized GEMMs: ``"fp32"`` or ``"fp8"``."""
        return self._gemm

    @gemm.setter
    def gemm(self, value: str) -> None:
        if value not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {value!r}")
        device = self.cores[0].device
        if value == "fp8" and not fp8_supported(device):
            raise ValueError(f"gemm='fp8' needs torch._scaled_mm with FP8 on {device}, which is unavailable")
        self._gemm = value

    def order_costs(self, batch: int, backward: bool = True) -> dict[str, float]:
        """Estimated microseconds of each contraction order for ``batch`` rows (:mod:`comera.tt.costs`)."""
        return tt_order_costs(batch, self.in_shape, self.out_shape, self.max_ranks, backward)

    def _estimated_order(self, batch: int, backward: bool) -> str:
        return auto_tt_order(batch, self.in_shape, self.out_shape, self.max_ranks, backward)

    def candidate_orders(self, batch: int, backward: bool) -> tuple[str, ...]:
        """The contested orders, and :data:`comera.tt.paths.FACTORS` beside ``"merge"`` (fp32 GEMMs)."""
        contested = super().candidate_orders(batch, backward)
        if "merge" in contested and self.gemm == "fp32":
            return (*contested, FACTORS)
        return contested

    def _contract_with(self, x, order, cores, gates, bias):
        num_in = len(self.in_shape)
        return tt_linear(x, cores, num_in, self.out_features, bias, order, self.gemm, self.workspace, gates)

    def _serves_from_cache(self) -> bool:
        return self.serves_from_cache() and self.order in ("auto", "merge") and self.gemm == "fp32"

    def _from_cache(self, x: torch.Tensor) -> torch.Tensor:
        left, right = self.inference_cached("factors", self._merged_factors)
        hidden = x @ left
        return hidden @ right if self.bias is None else torch.addmm(self.bias, hidden, right)

    def _merged_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged halves ``(in_features, r)`` and ``(r, out_features)`` of the gated train."""
        cores, split = self.gated_cores(), len(self.in_shape)
        left = merge_tt_left(cores[:split])[: self.in_features].contiguous()
        right = merge_tt_right(cores[split:])[:, : self.out_features].contiguous()
        return left, right

    def _dense_padded(self) -> torch.Tensor:
        full = tt_full(self.gated_cores())
        return full.reshape(math.prod(self.in_shape), math.prod(self.out_shape))

    @staticmethod
    def _svd_cores(weight, layer):
        return tt_svd(weight.reshape(layer.in_shape + layer.out_shape), layer.max_ranks)


@register_layer
class TTMLinear(_TrainLinear):
    """Linear layer with a matrix tensor-train (TTM) weight: cores ``(r_{k-1}, m_k, n_k, r_k)``.

    Args:
        in_features: as ``nn.Linear``.
        out_features: as ``nn.Linear``.
        bias: as ``nn.Linear``.
        in_shape: row modes ``m_k`` (product ``>= in_features``); default balanced, padded if needed.
        out_shape: column modes ``n_k`` (product ``>= out_features``); the shorter of the two shapes is
            padded at the end with size-1 modes.
        rank: max rank per bond (int) or ``d - 1`` ints; clipped to what the shapes allow.
        tau: gate threshold.
        order: contraction order, ``"auto"`` or one of :data:`comera.tt.costs.ORDERS`.

    Shape:
        input ``(*, in_features)`` -> output ``(*, out_features)``.

    Examples:
        >>> import torch
        >>> import comera
        >>> layer = comera.TTMLinear(97, 53, rank=8)  # sizes that fold badly are padded inside
        >>> layer.in_shape, layer.out_shape  # 98 = 7 x 14 rows, 54 = 9 x 6 columns
        ((7, 14), (9, 6))
        >>> layer(torch.randn(5, 97)).shape
        torch.Size([5, 53])
    """

    format = "ttm"
    report_format = "ttm"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        in_shape: Sequence[int] | None = None,
        out_shape: Sequence[int] | None = None,
        rank: int | Sequence[int] = DEFAULT_RANK,
        tau: float = DEFAULT_TAU,
        order: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_int(in_features, "in_features", 1)
        check_int(out_features, "out_features", 1)
        check_float_dtype(dtype)
        if in_shape is not None:
            in_shape = check_modes(in_shape, in_features, "in_shape", allow_padding=True)
        if out_shape is not None:
            out_shape = check_modes(out_shape, out_features, "out_shape", allow_padding=True)
        if in_shape is not None and out_shape is not None:
            in_shape, out_shape = pad_mode_counts(in_shape, out_shape)
        given = in_shape or out_shape
        order_count = len(given) if given else max(auto_num_modes(in_features), auto_num_modes(out_features))
        self.in_shape = in_shape or auto_modes(in_features, order_count)
        self.out_shape = out_shape or auto_modes(out_features, order_count, descending=True)
        ranks = resolve_ranks(rank, self.bond_sizes)
        shapes = ttm_core_shapes(self.in_shape, self.out_shape, ranks)
        super().__init__(in_features, out_features, bias, shapes, tau, order, device, dtype)

    @property
    def bond_sizes(self) -> tuple[int, ...]:
        return tuple(m * n for m, n in zip(self.in_shape, self.out_shape))

    def core_fans(self) -> list[tuple[int, int]]:
        """A core ``(r_{k-1}, m_k, n_k, r_k)`` reads ``r_{k-1} m_k`` values and writes ``n_k r_k``."""
        return [
            (left * rows, cols * right) for left, rows, cols, right in (core.shape for core in self.cores)
        ]

    def order_costs(self, batch: int, backward: bool = True) -> dict[str, float]:
        """Estimated microseconds of each contraction order for ``batch`` rows (:mod:`comera.tt.costs`)."""
        return ttm_order_costs(batch, self.in_shape, self.out_shape, self.max_ranks, backward)

    def _estimated_order(self, batch: int, backward: bool) -> str:
        return auto_ttm_order(batch, self.in_shape, self.out_shape, self.max_ranks, backward)

    def _contract_with(self, x, order, cores, gates, bias):
        split = None
        if order == "merge":
            backward = torch.is_grad_enabled()
            split = ttm_merge_split(x.shape[0], self.in_shape, self.out_shape, self.max_ranks, backward)
        return ttm_linear(x, fold_gates(cores, gates), self.out_features, bias, order, split, self.workspace)

    def _dense_padded(self) -> torch.Tensor:
        return ttm_full(self.gated_cores())

    @staticmethod
    def _svd_cores(weight, layer):
        return ttm_svd(weight, layer.in_shape, layer.out_shape, layer.max_ranks)
