"""``--method cola``: CoLA (Liu et al., EMNLP 2025, "CoLA: Compute-Efficient Pre-Training of LLMs via Low-Rank
Activation"), built from the paper: each targeted linear becomes ``y = B act(A x) + b`` (:class:`CoLALinear`),
trained from scratch. Details (settings, initialisation and their sources): docs/reference/training.md, "The
baseline methods"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from comera.checks import check_choice, check_int, check_number
from comera.methods.base import Method, MethodContext, register_method
from comera.methods.targets import replace_targets

__all__ = ["CoLALinear", "CoLAMethod", "CoLASettings", "ACTIVATIONS", "cola_rank"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "identity": lambda x: x,
}
"""The accepted ``activation`` names and their functions."""


def cola_rank(in_features: int, out_features: int, rank: int, rank_fraction: float) -> int:
    """The bottleneck of an ``(in, out)`` layer: ``rank`` when > 0, else
    ``floor(rank_fraction * min(in, out))``; capped at ``min(in, out)``, at least 1."""
    smaller = min(in_features, out_features)
    chosen = rank if rank > 0 else int(rank_fraction * smaller)
    return max(1, min(chosen, smaller))


class CoLALinear(nn.Module):
    """``y = B act(A x) + b``: a linear replaced by a low-rank bottleneck with a nonlinearity inside.

    Shapes:
        input ``(*, in_features)``, output ``(*, out_features)``.

    Args:
        in_features, out_features: sizes of the replaced linear.
        rank: the bottleneck ``r`` (1 <= r <= min(in_features, out_features)).
        activation: a name in :data:`ACTIVATIONS`.
        bias: whether the layer has a bias.

    Attributes:
        cola_a: ``A``, shape ``(rank, in_features)``; cola_b: ``B``, shape ``(out_features, rank)``.
        bias: ``(out_features,)`` or None.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        *,
        activation: str = "silu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int(rank, "rank", low=1)
        if rank > min(in_features, out_features):
            raise ValueError(
                f"rank must be in [1, min(in_features, out_features)] = "
                f"[1, {min(in_features, out_features)}], got {rank}"
            )
        self.activation = check_choice(activation, "activation", tuple(ACTIVATIONS))
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        factory = {"device": device, "dtype": dtype}
        std = ((in_features + out_features) * rank) ** -0.25
        self.cola_a = nn.Parameter(torch.randn(rank, in_features, **factory) * std)
        self.cola_b = nn.Parameter(torch.randn(out_features, rank, **factory) * std)
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, activation: str = "silu") -> CoLALinear:
        """A fresh CoLA layer of ``linear``'s sizes, device and dtype, with a copy of its bias."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            rank,
            activation=activation,
            bias=linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(ACTIVATIONS[self.activation](F.linear(x, self.cola_a)), self.cola_b, self.bias)

    def num_parameters(self) -> int:
        """Entries of ``A``, ``B`` and the bias."""
        return sum(param.numel() for param in self.parameters())

    def dense_num_parameters(self) -> int:
        """Entries of the dense linear this layer replaces (weight and bias)."""
        return self.in_features * self.out_features + (0 if self.bias is None else self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"activation={self.activation}, bias={self.bias is not None}"
        )


@dataclass(frozen=True)
class CoLASettings:
    """CoLA's settings (where the defaults come from: docs/reference/training.md, "The baseline methods");
    checked on construction.

    Attributes:
        rank_fraction: the bottleneck's rank as a fraction of ``min(in, out)``, in (0, 1].
        rank: a fixed rank, an int >= 0 (0: use ``rank_fraction``).
        activation: the bottleneck's nonlinearity, one of :data:`ACTIVATIONS`.
    """

    rank_fraction: float = 0.25
    rank: int = 0
    activation: str = "silu"

    def __post_init__(self) -> None:
        check_number(self.rank_fraction, "method.rank_fraction", 0.0, 1.0, open_low=True)
        check_int(self.rank, "method.rank", low=0)
        check_choice(self.activation, "method.activation", tuple(ACTIVATIONS))


@register_method(CoLASettings)
class CoLAMethod(Method):
    """CoLA: every targeted linear becomes a :class:`CoLALinear`; the Trainer's AdamW trains the model."""

    name = "cola"

    def prepare(self, model: nn.Module, context: MethodContext) -> nn.Module:
        settings = self.settings(context)

        def build(linear: nn.Linear) -> CoLALinear:
            rank = cola_rank(linear.in_features, linear.out_features, settings.rank, settings.rank_fraction)
            return CoLALinear.from_linear(linear, rank, settings.activation)

        return replace_targets(model, context.tensorize, build)
