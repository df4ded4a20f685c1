"""The DLRM workload (``comera train dlrm``): click-through prediction on a Criteo file or the synthetic click
log, split by line order, with accuracy, ROC AUC, log loss and normalized entropy exact over each split.
Details: docs/recipes.md, 'Workload data'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from comera.metrics import BinaryMetrics
from comera.recipes.base import Recipe, RecipeData, register_recipe
from comera.train.evaluation import Evaluator
from comera.workloads.dlrm.clicks import ClickBatch, ClickData, collate_clicks
from comera.workloads.dlrm.criteo import MIN_SAMPLES, check_criteo_options, load_criteo
from comera.workloads.dlrm.model import DLRM
from comera.workloads.dlrm.presets import RECIPE_PRESETS
from comera.workloads.dlrm.synthetic import synthetic_criteo

__all__ = ["ClickEvaluator", "DLRMRecipe"]

_METRICS = ("auc", "ne", "log_loss", "accuracy")


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


def _require_samples(samples: int, data_path: Path | None) -> None:
    """``ValueError`` naming the data (``--data`` file, or ``data.rows`` of the synthetic data) when it holds
    too few samples for the split by line order to give train, validation and test one each."""
    if samples >= MIN_SAMPLES:
        return
    where = f"--data {data_path}" if data_path is not None else f"the synthetic data (data.rows={samples})"
    raise ValueError(
        f"{where} has {samples} samples: too few for train, validation and test; the split by line order "
        f"needs at least {MIN_SAMPLES} (its last seventh is halved into test and validation)"
    )


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
    """DLRM on Criteo-format click logs."""

    name = "dlrm"
    description = "DLRM click-through prediction on Criteo data (synthetic without --data)"
    primary_metric = "ne"
    presets = RECIPE_PRESETS

    def build_data(self, settings: dict[str, Any], data_path: Path | None, cache_dir: Path) -> RecipeData:
        """Synthetic data (``rows``, ``max_table_rows``, ``seed``) or the Criteo file ``data_path``
        (``min_frequency``, ``hash_size``, ``skip_malformed``), split by line order. Every setting is checked
        whichever the source, so a bad one is named even where it would not be used."""
        check_criteo_options(settings["min_frequency"], settings["hash_size"])
        if data_path is None:
            rows = settings["rows"]
            if isinstance(rows, int) and not isinstance(rows, bool):  # the generator names a wrong type
                _require_samples(rows, None)  # before any row is generated or cached
            log = synthetic_criteo(
                settings["rows"],
                seed=settings["seed"],
                max_table_rows=settings["max_table_rows"],
                cache_dir=cache_dir,
            )
            source = {"source": "synthetic", "rows": settings["rows"]}
        else:
            if not data_path.is_file():
                kind = "a folder" if data_path.is_dir() else "not a regular file"
                raise ValueError(f"--data {data_path}: expected a Criteo train.txt or day file, got {kind}")
            log = load_criteo(
                data_path,
                cache_dir,
                min_frequency=settings["min_frequency"],
                hash_size=settings["hash_size"],
                skip_malformed=settings["skip_malformed"],
            )
            source = {"source": str(data_path), "lines_read": log.read, "lines_skipped": log.skipped}
        _require_samples(len(log.data), data_path)
        splits = log.splits()
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
