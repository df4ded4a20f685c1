"""The DLRM workload: click-through prediction on Criteo-format data (``comera train dlrm``).

Data: with ``--data PATH``, a Criteo Kaggle ``train.txt`` or Terabyte day file
(:func:`comera.data.criteo.load_criteo`: id maps or hashing, a memmap cache under the cache folder); without
it, the synthetic click log of :func:`comera.data.synthetic_criteo.synthetic_criteo` (Criteo's schema,
power-law ids, a planted click model), also kept in the cache folder. Both are split by line order as the
DLRM reference does: the first 6/7 train, the last 1/7 halved into test and validation. Model:
:class:`comera.models.dlrm.DLRM` with the table sizes the data gives; ``comera`` turns the large tables into
TTM bags by the ``dlrm-PRESET`` tensorization preset. The low-rank baselines (``galore``, ``apollo``,
``lte``, ``cola``) act on the linears of the bottom and top MLPs (``tensorize.target_modules="all-linear"``),
the tables staying dense.
Evaluation: accuracy, ROC AUC, log loss and normalized entropy, exact over each whole split
(:class:`comera.metrics.BinaryMetrics`).

Presets, each one pass over its training split (early stage ~70% of the steps, late stage the rest):
``paper`` (the full Kaggle table sizes and row count, batch 10,000), ``small`` (tables capped at 200,000
rows, 600,000 samples, batch 2048: a CPU demo of a few minutes), ``smoke`` (tiny, for tests).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from comera.data.clicks import ClickBatch, ClickData, collate_clicks
from comera.data.criteo import load_criteo
from comera.data.synthetic_criteo import synthetic_criteo
from comera.metrics import BinaryMetrics
from comera.models.dlrm import DLRM, dlrm_preset
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator

__all__ = ["ClickEvaluator", "DLRMRecipe"]

_METRICS = ("auc", "ne", "log_loss", "accuracy")


def _model_settings(preset: str) -> dict[str, list[int]]:
    sizes = dlrm_preset(preset)
    return {"bottom_mlp": list(sizes["bottom_mlp"]), "top_mlp": list(sizes["top_mlp"])}


def _data_settings(rows: int, max_table_rows: int | None) -> dict[str, Any]:
    return {
        "rows": rows,
        "max_table_rows": max_table_rows,
        "seed": 0,
        "min_frequency": 1,
        "hash_size": None,
        "skip_malformed": False,
    }


# One pass over the training split, as the DLRM reference trains on Criteo: a second epoch overfits the
# tables (on the synthetic data, dense NE 0.88 after one epoch, 1.19 after two). The stage lengths count
# steps: early ~70% and late ~30% of the preset's one epoch.
_TRAIN_COMMON = {"unit": "step", "lr_other": 1e-3, "compile": False}
_COMERA_RATES = {"lr_cores": 1e-3, "lr_gates": 1e-3}
_BASELINES_ON_THE_MLPS = {
    method: {"tensorize": {"target_modules": "all-linear"}} for method in ("galore", "apollo", "lte", "cola")
}
"""The low-rank baselines act on linears; comera's tensorization of DLRM targets its tables only, so the
baselines target every linear of the bottom and top MLPs instead (the tables stay dense and train with
AdamW)."""


class ClickEvaluator(Evaluator):
    """``auc``, ``ne``, ``log_loss`` and ``accuracy`` of a click model over every sample of a split."""

    def __init__(self) -> None:
        self.metrics = BinaryMetrics()

    def reset(self) -> None:
        self.metrics.reset()

    def update(self, model: nn.Module, batch: ClickBatch) -> None:
        batch = _to_model(model, batch)
        self.metrics.update(model(batch.dense, batch.ids), batch.labels)

    def state(self) -> dict[str, Any]:
        return self.metrics.state()

    def merge(self, states: list[dict[str, Any]]) -> None:
        self.metrics.reset()
        self.metrics.merge(states)

    def compute(self) -> dict[str, float]:
        values = self.metrics.compute()
        return {name: values[name] for name in _METRICS}


def _to_model(model: nn.Module, batch: ClickBatch) -> ClickBatch:
    first = next(model.parameters(), None)
    return batch if first is None else batch.to(first.device)


def _split_info(splits: dict[str, ClickData]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "read": len(data),
            "skipped": 0,
            "click_rate": float(np.mean(data.labels)) if len(data) else 0.0,
        }
        for name, data in splits.items()
    }


@register_recipe
class DLRMRecipe(Recipe):
    """DLRM on Criteo-format click logs; see the module docstring."""

    name = "dlrm"
    description = "DLRM click-through prediction on Criteo data (synthetic without --data)"
    primary_metric = "ne"
    presets = {
        "paper": {
            "model": _model_settings("paper"),
            "data": _data_settings(45_840_617, None),
            "train": {**_TRAIN_COMMON, "early": 2800, "late": 1130, "batch_size": 10_000, "log_every": 50},
            "tensorize": {"preset": "dlrm-paper"},
            "method": {**_BASELINES_ON_THE_MLPS, "comera": {"method": _COMERA_RATES}},
        },
        "small": {
            "model": _model_settings("small"),
            "data": _data_settings(600_000, 200_000),
            "train": {
                **_TRAIN_COMMON,
                "early": 180,
                "late": 71,
                "batch_size": 2048,
                "log_every": 20,
                "eval_every": 30,
            },
            "tensorize": {"preset": "dlrm-small"},
            "method": {
                **_BASELINES_ON_THE_MLPS,
                "comera": {"method": {**_COMERA_RATES, "target_ratio": 0.8}},
            },
        },
        "smoke": {
            "model": _model_settings("smoke"),
            "data": _data_settings(2100, 1000),
            "train": {**_TRAIN_COMMON, "early": 5, "late": 3, "batch_size": 256, "log_every": 2},
            "tensorize": {"preset": "dlrm-smoke"},
            "method": {**_BASELINES_ON_THE_MLPS, "comera": {"method": _COMERA_RATES}},
        },
    }

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        """Synthetic data (``rows``, ``max_table_rows``, ``seed``) or the Criteo file ``data_path``
        (``min_frequency``, ``hash_size``, ``skip_malformed``), split by line order."""
        if data_path is None:
            log = synthetic_criteo(
                settings["rows"],
                seed=settings["seed"],
                max_table_rows=settings["max_table_rows"],
                cache_dir=cache_dir,
            )
            source = {"source": "synthetic", "rows": settings["rows"]}
        else:
            if not data_path.is_file():
                raise ValueError(f"--data {data_path}: expected a Criteo train.txt or day file, not a folder")
            log = load_criteo(
                data_path,
                cache_dir,
                min_frequency=settings["min_frequency"],
                hash_size=settings["hash_size"],
                skip_malformed=settings["skip_malformed"],
            )
            source = {"source": str(data_path), "lines_read": log.read, "lines_skipped": log.skipped}
        splits = log.splits()
        if len(splits["train"]) == 0 or len(splits["validation"]) == 0:
            raise ValueError(f"the data has {len(log.data)} samples: too few for train, validation and test")
        return RecipeData(
            train=splits["train"],
            evals={"validation": splits["validation"], "test": splits["test"]},
            collate_fn=collate_clicks,
            info={"splits": _split_info(splits), "cardinalities": list(log.cardinalities), **source},
        )

    def build_model(self, settings: dict[str, Any], data: RecipeData) -> nn.Module:
        """The dense DLRM with the data's table sizes and the preset's MLPs."""
        return DLRM(data.info["cardinalities"], settings["bottom_mlp"], settings["top_mlp"])

    def loss_fn(self, model: nn.Module, batch: ClickBatch) -> torch.Tensor:
        """Mean binary cross-entropy of the click logits."""
        batch = _to_model(model, batch)
        return functional.binary_cross_entropy_with_logits(model(batch.dense, batch.ids), batch.labels)

    def evaluator(self, settings: dict[str, Any]) -> Evaluator:
        """A fresh :class:`ClickEvaluator`."""
        return ClickEvaluator()
