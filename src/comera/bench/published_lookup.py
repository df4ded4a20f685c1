"""The TTM lookup order published with the CoMERA paper, rebuilt from its description as a benchmark baseline:
on an order-4 table, merge the two core pairs once per call into ``A`` ``(m1 m2, n1 n2, r2)`` and ``B``
``(r2, m3 m4, n3 n4)``, gather ``A[p]`` and ``B[:, q]`` per index, one batched product, plain autograd;
optionally each distinct id once through a persistent id -> position map. Details: docs/method.md section
6."""

from __future__ import annotations

import torch
from torch import nn

from comera.nn.embedding import TTMEmbedding

__all__ = ["PublishedOrderLookup"]


class PublishedOrderLookup(nn.Module):
    """The published pair-merge lookup over ``embedding``'s cores: ``(N,)`` ids -> ``(N, embedding_dim)``.

    Args:
        embedding: an order-4 :class:`comera.TTMEmbedding` (its cores and gates are shared, not copied).
        unique: compute each distinct id once and scatter through the persistent map (the paper code's
            ``use_unique``); off in the paper's released transformer code.
    """

    def __init__(self, embedding: TTMEmbedding, unique: bool = False) -> None:
        super().__init__()
        if len(embedding.cores) != 4:
            raise ValueError(
                f"embedding must have 4 cores for the published order-4 lookup, got {len(embedding.cores)}"
            )
        self.embedding = embedding
        self.unique = unique
        self.fast_rows = embedding.row_shape[2] * embedding.row_shape[3]
        self.register_buffer(
            "position_map", torch.zeros(embedding.num_embeddings, dtype=torch.long), persistent=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D, in range) of the table: ``(N,) -> (N, embedding_dim)``."""
        first, second, third, fourth = self.embedding.gated_cores()
        # a, e: outer rank 1; i/k/m/o: row digits; j/l/n/p: column digits; b, c, d: inner ranks.
        left = torch.einsum("aijb,bklc->ikjlc", first, second)
        right = torch.einsum("cmnd,dope->cmonp", third, fourth)
        left = left.reshape(left.shape[0] * left.shape[1], left.shape[2] * left.shape[3], left.shape[4])
        right = right.reshape(right.shape[0], right.shape[1] * right.shape[2], -1)
        wanted = torch.unique(ids) if self.unique else ids
        # r: row of the batch, s: left column digits, t: right column digits, c: middle rank.
        rows = torch.einsum(
            "rsc,crt->rst", left[wanted // self.fast_rows], right[:, wanted % self.fast_rows, :]
        ).reshape(wanted.shape[0], -1)[:, : self.embedding.embedding_dim]
        if not self.unique:
            return rows
        self.position_map[wanted] = torch.arange(wanted.shape[0], device=ids.device)
        return rows[self.position_map[ids]]
