"""The sentence-pair workload (``comera train nli``): the six-encoder transformer on MNLI or the embedded
task.

Data: ``--data`` a GLUE MNLI folder, a folder of ``.jsonl`` files or one ``.jsonl`` file
(:func:`comera.data.nli.build_nli_data`); without it, the embedded docstring-code task built from the
standard library (:mod:`comera.data.pairs`). Model: :class:`comera.models.transformer.TransformerClassifier`
at the preset's sizes, its vocabulary and classes taken from the data. Tensorization: ``nli-PRESET``.
Metrics: accuracy and mean cross-entropy over every pair of a split.

Presets:

- ``paper``: the paper's model and training (batch 32, 20 early and 10 late epochs, AdamW at 1e-4 for
  cores, 1e-3 for gates, 5e-5 for the rest, target ratio 0.2; method.md section 8);
- ``small``: a width-128, 2-block model on the embedded task (about 9,000 training pairs of at most 64
  tokens, half the negatives from the docstring's own module), minutes on a laptop CPU; the model embeds
  each token's exact-match flag (``model.exact_match``), without which a model this small, trained from
  scratch on so few pairs, stays at chance (docs/results.md);
- ``smoke``: a tiny model and task for tests (exact-match flags on, so the tests cover them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera.data.nli import build_nli_data
from comera.models.transformer import MODEL_PRESETS, TransformerClassifier
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator

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


def _sizes(preset: str, exact_match: bool = False) -> dict[str, Any]:
    """The model section of a preset: the model preset's sizes except those the data decides, and whether
    the model embeds the exact-match flags (on for the embedded task's presets, see docs/results.md)."""
    defaults = {"d_model": 768, "n_layers": 6, "n_heads": 12, "d_ff": 3072, "max_positions": 512}
    sizes = {**defaults, **MODEL_PRESETS[preset]}
    return {
        **{key: sizes[key] for key in ("d_model", "n_layers", "n_heads", "d_ff", "max_positions")},
        "dropout": 0.1,
        "layer_norm_eps": 1e-12,
        "exact_match": exact_match,
    }


@register_recipe
class NLIRecipe(Recipe):
    """Sentence-pair classification with :class:`TransformerClassifier` (see the module docstring)."""

    name = "nli"
    description = "six-encoder transformer on sentence pairs (MNLI, or the embedded docstring-code task)"
    primary_metric = "accuracy"
    presets = {
        "paper": {
            "model": _sizes("paper"),
            "data": {"max_length": 128, "tokenizer": None, "vocab_size": None, "skip_malformed": False},
            "train": {
                "batch_size": 32,
                "unit": "epoch",
                "early": 20,
                "late": 10,
                "lr_other": 5e-5,
                "log_every": 100,
            },
            "tensorize": {"preset": "nli-paper"},
            "method": {
                "comera": {
                    "method": {
                        "gamma": 0.01,
                        "tau": 1e-2,
                        "target_ratio": 0.2,
                        "target_loss": 0.8,
                        "lr_cores": 1e-4,
                        "lr_gates": 1e-3,
                    }
                },
                "dense": {"train": {"lr_other": 1e-4}},
            },
        },
        "small": {
            "model": _sizes("small", exact_match=True),
            "data": {
                "max_length": 64,
                "tokenizer": None,
                "vocab_size": 2048,
                "skip_malformed": False,
                "train_pairs": 9000,
                "validation_pairs": 2000,
                "same_module_negatives": 0.5,
            },
            "train": {
                "batch_size": 32,
                "unit": "epoch",
                "early": 4,
                "late": 2,
                "lr_other": 5e-4,
                "log_every": 20,
            },
            "tensorize": {"preset": "nli-small"},
            "method": {
                "comera": {
                    "method": {
                        "gamma": 0.01,
                        "target_ratio": 0.5,
                        "recovery": 0.6,
                        "lr_cores": 1e-3,
                        "lr_gates": 1e-3,
                    }
                },
                "dense": {"train": {"lr_other": 5e-4}},
            },
        },
        "smoke": {
            "model": _sizes("smoke", exact_match=True),
            "data": {
                "max_length": 32,
                "tokenizer": None,
                "vocab_size": 300,
                "skip_malformed": False,
                "train_pairs": 48,
                "validation_pairs": 16,
            },
            "train": {
                "batch_size": 8,
                "unit": "step",
                "early": 4,
                "late": 2,
                "lr_other": 1e-3,
                "log_every": 1,
                "plot": False,
            },
            "tensorize": {"preset": "nli-smoke"},
            "method": {"comera": {"method": {"lr_cores": 1e-3, "lr_gates": 1e-2}}},
        },
    }

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
