"""The DLRM workload's presets: the recipe presets (``comera train dlrm --preset NAME``) and the
tensorization presets they name (``dlrm-paper``, ``dlrm-small``, ``dlrm-smoke``), registered with
:func:`comera.tensorize_config.register_preset` on import; :func:`dlrm_tensorize_config` builds one for
other table sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from comera.tensorize_config import TensorizeConfig, register_preset
from comera.tt.shapes import factorize
from comera.workloads.dlrm.model import MODEL_PRESETS, dlrm_preset

__all__ = ["RECIPE_PRESETS", "TENSORIZE_PRESETS", "dlrm_tensorize_config"]

# Tensorization per model preset: tables with more than ``min_rows`` rows become TTM bags of ``order`` cores
# at max rank ``rank``. The paper's embedding tables use order 4 and rank 32 (paper-notes section 10.3); the
# small preset uses rank 24: its capped 200k-row tables compress about 60x at the start, 80x after the late
# stage (target ratio 0.8), with normalized entropy within 1% of dense on the synthetic data.
_TABLE_SETTINGS: dict[str, dict[str, int]] = {
    "paper": {"min_rows": 100_000, "rank": 32, "order": 4},
    "small": {"min_rows": 100_000, "rank": 24, "order": 4},
    "smoke": {"min_rows": 500, "rank": 4, "order": 3},
}


def dlrm_tensorize_config(
    cardinalities: Sequence[int], embedding_dim: int, *, min_rows: int, rank: int, order: int = 4
) -> TensorizeConfig:
    """TTM bags for the tables (``tables.I``) of more than ``min_rows`` rows, columns folded into ``order``
    balanced modes and rows left to :class:`comera.TTMEmbeddingBag`; everything else stays dense.

    Raises:
        ValueError: no table has more than ``min_rows`` rows.
    """
    large = [index for index, rows in enumerate(cardinalities) if rows > min_rows]
    if not large:
        raise ValueError(
            f"min_rows must be below the largest table ({max(cardinalities)} rows) so that some table is "
            f"tensorized, got {min_rows}"
        )
    names = tuple(f"tables.{index}" for index in large)
    col_shape = tuple(reversed(factorize(embedding_dim, order)))
    shapes = {r"tables\.\d+": {"col_shape": col_shape}}
    return TensorizeConfig(target_modules=names, embeddings=names, rank=rank, shape_pattern=shapes)


TENSORIZE_PRESETS: dict[str, TensorizeConfig] = {
    f"dlrm-{name}": dlrm_tensorize_config(
        model["cardinalities"], model["bottom_mlp"][-1], **_TABLE_SETTINGS[name]
    )
    for name, model in MODEL_PRESETS.items()
}
"""Tensorization preset name -> config, for the model presets' tables and bottom MLP widths."""
for _name, _config in TENSORIZE_PRESETS.items():
    register_preset(_name, _config)


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


RECIPE_PRESETS: dict[str, dict[str, Any]] = {
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
