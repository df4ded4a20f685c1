"""The sentence-pair workload (``comera train nli``): the six-encoder transformer on MNLI or the embedded
docstring-code task, with accuracy and mean cross-entropy over every pair of a split, at the ``paper``,
``small`` and ``smoke`` presets. Details: docs/recipes.md, 'Workloads (recipes)'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator
from comera.workloads.nli.data import build_nli_data
from comera.workloads.nli.model import TransformerClassifier
from comera.workloads.nli.presets import RECIPE_PRESETS

__all__ = ["NLIRecipe", "PairAccuracy"]


def _batch_to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch.get("exact_match_ids")
    )


class PairAccuracy(Evaluator):
    """Accuracy and mean cross-entropy over every pair of a split (sums over batches, divided once)."""

    def reset(self) -> None:
        self.correct, self.loss, self.count = 0, 0.0, 0

    def update(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        batch = _batch_to(batch, next(model.parameters()).device)
        logits = _logits(model, batch)
        labels = batch["labels"]
        self.correct += int((logits.argmax(dim=-1) == labels).sum())
        self.loss += float(F.cross_entropy(logits.float(), labels, reduction="sum"))
        self.count += len(labels)

    def state(self) -> tuple[int, float, int]:
        return self.correct, self.loss, self.count

    def merge(self, states: list[tuple[int, float, int]]) -> None:
        self.correct, self.loss, self.count = (sum(values) for values in zip(*states))

    def compute(self) -> dict[str, float]:
        if self.count == 0:
            return {"accuracy": float("nan"), "loss": float("nan")}
        return {"accuracy": self.correct / self.count, "loss": self.loss / self.count}


@register_recipe
class NLIRecipe(Recipe):
    """Sentence-pair classification with :class:`TransformerClassifier`."""

    name = "nli"
    description = "six-encoder transformer on sentence pairs (MNLI, or the embedded docstring-code task)"
    primary_metric = "accuracy"
    presets = RECIPE_PRESETS

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        data = build_nli_data(data_path, cache_dir, **settings)
        return RecipeData(train=data.train, evals=data.evals, collate_fn=data.collate_fn, info=data.info)

    def build_model(self, settings: dict[str, Any], data: RecipeData) -> nn.Module:
        longest = data.info["max_length"]
        if settings["max_positions"] < longest:
            raise ValueError(
                f"model.max_positions ({settings['max_positions']}) must be at least data.max_length "
                f"({longest})"
            )
        return TransformerClassifier(
            **settings,
            vocab_size=data.info["vocab_size"],
            num_classes=data.info["num_classes"],
            pad_token_id=data.info["pad_token_id"],
        )

    def loss_fn(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = _batch_to(batch, next(model.parameters()).device)
        return F.cross_entropy(_logits(model, batch), batch["labels"])

    def evaluator(self, settings: dict[str, Any]) -> Evaluator:
        return PairAccuracy()
