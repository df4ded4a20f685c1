"""Workload 3: CodeBERT-style masked-LM pre-training on code (``comera train mlm``).

Data: :func:`comera.data.code.build_code_data` (``--data`` a CodeSearchNet-style ``*.jsonl(.gz)`` file or a
folder of sources; by default the running Python's standard library), packed into blocks of ``seq_len``
tokens and masked dynamically by the collate function; validation blocks are masked the same way at every
evaluation. Model: the RoBERTa masked LM of :mod:`comera.models.mlm` with the tokenizer's vocabulary and
``seq_len`` positions; ``comera`` tensorizes it by the ``mlm-PRESET`` preset (TT linears, TTM word embedding,
tied TTM head). Training runs the paper's two phases: the early stage, then the late stage driving the size
to ``target_ratio`` of its early-stage end.

Loss: mean cross-entropy over the masked tokens of a batch; the LM head scores only those tokens.
Metrics (exact over a split, summed over tokens):
``mlm_loss`` (mean masked-token cross-entropy), ``mlm_accuracy`` (share of masked tokens predicted right),
``perplexity`` = ``exp(mlm_loss)``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from comera.data.code import build_code_data, default_source_dir
from comera.models.mlm import build_mlm_model
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator

__all__ = ["MLMRecipe", "MaskedLMEvaluator", "masked_lm_scores"]

_IGNORE = -100


def _data_settings(vocab_size: int, seq_len: int, **changes: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "tokenizer_file": None,
        "extensions": [".py"],
        "validation_fraction": 0.05,
        "max_files": None,
        "max_bytes": None,
        "skip_bad_lines": False,
        "tail": "pad",
        "mask_probability": 0.15,
        "seed": 0,
    }
    settings.update(changes)
    return settings


def masked_lm_scores(model: nn.Module, batch: dict[str, torch.Tensor]):
    """The masked positions' logits ``(N, V)``, their targets ``(N,)`` and their mean cross-entropy (0 when
    ``N == 0``) on ``batch`` (moved to the model's device); the LM head runs on those ``N`` positions only
    (:class:`comera.models.hf_mlm.CodeMaskedLM`, ``masked_only=True``)."""
    device = next(model.parameters()).device
    labels = batch["labels"].to(device)
    output = model(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        labels=labels,
        masked_only=True,
    )
    return output.logits, labels[labels != _IGNORE], output.loss


class MaskedLMEvaluator(Evaluator):
    """Exact masked-token metrics over a split: summed cross-entropy, correct predictions and masked count."""

    def reset(self) -> None:
        self.loss_sum, self.correct, self.count = 0.0, 0, 0

    def update(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
        logits, targets, _ = masked_lm_scores(model, batch)
        picked = logits.double()
        self.loss_sum += float(functional.cross_entropy(picked, targets, reduction="sum"))
        self.correct += int((picked.argmax(dim=-1) == targets).sum())
        self.count += len(targets)

    def state(self) -> tuple[float, int, int]:
        return self.loss_sum, self.correct, self.count

    def merge(self, states: list[tuple[float, int, int]]) -> None:
        self.loss_sum = sum(state[0] for state in states)
        self.correct = sum(state[1] for state in states)
        self.count = sum(state[2] for state in states)

    def compute(self) -> dict[str, float]:
        """``mlm_loss``, ``mlm_accuracy``, ``perplexity`` (NaN when no token was masked)."""
        if self.count == 0:
            return {"mlm_loss": math.nan, "mlm_accuracy": math.nan, "perplexity": math.nan}
        loss = self.loss_sum / self.count
        return {"mlm_loss": loss, "mlm_accuracy": self.correct / self.count, "perplexity": math.exp(loss)}


_LTE_OFF_THE_HEAD = {"lte": {"tensorize": {"exclude_modules": ["lm_head.dense"]}}}
"""LTE splits a batch across its heads along the first dimension. The LM head's transform runs on the masked
positions of every sequence gathered into rows, which do not follow the heads' split of the sequences, so
under LTE it stays a plain linear trained with AdamW."""


@register_recipe
class MLMRecipe(Recipe):
    """Masked-LM pre-training of a RoBERTa model on code (module docstring)."""

    name = "mlm"
    description = "CodeBERT-style masked-LM pre-training of a RoBERTa model on code"
    primary_metric = "mlm_loss"
    presets = {
        "paper": {
            "model": {"preset": "paper", "dropout": 0.1},
            "data": _data_settings(50265, 512),
            "train": {
                "unit": "step",
                "early": 20000,
                "late": 10000,
                "batch_size": 32,
                "eval_every": 2000,
                "checkpoint_every": 2000,
                "log_every": 50,
            },
            "tensorize": {"preset": "mlm-paper"},
            "method": {**_LTE_OFF_THE_HEAD, "comera": {"method": {"target_ratio": 0.5}}},
        },
        "small": {
            "model": {"preset": "small", "dropout": 0.1},
            "data": _data_settings(8192, 128, max_bytes=4_000_000),
            "train": {
                "unit": "step",
                "early": 300,
                "late": 100,
                "batch_size": 8,
                "lr_other": 5e-4,
                "eval_every": 50,
                "log_every": 10,
            },
            "tensorize": {"preset": "mlm-small"},
            "method": {
                **_LTE_OFF_THE_HEAD,
                "comera": {"method": {"target_ratio": 0.5, "lr_cores": 1e-3, "lr_gates": 1e-3}},
            },
        },
        "smoke": {
            "model": {"preset": "smoke", "dropout": 0.1},
            "data": _data_settings(300, 32, max_bytes=400_000, validation_fraction=0.3),
            "train": {
                "unit": "step",
                "early": 4,
                "late": 2,
                "batch_size": 8,
                "lr_other": 1e-3,
                "log_every": 1,
                "eval_every": 3,
            },
            "tensorize": {"preset": "mlm-smoke"},
            "method": {**_LTE_OFF_THE_HEAD, "comera": {"method": {"lr_cores": 1e-3, "lr_gates": 1e-3}}},
        },
    }

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        """Read, split, tokenize, pack; ``info`` holds per-split counts, the vocabulary and the tokenizer."""
        code = build_code_data(data_path, cache_dir=cache_dir, **settings)
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

    def build_model(self, settings: dict[str, Any], data: RecipeData) -> nn.Module:
        """The dense masked LM of the ``model`` section's preset, sized by the data's vocabulary and
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
        )

    def loss_fn(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy over the batch's masked tokens (0 when none is masked)."""
        return masked_lm_scores(model, batch)[2]

    def evaluator(self, settings: dict[str, Any]) -> Evaluator:
        """A fresh :class:`MaskedLMEvaluator`."""
        return MaskedLMEvaluator()
