"""The masked-LM workload's presets: the recipe presets (``comera train mlm --preset NAME``) and the
tensorization presets they name (``mlm-paper``, ``mlm-small``, ``mlm-smoke``), registered with
:func:`comera.tensorize_config.register_preset` on import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from comera.tensorize_config import TensorizeConfig, fold_modes, register_preset

__all__ = ["RECIPE_PRESETS", "TENSORIZE_PRESETS"]

# Module-name patterns of the linears of a RoBERTa masked LM, by the role that fixes their folding.
_SQUARE = r"attention\.self\.(query|key|value)|attention\.output\.dense|lm_head\.dense"
_EXPAND = r"intermediate\.dense"
_CONTRACT = r"layer\.\d+\.output\.dense"


def _tensorize_config(
    hidden_modes: tuple[int, ...], ffn_modes: tuple[int, ...], rank: int, embedding_rank: int
) -> TensorizeConfig:
    """All linears TT with the given foldings (input modes of width ``hidden_modes``, of FFN ``ffn_modes``),
    the word embedding TTM (shapes chosen automatically, as the vocabulary varies), the decoder tied to it."""
    reverse = tuple(reversed(hidden_modes))
    return TensorizeConfig(
        target_modules="all-linear",
        embeddings=["word_embeddings"],
        format="tt",
        rank=rank,
        rank_pattern={"word_embeddings": embedding_rank},
        shape_pattern={
            _SQUARE: {"in_shape": hidden_modes, "out_shape": reverse},
            _EXPAND: {"in_shape": hidden_modes, "out_shape": ffn_modes},
            _CONTRACT: {"in_shape": tuple(reversed(ffn_modes)), "out_shape": reverse},
        },
        init="random",
        tie_output_head=True,
    )


_RANKS = {"mlm-paper": (128, 128), "mlm-small": (32, 32), "mlm-smoke": (4, 4)}
"""Each preset's linear and embedding rank."""

TENSORIZE_PRESETS: dict[str, TensorizeConfig] = {
    "mlm-paper": _tensorize_config((12, 8, 8), (12, 16, 16), *_RANKS["mlm-paper"]),
    "mlm-small": _tensorize_config((4, 8, 8), (8, 8, 16), *_RANKS["mlm-small"]),
    "mlm-smoke": _tensorize_config((4, 8), (8, 8), *_RANKS["mlm-smoke"]),
}


def _fit_mlm(name: str) -> Callable[[TensorizeConfig, Mapping[str, Any]], TensorizeConfig]:
    """The ``fit`` of preset ``name``: the same layout with the foldings of the model section's
    ``hidden_size`` and ``intermediate_size`` when they differ from the preset's
    (:func:`comera.tt.shapes.factorize`, as many modes as the preset's; a size that has too few prime
    factors is refused, naming it)."""
    patterns = TENSORIZE_PRESETS[name].shape_pattern
    width_modes, ffn_modes = patterns[_EXPAND]["in_shape"], patterns[_EXPAND]["out_shape"]

    def fit(config: TensorizeConfig, model: Mapping[str, Any]) -> TensorizeConfig:
        hidden = model.get("hidden_size", math.prod(width_modes))
        ffn = model.get("intermediate_size", math.prod(ffn_modes))
        if (hidden, ffn) == (math.prod(width_modes), math.prod(ffn_modes)):
            return config
        return _tensorize_config(
            fold_modes(hidden, len(width_modes), "model.hidden_size"),
            fold_modes(ffn, len(ffn_modes), "model.intermediate_size"),
            *_RANKS[name],
        )

    return fit


for _name, _config in TENSORIZE_PRESETS.items():
    register_preset(_name, _config, fit=_fit_mlm(_name))


def _sizes(hidden_size: int, n_layers: int, n_heads: int, intermediate_size: int) -> dict[str, int]:
    """A recipe preset's model sizes, which a run may change (``--set model.hidden_size=128``; the
    tensorization preset follows the widths)."""
    return {
        "hidden_size": hidden_size,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "intermediate_size": intermediate_size,
    }


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
        "layout": "stream",
        "tail": "pad",
        "mask_probability": 0.15,
        "seed": 0,
    }
    settings.update(changes)
    return settings


_LTE_OFF_THE_HEAD = {"lte": {"tensorize": {"exclude_modules": ["lm_head.dense"]}}}
"""LTE splits a batch across its heads along the first dimension. The LM head's transform runs on the masked
positions of every sequence gathered into rows, which do not follow the heads' split of the sequences, so
under LTE it stays a plain linear trained with AdamW."""


RECIPE_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "model": {"preset": "paper", "dropout": 0.1, **_sizes(768, 12, 12, 3072)},
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
    # 5000 steps of 8 x 128 tokens (about 5 passes over the 1.06M training tokens), where dense's validation
    # loss changes by less than 1 % over the last fifth; lr_other 5e-4 from a sweep of dense over 2.5e-4,
    # 5e-4 and 1e-3 (docs/results.md, masked-LM section).
    "small": {
        "model": {"preset": "small", "dropout": 0.1, **_sizes(256, 4, 4, 1024)},
        "data": _data_settings(8192, 128, max_bytes=4_000_000),
        "train": {
            "unit": "step",
            "early": 3750,
            "late": 1250,
            "batch_size": 8,
            "lr_other": 5e-4,
            "eval_every": 250,
            "log_every": 10,
        },
        "tensorize": {"preset": "mlm-small"},
        "method": {
            **_LTE_OFF_THE_HEAD,
            "comera": {"method": {"target_ratio": 0.5, "lr_cores": 1e-3, "lr_gates": 1e-3}},
        },
    },
    "smoke": {
        "model": {"preset": "smoke", "dropout": 0.1, **_sizes(32, 2, 2, 64)},
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
