"""Stand-ins for layers whose rank gates died: their weight is exactly zero (docs/method.md section 3).

:func:`comera.prune_` puts these in place of a layer with a dead bond. They keep the layer's interface and
output shape, hold no cores, and return the bias (linear) or zeros (embedding).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RemovedLayer", "RemovedLinear", "RemovedEmbedding", "RemovedEmbeddingBag"]


class RemovedLayer(nn.Module):
    """Base of the removed-layer stand-ins; ``dense_num_parameters()`` counts the weight it replaced."""

    def dense_num_parameters(self) -> int:
        """Entries of the dense weight this layer replaced."""
        raise NotImplementedError

    def num_parameters(self) -> int:
        """Weight entries still held: always 0."""
        return 0


class RemovedLinear(RemovedLayer):
    """A linear layer with weight 0: ``(*, in_features) -> (*, out_features)``, returns the bias (or 0)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def dense_num_parameters(self) -> int:
        return self.in_features * self.out_features

    def to_dense(self) -> torch.Tensor:
        """The weight, zeros of shape ``(out_features, in_features)``."""
        like = self.bias
        return torch.zeros(
            self.out_features,
            self.in_features,
            device=None if like is None else like.device,
            dtype=None if like is None else like.dtype,
        )

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


class RemovedEmbedding(RemovedLayer):
    """An embedding table that is exactly 0: indices ``(*)`` -> zeros ``(*, embedding_dim)``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.register_buffer("_like", torch.empty(0, device=device, dtype=dtype), persistent=False)

    def dense_num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def to_dense(self) -> torch.Tensor:
        """The table, zeros of shape ``(num_embeddings, embedding_dim)``."""
        return self._like.new_zeros(self.num_embeddings, self.embedding_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Zeros of shape ``(*input.shape, embedding_dim)``."""
        return self._like.new_zeros(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class RemovedEmbeddingBag(RemovedEmbedding):
    """An embedding bag whose table is exactly 0: every bag pools to zeros ``(B, embedding_dim)``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mode: str = "mean",
        *,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.mode = mode
        self.include_last_offset = include_last_offset
        self.padding_idx = padding_idx

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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
