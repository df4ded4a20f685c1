"""``--method lte``: LoRA-the-Explorer (Huh et al., 2024, "Training Neural Networks from Scratch with Parallel
Low-Rank Adapters"), built from the paper: each targeted linear becomes an :class:`LTELinear` whose parallel
LoRA heads merge into the frozen main weight every ``T`` optimizer steps (:func:`merge_every`). Details
(settings, our choices and their sources): docs/reference/training.md, "The baseline methods"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera.checks import check_int, check_number
from comera.methods.base import Method, MethodContext, register_method
from comera.methods.targets import replace_targets
from comera.modules import trainable_parameters

__all__ = ["LTELinear", "LTEMethod", "LTESettings", "lte_layers", "merge_heads", "merge_every"]


class LTELinear(nn.Module):
    """A linear with a frozen main weight and ``heads`` parallel LoRA heads, each fed one chunk of the batch
    (``torch.tensor_split(x, heads)``), row block ``n`` getting ``x W^T + b + s (x A_n^T) B_n^T``.

    Shapes:
        input ``(batch, *, in_features)`` (dim 0 is the batch) -> output ``(batch, *, out_features)``.

    Args:
        in_features, out_features: sizes of the linear.
        heads: number of LoRA heads ``N`` (>= 1).
        rank: rank ``r`` of each head (>= 1; capped at ``min(in_features, out_features)``).
        scale: ``s`` of the heads' output and of the merge (> 0).
        bias: whether the layer has a (trainable) bias.

    Attributes:
        weight: the frozen main weight ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.
        lora_A: ``(heads, rank, in_features)``; ``lora_B``: ``(heads, out_features, rank)``.
        local_steps: optimizer steps since the last merge (a buffer, so checkpoints keep it).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        heads: int,
        rank: int,
        scale: float,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int(heads, "heads", low=1)
        check_int(rank, "rank", low=1)
        check_number(scale, "scale", 0.0, open_low=True)
        self.in_features, self.out_features = in_features, out_features
        self.heads, self.rank, self.scale = heads, min(rank, in_features, out_features), float(scale)
        factory = {"device": device, "dtype": dtype}
        initial = nn.Linear(in_features, out_features, bias=bias, **factory)
        self.weight = initial.weight.requires_grad_(False)
        self.bias = initial.bias
        self.lora_A = nn.Parameter(torch.empty(heads, self.rank, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(heads, out_features, self.rank, **factory))
        self.register_buffer("local_steps", torch.zeros((), dtype=torch.long, device=device))
        self.reset_heads()

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, heads: int, rank: int, scale: float) -> LTELinear:
        """An LTE layer whose main weight and bias are ``linear``'s own parameters (the weight frozen)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            heads=heads,
            rank=rank,
            scale=scale,
            bias=False,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        layer.weight = linear.weight
        layer.weight.requires_grad_(False)
        layer.bias = linear.bias
        return layer

    @torch.no_grad()
    def reset_heads(self) -> None:
        """Restart the heads: ``A_n`` uniform in ``+-1/sqrt(in_features)``, ``B_n`` zero."""
        bound = 1.0 / math.sqrt(self.in_features)
        self.lora_A.uniform_(-bound, bound)
        self.lora_B.zero_()

    def delta(self) -> torch.Tensor:
        """``(s/N) sum_n B_n A_n``, shape ``(out_features, in_features)``."""
        # n: head, o: output feature, r: rank, i: input feature
        return torch.einsum("nor,nri->oi", self.lora_B, self.lora_A) * (self.scale / self.heads)

    @torch.no_grad()
    def merge_(self) -> None:
        """``W <- W + (s/N) sum_n B_n A_n``, then :meth:`reset_heads` and ``local_steps = 0``."""
        self.weight.add_(self.delta().to(self.weight.dtype))
        self.reset_heads()
        self.local_steps.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.linear(x, self.weight + self.delta(), self.bias)
        if x.dim() < 2:
            raise ValueError(
                f"LTE splits each training batch across its heads along dim 0, so the input needs a batch "
                f"dimension before its features: got shape {tuple(x.shape)}"
            )
        main = F.linear(x, self.weight, self.bias)
        if x.shape[0] % self.heads == 0:
            chunks = x.reshape(self.heads, -1, self.in_features)
            low = torch.bmm(chunks, self.lora_A.transpose(1, 2))
            heads_out = torch.bmm(low, self.lora_B.transpose(1, 2)).reshape(*x.shape[:-1], self.out_features)
        else:
            heads_out = torch.cat(
                [
                    F.linear(F.linear(chunk, self.lora_A[n]), self.lora_B[n])
                    for n, chunk in enumerate(torch.tensor_split(x, self.heads))
                ]
            )
        return main + self.scale * heads_out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, heads={self.heads}, "
            f"rank={self.rank}, scale={self.scale}, bias={self.bias is not None}"
        )


def lte_layers(model: nn.Module) -> list[LTELinear]:
    """The :class:`LTELinear` layers of ``model``, in model order."""
    return [module for module in model.modules() if isinstance(module, LTELinear)]


def merge_heads(layers: list[LTELinear], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Merge every layer's heads (:meth:`LTELinear.merge_`) and reset their optimizer state in place (tensors
    zeroed, numbers set to 0: the state a fresh optimizer would build at its next step)."""
    for layer in layers:
        layer.merge_()
        if optimizer is None:
            continue
        for param in (layer.lora_A, layer.lora_B):
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    state[key] = type(value)(0)


