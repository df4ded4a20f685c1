"""The key-value cache of a :class:`~comera.workloads.llm.model.LlamaLM`: each layer's keys and values after
the rotary turn, so that each generated token costs one position; a step writes every layer, then advances
the length. Details: docs/llm.md, 'Generation'.
"""

from __future__ import annotations

import torch

from comera.checks import check_int

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the positions a model has seen, per layer (make one with :meth:`LlamaLM.new_cache
    <comera.workloads.llm.model.LlamaLM.new_cache>`): :attr:`keys` and :attr:`values` hold one ``(B, H,
    max_length, head_dim)`` tensor per layer, of which positions ``[0, length)`` are filled.

    Args:
        n_layers: decoder blocks (one key and one value buffer each).
        batch_size: sequences decoded together (``B``).
        n_heads: attention heads (``H``).
        head_dim: features per head.
        max_length: the most positions the cache holds.
        device: where the buffers live.
        dtype: the buffers' dtype (the model's).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        max_length: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for value, name in (
            (n_layers, "n_layers"),
            (batch_size, "batch_size"),
            (n_heads, "n_heads"),
            (head_dim, "head_dim"),
            (max_length, "max_length"),
        ):
            check_int(value, name, 1)
        shape = (batch_size, n_heads, max_length, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.batch_size = batch_size
        self.max_length = max_length
        self.length = 0

    def check_room(self, batch_size: int, new_positions: int) -> None:
        """``ValueError`` unless ``new_positions`` more positions of ``batch_size`` sequences fit."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"input_ids has {batch_size} sequences but the cache was made for {self.batch_size}"
            )
        if self.length + new_positions > self.max_length:
            raise ValueError(
                f"the cache holds {self.length} of at most {self.max_length} positions: "
                f"{new_positions} more do not fit"
            )

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' ``keys``/``values`` ``(B, H, T, head_dim)`` of ``layer`` after the
        :attr:`length` filled ones; returns that layer's keys and values of all ``length + T`` positions,
        each ``(B, H, length + T, head_dim)`` (views of the buffers)."""
        end = self.length + keys.shape[2]
        self.keys[layer][:, :, self.length : end] = keys
        self.values[layer][:, :, self.length : end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def causal_mask(self, new_positions: int) -> torch.Tensor | None:
        """Which keys the ``new_positions`` positions after the :attr:`length` filled ones may see: a boolean
        ``(new_positions, length + new_positions)`` mask (row ``i`` sees keys ``<= length + i``), or None for
        one new position (it sees every key)."""
        if new_positions == 1:
            return None
        device = self.keys[0].device
        shape = (new_positions, self.length + new_positions)
        return torch.ones(shape, dtype=torch.bool, device=device).tril(diagonal=self.length)

    def advance(self, new_positions: int) -> None:
        """Count ``new_positions`` more positions as filled (after every layer stored them)."""
        self.check_room(self.batch_size, new_positions)
        self.length += new_positions
