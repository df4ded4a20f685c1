"""Stand-ins for layers whose rank gates died (their weight is exactly zero): put in place by
:func:`comera.prune_`, they keep the layer's interface and output shape, hold no cores, and return the bias
(linear) or zeros (embedding). Details: docs/method.md section 3."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from comera.nn.conv1d import check_dense_kind, conv1d_mismatch, is_conv1d, new_conv1d
from comera.nn.layer import ComeraLayer, NameOf, Resolve, register_layer, spec_arguments

__all__ = ["RemovedLayer", "RemovedLinear", "RemovedEmbedding", "RemovedEmbeddingBag"]


class RemovedLayer(ComeraLayer, nn.Module):
    """Base of the removed-layer stand-ins (layer protocol; the dense module has a zero weight);
    ``dense_num_parameters()`` counts the weight it replaced."""

    report_format = "removed"
    max_ranks: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()

    def dense_num_parameters(self) -> int:
        """Entries of the dense weight this layer replaced."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        """Weight entries still held: always 0."""
        return 0

    @classmethod
    def converts(cls, module: nn.Module) -> bool:
        """Stand-ins are never built from a dense module."""
        return False

    def spec(self, name_of: NameOf | None = None) -> dict[str, Any]:
        return {"kind": self.kind, **self.dense_attributes(), **self._extra_spec()}

    def _extra_spec(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        resolve: Resolve | None = None,
    ) -> RemovedLayer:
        return cls(**spec_arguments(cls, spec), device=device, dtype=dtype)

    def _placement(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_dense_module(self, dense_of: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Module:
        """The dense module (zero weight) with this stand-in's attributes."""
        dense = self.dense_type(**self._dense_arguments(), **self._placement())
        with torch.no_grad():
            dense.weight.zero_()
            if getattr(self, "bias", None) is not None:
                dense.bias.copy_(self.bias)
        return dense.train(self.training)

    def _dense_arguments(self) -> dict[str, Any]:
        """The spec without its kind: the constructor arguments the stand-in and its dense module share."""
        return {key: value for key, value in self.spec().items() if key != "kind"}


@register_layer
class RemovedLinear(RemovedLayer):
    """A linear layer with weight 0: ``(*, in_features) -> (*, out_features)``, returns the bias (or 0)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dense_kind: str = "linear",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.dense_kind = check_dense_kind(dense_kind)
        self.register_buffer("_like", torch.empty(0, device=device, dtype=dtype), persistent=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    dense_type = nn.Linear

    def dense_num_parameters(self) -> int:
        return self.in_features * self.out_features

    def dense_attributes(self) -> dict[str, Any]:
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
        }

    def _extra_spec(self) -> dict[str, Any]:
        return {"dense_kind": self.dense_kind} if self.dense_kind != "linear" else {}

    def _dense_arguments(self) -> dict[str, Any]:
        return self.dense_attributes()

    def dense_mismatch(self, module: nn.Module) -> str | None:
        if is_conv1d(module):
            return conv1d_mismatch(self.dense_attributes(), module)
        return super().dense_mismatch(module)

    def to_dense_module(self, dense_of: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Module:
        """An ``nn.Linear`` (a ``Conv1D`` when it stands for one) with a zero weight and this bias."""
        if self.dense_kind == "conv1d":
            return new_conv1d(self.to_dense(), self.bias).train(self.training)
        return super().to_dense_module(dense_of)

    def _placement(self) -> dict[str, Any]:
        like = self._like if self.bias is None else self.bias
        return {"device": like.device, "dtype": like.dtype}

    @property
    def mode_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.in_features,), (self.out_features,))

    def to_dense(self) -> torch.Tensor:
        """The weight, zeros of shape ``(out_features, in_features)``."""
        like = self._like if self.bias is None else self.bias
        return like.new_zeros(self.out_features, self.in_features)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The bias (or zeros) broadcast to ``(*, out_features)``."""
        if input.dim() == 0 or input.shape[-1] != self.in_features:
            raise ValueError(
                f"input must have shape (*, {self.in_features}) (in_features={self.in_features}), "
                f"got {tuple(input.shape)}"
            )
        zeros = input.new_zeros(*input.shape[:-1], self.out_features)
        return zeros if self.bias is None else zeros + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


@register_layer
class RemovedEmbedding(RemovedLayer):
    """An embedding table that is exactly 0: indices ``(*)`` -> zeros ``(*, embedding_dim)``; ``padding_idx``
    and ``sparse`` are kept for :meth:`to_dense_module`."""

    dense_type = nn.Embedding

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: int | None = None,
        sparse: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.sparse = bool(sparse)
        self.register_buffer("_like", torch.empty(0, device=device, dtype=dtype), persistent=False)

    def dense_num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def dense_attributes(self) -> dict[str, Any]:
        return {
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "padding_idx": self.padding_idx,
        }

    def _extra_spec(self) -> dict[str, Any]:
        return {"sparse": self.sparse}

    def _placement(self) -> dict[str, Any]:
        return {"device": self._like.device, "dtype": self._like.dtype}

    @property
    def mode_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.num_embeddings,), (self.embedding_dim,))

    def to_dense(self) -> torch.Tensor:
        """The table, zeros of shape ``(num_embeddings, embedding_dim)``."""
        return self._like.new_zeros(self.num_embeddings, self.embedding_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Zeros of shape ``(*input.shape, embedding_dim)``."""
        return self._like.new_zeros(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


@register_layer
class RemovedEmbeddingBag(RemovedEmbedding):
    """An embedding bag whose table is exactly 0: every bag pools to zeros ``(B, embedding_dim)``."""

    dense_type = nn.EmbeddingBag

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mode: str = "mean",
        *,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        sparse: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, padding_idx=padding_idx, sparse=sparse, device=device, dtype=dtype
        )
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Zeros ``(B, embedding_dim)``: ``B`` rows of a 2-D ``input``, else one per bag of ``offsets``."""
        if input.dim() == 2:
            bags = input.shape[0]
        elif offsets is not None:
            bags = offsets.shape[0] - (1 if self.include_last_offset else 0)
        else:
            raise ValueError(f"input must be 2-D (B, L), or 1-D with offsets; got shape {tuple(input.shape)}")
        return self._like.new_zeros(bags, self.embedding_dim)

    def dense_attributes(self) -> dict[str, Any]:
        return {
            **super().dense_attributes(),
            "mode": self.mode,
            "include_last_offset": self.include_last_offset,
        }

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
