"""Presets of the language-model workload: the recipe presets (:data:`RECIPE_PRESETS`) and the tensorization
presets they name (``llm-paper``, ``llm-small``, ``llm-smoke``, and ``llm-hf-llama`` / ``llm-hf-gpt2`` for
Hugging Face's models), registered on import. Details: docs/llm.md, 'What exists'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from comera.tensorize_config import TensorizeConfig, fold_modes, register_preset

__all__ = ["RECIPE_PRESETS", "TENSORIZE_PRESETS", "llm_tensorize_config"]

_LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def llm_tensorize_config(
    *,
    linear_rank: int,
    embedding_rank: int,
    width: tuple[int, ...],
    mlp: tuple[int, ...],
    rows: tuple[int, ...] | None,
    head: bool = True,
    embedding: bool = True,
    format: str = "tt",
) -> TensorizeConfig:
    """The config of a :class:`~comera.workloads.llm.model.LlamaLM`: TT projections, TTM embedding.

    Args:
        linear_rank: rank of every TT projection (and of an untied head).
        embedding_rank: rank of the TTM embedding (and so of a tied head).
        width: modes of the model width, ascending; the attention maps ``width -> reversed(width)``, the
            MLP's ``gate``/``up`` read ``width`` and ``down`` writes ``reversed(width)``.
        mlp: modes of the MLP width as ``gate``/``up`` write them; ``down`` reads them reversed.
        rows: modes of the vocabulary (the embedding's rows; padded when the vocabulary is smaller), or
            None: chosen for the model's vocabulary (with as many modes as ``width``); its columns take
            ``width``.
        head: whether an untied LM head becomes a ``TTLinear`` (False: it stays dense; a tied head follows
            the embedding either way).
        embedding: whether the token embedding becomes a ``TTMEmbedding`` (False: it stays dense, and
            ``embedding_rank`` and ``rows`` are not used).
        format: ``"tt"`` (projections become ``TTLinear``) or ``"ttm"`` (``TTMLinear``: every core holds an
            input and an output mode, so the matrix rank is not capped by one bond's rank).
    """
    back = tuple(reversed(width))
    shapes: dict[str, dict[str, tuple[int, ...]]] = {
        r"attention\.(q|k|v|o)": {"in_shape": width, "out_shape": back},
        r"mlp\.(gate|up)": {"in_shape": width, "out_shape": mlp},
        r"mlp\.down": {"in_shape": tuple(reversed(mlp)), "out_shape": back},
    }
    if embedding:
        shapes["embed"] = {"col_shape": width} if rows is None else {"row_shape": rows, "col_shape": width}
    return TensorizeConfig(
        target_modules=_LINEARS if head else tuple(name for name in _LINEARS if name != "lm_head"),
        embeddings=("embed",) if embedding else False,
        format=format,
        rank=linear_rank,
        rank_pattern={"embed": embedding_rank} if embedding else {},
        shape_pattern=shapes,
    )


_LAYOUTS: dict[str, dict[str, Any]] = {
    "llm-paper": {"linear_rank": 32, "embedding_rank": 32, "rows": (40, 20, 40)},
    "llm-small": {
        "linear_rank": 16,
        "embedding_rank": 32,
        "rows": None,
        "head": False,
        "embedding": False,
        "format": "ttm",
    },
    "llm-smoke": {"linear_rank": 4, "embedding_rank": 4, "rows": None},
}
"""The llm-* presets without their foldings, which follow the model's widths
(:func:`comera.tensorize_config.fold_modes`)."""

_SIZES = {"llm-paper": (512, 1376, 3), "llm-small": (128, 352, 3), "llm-smoke": (32, 88, 2)}
"""Each llm-* preset's model width, MLP width and number of modes per folding."""


def _fit_llm(name: str) -> Callable[[TensorizeConfig, Mapping[str, Any]], TensorizeConfig]:
    """The ``fit`` of preset ``name``: its layout with the foldings of the model section's ``hidden_size``
    and ``intermediate_size`` (the preset's own sizes when the section does not name them)."""
    width, mlp, num_modes = _SIZES[name]

    def fit(config: TensorizeConfig, model: Mapping[str, Any]) -> TensorizeConfig:
        hidden = model.get("hidden_size", width)
        inner = model.get("intermediate_size", mlp)
        if (hidden, inner) == (width, mlp):
            return config
        return llm_tensorize_config(
            **_LAYOUTS[name],
            width=fold_modes(hidden, num_modes, "model.hidden_size"),
            mlp=fold_modes(inner, num_modes, "model.intermediate_size"),
        )

    return fit


TENSORIZE_PRESETS: dict[str, TensorizeConfig] = {
    **{
        name: llm_tensorize_config(
            **layout,
            width=fold_modes(_SIZES[name][0], _SIZES[name][2], "hidden_size"),
            mlp=fold_modes(_SIZES[name][1], _SIZES[name][2], "intermediate_size"),
        )
        for name, layout in _LAYOUTS.items()
    },
    "llm-hf-llama": TensorizeConfig(
        target_modules=(
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "lm_head",
        ),
        embeddings=("embed_tokens",),
        rank=16,
    ),
    "llm-hf-gpt2": TensorizeConfig(
        target_modules=("c_attn", "c_proj", "c_fc", "lm_head"),
        embeddings=("wte",),
        rank=16,
    ),
}

for _name, _config in TENSORIZE_PRESETS.items():
    register_preset(_name, _config, fit=_fit_llm(_name) if _name in _LAYOUTS else None)


def _model(preset: str, **sizes: int) -> dict[str, Any]:
    """A recipe preset's ``model`` section: the model preset, an untied head, and the sizes a run may change
    (``--set model.hidden_size=96``; the tensorization preset folds the widths it is given,
    :func:`comera.tensorize_config.fold_modes`)."""
    return {"preset": preset, "tie_embeddings": False, **sizes}


def _data(vocab_size: int, seq_len: int, **changes: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "tokenizer_file": None,
        "validation_fraction": 0.05,
        "max_validation_blocks": None,
        "max_files": None,
        "max_bytes": None,
        "skip_bad_lines": False,
        "layout": "stream",
    }
    settings.update(changes)
    return settings


APOLLO_MINI = {"rank": 1, "scale_type": "tensor", "scale": 128.0}
"""APOLLO-Mini's settings (APOLLO's README): the ``apollo`` rows of this workload are APOLLO-Mini, the variant
whose memory the peers' tables put against GaLore's."""

_COSINE = {"lr_schedule": "cosine", "warmup": 0.1, "min_lr_ratio": 0.1}
"""GaLore, APOLLO, Fira and CoLA's schedule: 10% linear warm-up, cosine decay to 10% of the peak."""

RECIPE_PRESETS: dict[str, dict[str, Any]] = {
    # GaLore's llama_60m with its 256-token sequences on the whole standard library (the step-time and memory
    # comparisons; a CPU cannot train it to a plateau)
    "paper": {
        "model": _model("paper", hidden_size=512, n_layers=8, n_heads=8, intermediate_size=1376),
        "data": _data(32000, 256, max_validation_blocks=256),
        "train": {
            "unit": "step",
            "early": 8000,
            "late": 2000,
            "batch_size": 32,
            "drop_last": True,
            "lr_other": 1e-3,
            "grad_clip": 1.0,
            **_COSINE,
            "eval_every": 1000,
            "checkpoint_every": 1000,
            "log_every": 50,
        },
        "tensorize": {"preset": "llm-paper"},
        "method": {
            "comera": {"method": {"target_ratio": 0.5, "lr_cores": 1e-3, "lr_gates": 1e-3}},
            "apollo": {"method": APOLLO_MINI},
        },
    },
    # GaLore's llama_9m shape with a 4096-token BPE, on 24 MB of the standard library and the topics (6.6M
    # training tokens); 4800 steps (9.8M tokens, 1.5 passes): about 15 minutes for dense (0.18 s a step) on 2
    # idle cores, long enough for the validation loss to settle; peak learning rate 2e-3 from dense's sweep
    # over 1e-3, 2e-3, 4e-3 (docs/llm.md)
    "small": {
        "model": _model("small", hidden_size=128, n_layers=4, n_heads=4, intermediate_size=352),
        "data": _data(4096, 256, max_bytes=24_000_000, max_validation_blocks=64),
        "train": {
            "unit": "step",
            "early": 3800,
            "late": 1000,
            "batch_size": 8,
            "drop_last": True,
            "lr_other": 2e-3,
            "grad_clip": 1.0,
            **_COSINE,
            "eval_every": 400,
            "checkpoint_every": 400,
            "log_every": 50,
        },
        "tensorize": {"preset": "llm-small"},
        "method": {
            "comera": {"method": {"target_ratio": 0.8, "lr_cores": 3e-3, "lr_gates": 3e-3}},
            "apollo": {"method": APOLLO_MINI},
        },
    },
    # tests: two tiny blocks, a 300-token BPE, a few seconds
    "smoke": {
        "model": _model("smoke", hidden_size=32, n_layers=2, n_heads=4, intermediate_size=88),
        "data": _data(300, 32, max_bytes=100_000, validation_fraction=0.1, max_validation_blocks=16),
        "train": {
            "unit": "step",
            "early": 4,
            "late": 2,
            "batch_size": 8,
            "drop_last": True,
            "lr_other": 1e-3,
            **_COSINE,
            "eval_every": 3,
            "log_every": 1,
        },
        "tensorize": {"preset": "llm-smoke"},
        "method": {"comera": {"method": {"lr_cores": 1e-3, "lr_gates": 1e-3}}},
    },
}
"""``comera train llm --preset NAME``: the ``model`` section names a :data:`MODEL_PRESETS
<comera.workloads.llm.model.MODEL_PRESETS>` entry (its vocabulary and sequence length come from the data),
``data`` the arguments of :func:`comera.workloads.llm.data.build_lm_data`."""
