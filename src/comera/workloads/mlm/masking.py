"""Dynamic BERT masking of packed blocks in the collate function, each sample with its own seeded generator:
fixed masks for evaluation, masks that change with the batches drawn for training (the same on resume).
Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from comera.data.bpe import SpecialIds

__all__ = ["MaskingCollator", "mask_tokens"]

_IGNORE = -100


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    ids: SpecialIds,
    generator: torch.Generator,
    *,
    mask_probability: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of ``input_ids`` where ``maskable`` is True: each token chosen with ``mask_probability``,
    80% of those become ``<mask>``, 10% a random ordinary token, 10% stay.

    Args:
        input_ids: ``(*)`` int64 token ids.
        maskable: ``(*)`` bool, False at special and padding tokens.
        ids: the tokenizer's special ids; random replacements are drawn uniformly from the ordinary tokens.
        generator: the source of randomness.
        mask_probability: chance of choosing a maskable token, in ``(0, 1)``.

    Returns:
        ``(masked input ids, labels)``, both ``(*)`` int64; labels are -100 where nothing was chosen.
    """
    chosen = maskable & (torch.rand(input_ids.shape, generator=generator) < mask_probability)
    kind = torch.rand(input_ids.shape, generator=generator)
    random_tokens = ids.ordinary[torch.randint(len(ids.ordinary), input_ids.shape, generator=generator)]
    masked = torch.where(chosen & (kind < 0.8), ids.mask, input_ids)
    masked = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_tokens, masked)
    labels = torch.where(chosen, input_ids, _IGNORE)
    return masked, labels


def _seed(*parts: int) -> int:
    digest = hashlib.sha256(struct.pack(f">{len(parts)}q", *parts)).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass
class MaskingCollator:
    """``collate_fn`` turning a list of :class:`PackedBlocks` items into a masked-LM batch
    ``{"input_ids", "attention_mask", "labels"}``, each ``(B, seq_len)`` int64.

    Args:
        ids: the tokenizer's special ids.
        mask_probability: chance of choosing each maskable token, in ``(0, 1)``.
        seed: base seed of all masks.
        epoch: mixed into the seeds of training masks (:meth:`set_epoch`); evaluation masks ignore it.
    """

    ids: SpecialIds
    mask_probability: float = 0.15
    seed: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        probability = self.mask_probability
        if (
            isinstance(probability, bool)
            or not isinstance(probability, (int, float))
            or not 0 < probability < 1
        ):
            raise ValueError(f"mask_probability must be a float in (0, 1), got {probability!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def set_epoch(self, epoch: int) -> None:
        """Make the masks of training batches depend on ``epoch`` too."""
        self.epoch = int(epoch)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        input_ids = torch.stack([sample["input_ids"] for sample in samples])
        positions = torch.arange(input_ids.shape[1])
        attention_mask = (positions < torch.tensor([sample["length"] for sample in samples])[:, None]).long()
        maskable = attention_mask.bool() & ~torch.isin(input_ids, torch.tensor(self.ids.all))
        indices = [int(sample["index"]) for sample in samples]
        batch_seed = _seed(self.seed, self.epoch, *indices)
        masked, labels = [], []
        for row, sample in enumerate(samples):
            seed = (
                _seed(self.seed, indices[row]) if sample["fixed_masking"] else _seed(batch_seed, indices[row])
            )
            generator = torch.Generator().manual_seed(seed)
            row_ids, row_labels = mask_tokens(
                input_ids[row], maskable[row], self.ids, generator, mask_probability=self.mask_probability
            )
            masked.append(row_ids)
            labels.append(row_labels)
        return {
            "input_ids": torch.stack(masked),
            "attention_mask": attention_mask,
            "labels": torch.stack(labels),
        }
