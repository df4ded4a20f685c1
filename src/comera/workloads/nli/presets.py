"""The sentence-pair workload's presets: the recipe presets (``comera train nli --preset NAME``) and the
tensorization presets they name (``nli-paper``, ``nli-small``, ``nli-smoke``), registered with
:func:`comera.tensorize_config.register_preset` on import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from comera.tensorize_config import TensorizeConfig, fold_modes, register_preset
from comera.workloads.nli.model import MODEL_PRESETS

__all__ = ["RECIPE_PRESETS", "TENSORIZE_PRESETS"]

_TARGETS = ("query", "key", "value", "output", "ffn_in", "ffn_out", "pooler")


def _tensorize_config(
    *,
    linear_rank: int,
    embedding_rank: int,
    attention: tuple[tuple[int, ...], tuple[int, ...]],
    ffn: tuple[tuple[int, ...], tuple[int, ...]],
    col_shape: tuple[int, ...],
    row_shape: tuple[int, ...] | None = None,
) -> TensorizeConfig:
    """TT for every projection (``ffn_out`` takes the transpose of ``ffn``'s shapes), TTM for the word table;
    ``attention``/``ffn`` are ``(in_shape, out_shape)``, ``row_shape`` None lets the vocabulary fold
    itself.
    """
    table = (
        {"col_shape": col_shape} if row_shape is None else {"row_shape": row_shape, "col_shape": col_shape}
    )
    return TensorizeConfig(
        target_modules=_TARGETS,
        embeddings=("embeddings.word",),
        format="tt",
        rank=linear_rank,
        rank_pattern={r"embeddings\.word": embedding_rank},
        shape_pattern={
            r"embeddings\.word": table,
            "query|key|value|output|pooler": {"in_shape": attention[0], "out_shape": attention[1]},
            "ffn_in": {"in_shape": ffn[0], "out_shape": ffn[1]},
            "ffn_out": {"in_shape": tuple(reversed(ffn[1])), "out_shape": tuple(reversed(ffn[0]))},
        },
    )


TENSORIZE_PRESETS: dict[str, TensorizeConfig] = {
    # The reference code's settings (paper-notes.md section 2.6): linears rank 30, word table rank 32.
    "nli-paper": _tensorize_config(
        linear_rank=30,
        embedding_rank=32,
        attention=((12, 8, 8), (8, 8, 12)),
        ffn=((12, 8, 8), (12, 16, 16)),
        row_shape=(16, 20, 10, 10),
        col_shape=(4, 4, 8, 6),
    ),
    # The ``small`` model (width 128, FFN 512); the word table's rows fold from the data's vocabulary size.
    "nli-small": _tensorize_config(
        linear_rank=8,
        embedding_rank=16,
        attention=((4, 4, 8), (8, 4, 4)),
        ffn=((4, 4, 8), (8, 8, 8)),
        col_shape=(2, 4, 4, 4),
    ),
    # The ``smoke`` model (width 16, FFN 32).
    "nli-smoke": _tensorize_config(
        linear_rank=4,
        embedding_rank=4,
        attention=((4, 4), (4, 4)),
        ffn=((4, 4), (4, 8)),
        col_shape=(4, 4),
    ),
}

_RANKS = {"nli-paper": (30, 32), "nli-small": (8, 16), "nli-smoke": (4, 4)}
"""Each preset's linear and word-table rank."""


def _fit_nli(name: str) -> Callable[[TensorizeConfig, Mapping[str, Any]], TensorizeConfig]:
    """The ``fit`` of preset ``name``: its layout with the foldings of the model section's ``d_model`` and
    ``d_ff`` when they differ from the preset's, as many modes as the preset's (the word table's columns
    take the width in as many modes as before, its rows fold from the vocabulary); a size with too few prime
    factors is refused, naming it."""
    patterns = TENSORIZE_PRESETS[name].shape_pattern
    width_modes, ffn_modes = patterns["ffn_in"]["in_shape"], patterns["ffn_in"]["out_shape"]
    table_modes = patterns[r"embeddings\.word"]["col_shape"]

    def fit(config: TensorizeConfig, model: Mapping[str, Any]) -> TensorizeConfig:
        width = model.get("d_model", math.prod(width_modes))
        ffn = model.get("d_ff", math.prod(ffn_modes))
        if (width, ffn) == (math.prod(width_modes), math.prod(ffn_modes)):
            return config
        modes = fold_modes(width, len(width_modes), "model.d_model")
        linear_rank, embedding_rank = _RANKS[name]
        return _tensorize_config(
            linear_rank=linear_rank,
            embedding_rank=embedding_rank,
            attention=(modes, tuple(reversed(modes))),
            ffn=(modes, fold_modes(ffn, len(ffn_modes), "model.d_ff")),
            col_shape=fold_modes(width, len(table_modes), "model.d_model"),
        )

    return fit


for _name, _config in TENSORIZE_PRESETS.items():
    register_preset(_name, _config, fit=_fit_nli(_name))


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


RECIPE_PRESETS: dict[str, dict[str, Any]] = {
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
