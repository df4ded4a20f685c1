"""Workload 3: CodeBERT-style masked-LM pre-training on code (``comera train mlm``): blocks read from token
shards and masked dynamically, the RoBERTa masked LM of the preset, and ``mlm_loss``, ``mlm_accuracy`` and
``perplexity`` exact over a split. Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.data.sources import default_source_dir
from comera.data.token_shards import is_prepared
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator, TokenScores, perplexity
from comera.workloads.mlm.model import SIZE_NAMES, build_mlm_model, model_sizes
from comera.workloads.mlm.prepared import (
    build_embedded_code_data,
    build_prepared_code_data,
    build_raw_code_data,
)
from comera.workloads.mlm.presets import RECIPE_PRESETS

__all__ = ["MLMRecipe", "MaskedLMEvaluator", "masked_lm_scores"]

_IGNORE = -100


def _sizes(settings: dict[str, Any]) -> dict[str, Any]:
    """The model sizes the ``model`` section names (:data:`comera.workloads.mlm.model.SIZE_NAMES`)."""
    return {name: settings[name] for name in SIZE_NAMES if name in settings}


def masked_lm_scores(model: nn.Module, batch: dict[str, torch.Tensor]):
    """The masked positions' logits ``(N, V)``, their targets ``(N,)`` and their mean cross-entropy (0 when
    ``N == 0``) on ``batch`` (moved to the model's device); the LM head runs on those ``N`` positions only
    (:class:`comera.workloads.mlm.hf_model.CodeMaskedLM`, ``masked_only=True``)."""
    device = next(model.parameters()).device
    labels = batch["labels"].to(device)
    output = model(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        labels=labels,
        masked_only=True,
    )
    return output.logits, labels[labels != _IGNORE], output.loss


class MaskedLMEvaluator(TokenScores):
    """Exact masked-token metrics over a split: summed cross-entropy, correct predictions and masked count."""

    def update(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        logits, targets, _ = masked_lm_scores(model, batch)
        self.add(logits, targets)

    def compute(self) -> dict[str, float]:
        """``mlm_loss``, ``mlm_accuracy``, ``perplexity`` (NaN when no token was masked)."""
        loss, accuracy = self.mean_scores()
        return {"mlm_loss": loss, "mlm_accuracy": accuracy, "perplexity": perplexity(loss)}


@register_recipe
class MLMRecipe(Recipe):
    """Masked-LM pre-training of a RoBERTa model on code."""

    name = "mlm"
    description = "CodeBERT-style masked-LM pre-training of a RoBERTa model on code"
    primary_metric = "mlm_loss"
    presets = RECIPE_PRESETS

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        """Read, split, tokenize, pack; ``info`` holds per-split counts, the vocabulary and the tokenizer. The
        embedded corpus is prepared into token shards in the cache and a ``--data`` folder holding
        ``index.json`` (``comera prepare mlm``) is read as it is, both through memory maps
        (:mod:`comera.workloads.mlm.prepared`); other ``--data`` is prepared into the cache first
        (:func:`~comera.workloads.mlm.prepared.build_raw_code_data`) and read the same way."""
        if is_prepared(data_path):
            code = build_prepared_code_data(data_path, cache_dir=cache_dir, **settings)
        elif data_path is None:
            code = build_embedded_code_data(cache_dir=cache_dir, **settings)
        else:
            code = build_raw_code_data(data_path, cache_dir=cache_dir, **settings)
        info = dict(code.info)
        splits = {name: info.pop(name) for name in ("train", "validation")}
        info.update(
            splits=splits,
            source=str(data_path if data_path is not None else default_source_dir()),
            seq_len=settings["seq_len"],
            special_ids={
                "bos": code.ids.bos,
                "pad": code.ids.pad,
                "eos": code.ids.eos,
                "mask": code.ids.mask,
            },
        )
        return RecipeData(
            train=code.train, evals={"validation": code.validation}, collate_fn=code.collator, info=info
        )

    def check_model_settings(self, settings: dict[str, Any]) -> None:
        """The ``model`` section's sizes (:func:`comera.workloads.mlm.model.model_sizes`)."""
        model_sizes(settings["preset"], **_sizes(settings))

    def build_model(self, settings: dict[str, Any], data: RecipeData) -> nn.Module:
        """The dense masked LM of the ``model`` section's preset and sizes, with the data's vocabulary and
        ``seq_len``."""
        ids = data.info["special_ids"]
        return build_mlm_model(
            settings["preset"],
            data.info["vocab_size"],
            max_length=data.info["seq_len"],
            dropout=settings["dropout"],
            bos_token_id=ids["bos"],
            pad_token_id=ids["pad"],
            eos_token_id=ids["eos"],
            **_sizes(settings),
        )

    def loss_fn(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the batch's masked tokens (0 when none is masked)."""
        return masked_lm_scores(model, batch)[2]

    def evaluator(self, settings: dict[str, Any]) -> Evaluator:
        """A fresh :class:`MaskedLMEvaluator`."""
        return MaskedLMEvaluator()