def merge_every(
    optimizer: torch.optim.Optimizer, layers: list[LTELinear], every: int
) -> torch.optim.Optimizer:
    """Register a step post-hook on ``optimizer`` counting its steps in each layer's ``local_steps`` and
    merging the heads (:func:`merge_heads`) after every ``every``-th; returns ``optimizer``."""
    check_int(every, "every", low=1)

    def after_step(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        for layer in layers:
            layer.local_steps += 1
        if layers and int(layers[0].local_steps) >= every:
            merge_heads(layers, opt)

    optimizer.register_step_post_hook(after_step)
    return optimizer


@dataclass(frozen=True)
class LTESettings:
    """LTE's settings (where the defaults come from: docs/reference/training.md, "The baseline methods");
    checked on construction.

    Attributes:
        heads: parallel LoRA heads ``N``, an int >= 1 (``train.batch_size`` must divide by it).
        rank: each head's rank ``r``, an int >= 1; scale: the heads' factor ``s`` > 0.
        merge_every: optimizer steps ``T`` between merges, an int >= 1; lr: the heads' AdamW rate > 0.
    """

    heads: int = 4
    rank: int = 32
    scale: float = 128.0
    merge_every: int = 10
    lr: float = 1e-4

    def __post_init__(self) -> None:
        check_int(self.heads, "method.heads", low=1)
        check_int(self.rank, "method.rank", low=1)
        check_number(self.scale, "method.scale", 0.0, open_low=True)
        check_int(self.merge_every, "method.merge_every", low=1)
        check_number(self.lr, "method.lr", 0.0, open_low=True)


@register_method(LTESettings)
class LTEMethod(Method):
    """LTE: targeted linears become :class:`LTELinear`; AdamW on the heads (``method.lr``) and on every other
    trainable parameter (``train.lr_other``); heads merge every ``method.merge_every`` steps."""

    name = "lte"

    def prepare(self, model: nn.Module, context: MethodContext) -> nn.Module:
        settings = self.settings(context)
        heads, batch_size = settings.heads, context.train.batch_size
        if batch_size % heads:
            raise ValueError(
                f"LTE splits each batch across its heads: train.batch_size={batch_size} must be a multiple "
                f"of method.heads={heads}"
            )
        if context.train.cuda_graph:
            raise ValueError("LTE merges its heads on the host between steps; set train.cuda_graph=false")

        def build(linear: nn.Linear) -> LTELinear:
            return LTELinear.from_linear(linear, heads=heads, rank=settings.rank, scale=settings.scale)

        return replace_targets(model, context.tensorize, build)

    def optimizer(self, model: nn.Module, context: MethodContext) -> torch.optim.Optimizer:
        """AdamW: group ``"other"`` at ``train.lr_other`` with ``train.weight_decay``, group ``"lte_heads"``
        at ``method.lr`` without decay; the merge hook registered (:func:`merge_every`)."""
        settings = self.settings(context)
        layers = lte_layers(model)
        heads = [param for layer in layers for param in (layer.lora_A, layer.lora_B)]
        others = trainable_parameters(model.parameters(), seen={id(param) for param in heads})
        train = context.train
        groups = (
            [{"name": "other", "params": others, "lr": train.lr_other, "weight_decay": train.weight_decay}]
            if others
            else []
        )
        groups.append({"name": "lte_heads", "params": heads, "lr": settings.lr, "weight_decay": 0.0})
        optimizer = torch.optim.AdamW(groups, lr=settings.lr)
        return merge_every(optimizer, layers, settings.merge_every)
