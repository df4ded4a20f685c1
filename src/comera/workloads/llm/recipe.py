"""Workload 4: LLaMA-style causal language-model pre-training (``comera train llm``): blocks read from token
shards, the :class:`~comera.workloads.llm.model.LlamaLM` of the preset, the peers' cosine schedule, and
``loss``, ``perplexity`` and ``accuracy`` exact over a split. Details: docs/llm.md, 'The recipe: comera
train llm'.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera.data.sources import default_source_dir
from comera.data.token_shards import is_prepared
from comera.measure import weights_optimizer_mib
from comera.modules import unwrap_model
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator, TokenScores, perplexity
from comera.workloads.llm.model import IGNORE_INDEX, MODEL_PRESETS, LlamaLM, LMConfig, next_token_loss
from comera.workloads.llm.prepared import (
    build_embedded_lm_data,
    build_prepared_lm_data,
    build_raw_lm_data,
)
from comera.workloads.llm.presets import RECIPE_PRESETS

__all__ = ["LLMRecipe", "MODEL_SIZES", "NextTokenEvaluator", "TOKENIZER_FILE"]

TOKENIZER_FILE = "tokenizer.json"
"""The tokenizer's name in the run's ``model/`` folder."""


MODEL_SIZES = ("hidden_size", "n_layers", "n_heads", "intermediate_size")
"""The model sizes a run sets in its ``model`` section (``--set model.hidden_size=96``)."""


def _sizes(settings: dict[str, Any]) -> dict[str, Any]:
    """The :class:`LMConfig` fields of the ``model`` section: its preset's, with the section's sizes."""
    preset = MODEL_PRESETS.get(settings.get("preset"), {})
    return {**preset, **{key: settings[key] for key in MODEL_SIZES if key in settings}}


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _pad_id(model: nn.Module) -> int | None:
    return unwrap_model(model).config.pad_token_id


class NextTokenEvaluator(TokenScores):
    """Exact next-token metrics over a split: summed cross entropy (float64), right argmax predictions and
    the number of predicted tokens (``<pad>`` and ``-100`` targets left out)."""

    def update(self, model: nn.Module, batch: torch.Tensor) -> None:
        ids = batch.to(_model_device(model))
        logits = model(ids)[:, :-1].flatten(0, 1)
        targets = ids[:, 1:].flatten()
        pad = _pad_id(model)
        if pad is not None:
            targets = targets.masked_fill(targets == pad, IGNORE_INDEX)
        kept = targets != IGNORE_INDEX
        self.add(logits[kept], targets[kept])

    def compute(self) -> dict[str, float]:
        """``loss``, ``perplexity``, ``accuracy`` and ``tokens`` (NaN metrics when no token was predicted)."""
        loss, accuracy = self.mean_scores()
        return {"loss": loss, "perplexity": perplexity(loss), "accuracy": accuracy, "tokens": self.count}


@register_recipe
class LLMRecipe(Recipe):
    """LLaMA-style causal language-model pre-training."""

    name = "llm"
    description = "LLaMA-style causal language-model pre-training (GaLore/APOLLO/CoLA's protocol)"
    primary_metric = "perplexity"
    comparison_axes = ("tokens", "time")
    presets = RECIPE_PRESETS

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        """The blocks of the run's corpus, read through memory-mapped token shards;
        ``info`` holds per-split counts, the vocabulary, the tokenizer, the validation size in tokens and the
        special ids. A ``--data`` folder holding ``index.json`` (written by ``comera prepare llm``) is read
        as it is (:func:`~comera.workloads.llm.prepared.build_prepared_lm_data`); any other ``--data`` is
        prepared into the cache first (:func:`~comera.workloads.llm.prepared.build_raw_lm_data`)."""
        if is_prepared(data_path):
            lm = build_prepared_lm_data(data_path, cache_dir=cache_dir, **settings)
        elif data_path is None:
            lm = build_embedded_lm_data(cache_dir=cache_dir, **settings)
        else:
            lm = build_raw_lm_data(data_path, cache_dir=cache_dir, **settings)
        info = dict(lm.info)
        splits = {name: info.pop(name) for name in ("train", "validation")}
        info.update(
            splits=splits,
            source=str(data_path if data_path is not None else default_source_dir()),
            seq_len=settings["seq_len"],
            special_ids={"pad": lm.ids.pad, "eos": lm.ids.eos},
        )
        return RecipeData(train=lm.train, evals={"validation": lm.validation}, info=info)

    def check_model_settings(self, settings: dict[str, Any]) -> None:
        """The ``model`` section's sizes make an :class:`LMConfig` (``ValueError`` naming the size)."""
        LMConfig(**_sizes(settings))

    def build_model(self, settings: dict[str, Any], data: RecipeData) -> nn.Module:
        """The dense :class:`LlamaLM` of the ``model`` section's preset and sizes with the data's vocabulary,
        ``seq_len`` positions and padding id."""
        return LlamaLM.from_preset(
            settings["preset"],
            vocab_size=data.info["vocab_size"],
            max_seq_len=data.info["seq_len"],
            pad_token_id=data.info["special_ids"]["pad"],
            tie_embeddings=settings["tie_embeddings"],
            **{key: settings[key] for key in MODEL_SIZES if key in settings},
        )

    def loss_fn(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of the ``(B, T)`` blocks (``<pad>`` targets skipped)."""
        ids = batch.to(_model_device(model))
        return next_token_loss(model(ids), ids, _pad_id(model))

    def evaluator(self, settings: dict[str, Any]) -> Evaluator:
        """A fresh :class:`NextTokenEvaluator`."""
        return NextTokenEvaluator()

    def extra_results(self, results: dict[str, Any], data: RecipeData, trainer: Any) -> dict[str, Any]:
        """``loss``, ``perplexity``, ``validation_tokens``, ``tokens_seen``, ``tokens_per_s``,
        ``weights_optimizer_mib``."""
        validation = results["evaluation"].get("validation", {})
        block_tokens = trainer.config.batch_size * trainer.world_size * data.info["seq_len"]
        step_time = results["step_time_s"]
        return {
            "loss": validation.get("loss", math.nan),
            "perplexity": validation.get("perplexity", math.nan),
            "validation_tokens": data.info["validation_tokens"],
            "tokens_seen": results["steps"] * block_tokens,
            "tokens_per_s": block_tokens / step_time if step_time > 0 else math.nan,
            "weights_optimizer_mib": weights_optimizer_mib(trainer.module, trainer.optimizer),
        }

    def save_model_files(self, folder: Path, data: RecipeData) -> None:
        """Copy the tokenizer to ``folder / "tokenizer.json"`` (what ``comera generate`` reads)."""
        shutil.copyfile(data.info["tokenizer"], folder / TOKENIZER_FILE)
