"""``TTMTiedHead``: an output projection tied to a TTM embedding table, as BERT/RoBERTa tie the decoder to the
word embedding; its logits come from the table's cores (:meth:`TTMEmbedding.tied_logits`), never from the
dense table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from comera.nn.embedding import _TTMTable
from comera.nn.layer import ComeraLayer, NameOf, Resolve, register_layer, spec_arguments
from comera.nn.removed import RemovedLinear
from comera.tt.costs import ORDERS

__all__ = ["TTMTiedHead"]

_ORDER_CHOICES = ("auto", *ORDERS)


@register_layer
class TTMTiedHead(ComeraLayer, nn.Module):
    """Output projection tied to a TTM table (``logits = hidden @ E^T + bias``, as BERT ties its decoder to
    the word embedding), sharing the embedding's cores and gates; its spec names the embedding, its dense
    module is an ``nn.Linear`` sharing the restored table's weight, its pruned stand-in a
    :class:`RemovedLinear` holding its bias.

    Args:
        embedding: the :class:`TTMEmbedding` (or :class:`TTMEmbeddingBag`) to tie to.
        bias: learn a bias of size ``num_embeddings`` (initialised to zero).
        order: contraction order, ``"auto"`` or one of :data:`comera.tt.costs.ORDERS`.

    Shape:
        input ``(*, embedding_dim)`` -> output ``(*, num_embeddings)``.

    Examples:
        >>> import torch
        >>> import comera
        >>> embedding = comera.TTMEmbedding(1000, 64, rank=8)
        >>> head = comera.TTMTiedHead(embedding)  # logits against the embedding's own (compressed) table
        >>> head(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 1000])
    """

    dense_type = nn.Linear
    report_format = "ttm"
    owns_weight = False

    def __init__(self, embedding: _TTMTable, bias: bool = True, *, order: str = "auto") -> None:
        super().__init__()
        if not isinstance(embedding, _TTMTable):
            raise TypeError(f"embedding must be a TTMEmbedding, got {type(embedding).__name__}")
        if order not in _ORDER_CHOICES:
            raise ValueError(f"order must be one of {_ORDER_CHOICES}, got {order!r}")
        self.embedding = embedding
        self.order = order
        if bias:
            weight = embedding.cores[0]
            self.bias = nn.Parameter(
                torch.zeros(embedding.num_embeddings, device=weight.device, dtype=weight.dtype)
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the table's rows: ``(*, embedding_dim) -> (*, num_embeddings)``."""
        return self.embedding.tied_logits(hidden, self.bias, self.order)

    def spec(self, name_of: NameOf | None = None) -> dict[str, Any]:
        """``{"kind", "embedding": name_of(self.embedding), "bias", "order"}``."""
        if name_of is None:
            raise ValueError("a TTMTiedHead spec names its embedding: pass name_of=")
        return {
            "kind": self.kind,
            "embedding": name_of(self.embedding),
            "bias": self.bias is not None,
            "order": self.order,
        }

    @classmethod
    def spec_references(cls, spec: Mapping[str, Any]) -> tuple[str, ...]:
        return (spec["embedding"],)

    def references(self) -> tuple[nn.Module, ...]:
        return (self.embedding,)

    @classmethod
    def from_spec(
        cls,
        spec: Mapping[str, Any],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        resolve: Resolve | None = None,
    ) -> TTMTiedHead:
        """A head tied to ``resolve(spec["embedding"])`` (device and dtype follow that table)."""
        arguments = spec_arguments(cls, spec)
        if resolve is None:
            raise ValueError("a TTMTiedHead is tied to a module of the model: pass resolve=")
        return cls(resolve(arguments.pop("embedding")), **arguments)  # type: ignore[arg-type]  # resolve gives the table

    @classmethod
    def converts(cls, module: nn.Module) -> bool:
        """A head is built from a linear only together with its table (:meth:`from_dense`'s ``embedding``)."""
        return False

    @classmethod
    def from_dense(
        cls, module: nn.Module, *, init: str = "tt_svd", embedding: _TTMTable | None = None, **options: Any
    ) -> TTMTiedHead:
        """The head standing for the linear ``module`` whose weight is ``embedding``'s table: bias copied,
        training mode kept; ``init`` is unused (the weight is the table's)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module must be an nn.Linear, got {type(module).__name__}")
        if embedding is None:
            raise ValueError("a TTMTiedHead needs the embedding= table it is tied to")
        head = cls(embedding, bias=module.bias is not None, **options)
        if module.bias is not None:
            with torch.no_grad():
                head.bias.copy_(module.bias)
        return head.train(module.training)

    def to_dense_module(self, dense_of: Callable[[nn.Module], nn.Module | None] | None = None) -> nn.Linear:
        """An ``nn.Linear`` whose weight is the restored table's weight (``dense_of(self.embedding)``, shared)
        or, without one, a copy of the table; the bias is copied."""
        table = None if dense_of is None else dense_of(self.embedding)
        weight = table.weight if table is not None else nn.Parameter(self.embedding.to_dense().detach())
        linear = nn.Linear(
            self.embedding.embedding_dim,
            self.embedding.num_embeddings,
            bias=self.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        linear.weight = weight  # type: ignore[assignment]  # a Parameter
        if self.bias is not None:
            with torch.no_grad():
                linear.bias.copy_(self.bias)
        return linear.train(self.training)

    def pruned_stand_in(self) -> RemovedLinear:
        """A :class:`RemovedLinear` ``embedding_dim -> num_embeddings`` holding this head's bias."""
        like = self.embedding.cores[0]
        removed = RemovedLinear(
            self.embedding.embedding_dim,
            self.embedding.num_embeddings,
            bias=False,
            device=like.device,
            dtype=like.dtype,
        )
        if self.bias is not None:
            removed.bias = self.bias
        return removed.train(self.training)

    def dense_attributes(self) -> dict[str, Any]:
        return {
            "in_features": self.embedding.embedding_dim,
            "out_features": self.embedding.num_embeddings,
            "bias": self.bias is not None,
        }

    @property
    def mode_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (tuple(self.embedding.col_shape), tuple(self.embedding.row_shape))

    def extra_repr(self) -> str:
        return f"bias={self.bias is not None}, order={self.order!r}"
