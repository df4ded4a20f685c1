"""RoBERTa-architecture masked-language model for CodeBERT-style pre-training on code: Hugging Face's
``RobertaForMaskedLM`` built from a ``RobertaConfig`` (never downloaded) at the ``paper`` (RoBERTa-base),
``small`` or ``smoke`` preset, its decoder tied to the word embedding. Details: docs/method.md,
'Experiments and workloads'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from comera.checks import check_int
from comera.io import MODEL_ATTRIBUTE, register_model

__all__ = [
    "MODEL_NAME",
    "MODEL_PRESETS",
    "mlm_config",
    "model_sizes",
    "SIZE_NAMES",
    "build_mlm_model",
]

MODEL_NAME = "roberta-mlm"

MODEL_PRESETS: dict[str, dict[str, int]] = {
    "paper": {
        "num_hidden_layers": 12,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "max_length": 512,
    },
    "small": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "max_length": 128,
    },
    "smoke": {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_length": 32,
    },
}


if TYPE_CHECKING:
    from transformers import RobertaConfig, RobertaForMaskedLM


def _transformers():
    """``transformers``, imported when a model is built (it is the optional ``hf`` extra)."""
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "the masked-LM workload builds its model with Hugging Face transformers: "
            "pip install -c constraints.txt 'comera[hf]'"
        ) from None
    return transformers


def _check_preset(preset: object) -> dict[str, int]:
    if preset not in MODEL_PRESETS:
        raise ValueError(f"preset must be one of {sorted(MODEL_PRESETS)}, got {preset!r}")
    return MODEL_PRESETS[preset]


SIZE_NAMES = {
    "hidden_size": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
}
"""The sizes a run may set (``--set model.n_layers=6``) and the ``RobertaConfig`` fields they set."""


def model_sizes(preset: str, **sizes: int | None) -> dict[str, int]:
    """The preset's sizes with those of ``sizes`` (keys of :data:`SIZE_NAMES`) that are not None, checked:
    each an int >= 1, ``hidden_size`` a multiple of ``n_heads`` (``ValueError`` naming the size)."""
    chosen = dict(_check_preset(preset))
    for name, value in sizes.items():
        if name not in SIZE_NAMES:
            raise ValueError(f"unknown model size {name!r}; valid sizes: {list(SIZE_NAMES)}")
        if value is not None:
            chosen[SIZE_NAMES[name]] = check_int(value, name, 1)
    if chosen["hidden_size"] % chosen["num_attention_heads"]:
        raise ValueError(
            f"hidden_size ({chosen['hidden_size']}) must be a multiple of n_heads "
            f"({chosen['num_attention_heads']})"
        )
    return chosen


def mlm_config(
    preset: str,
    vocab_size: int,
    *,
    max_length: int | None = None,
    dropout: float = 0.1,
    bos_token_id: int = 0,
    pad_token_id: int = 1,
    eos_token_id: int = 2,
    hidden_size: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    intermediate_size: int | None = None,
) -> RobertaConfig:
    """The ``RobertaConfig`` of model preset ``preset`` for a vocabulary of ``vocab_size`` tokens.

    Args:
        preset: one of :data:`MODEL_PRESETS`.
        vocab_size: number of tokens of the tokenizer (``>= 5``: the special tokens and more).
        max_length: longest input sequence; default the preset's. RoBERTa's positions start after
            ``pad_token_id``, so the position table has ``max_length + pad_token_id + 1`` rows.
        dropout: hidden and attention dropout probability, in ``[0, 1)``.
        bos_token_id, pad_token_id, eos_token_id: special token ids, in ``[0, vocab_size)``.
        hidden_size, n_layers, n_heads, intermediate_size: the model's width, encoder layers, attention heads
            and FFN width; None: the preset's (:func:`model_sizes`).
    """
    sizes = model_sizes(
        preset,
        hidden_size=hidden_size,
        n_layers=n_layers,
        n_heads=n_heads,
        intermediate_size=intermediate_size,
    )
    vocab_size = check_int(vocab_size, "vocab_size", 5)
    max_length = sizes["max_length"] if max_length is None else check_int(max_length, "max_length", 2)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
    for name, value in (
        ("bos_token_id", bos_token_id),
        ("pad_token_id", pad_token_id),
        ("eos_token_id", eos_token_id),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(
                f"{name} must be an int in [0, {vocab_size - 1}] (vocab_size={vocab_size}), got {value!r}"
            )
    return _transformers().RobertaConfig(
        vocab_size=vocab_size,
        hidden_size=sizes["hidden_size"],
        num_hidden_layers=sizes["num_hidden_layers"],
        num_attention_heads=sizes["num_attention_heads"],
        intermediate_size=sizes["intermediate_size"],
        max_position_embeddings=max_length + pad_token_id + 1,
        hidden_dropout_prob=float(dropout),
        attention_probs_dropout_prob=float(dropout),
        type_vocab_size=1,
        bos_token_id=bos_token_id,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=True,
    )


@register_model(MODEL_NAME)
def build_mlm_model(
    preset: str,
    vocab_size: int,
    *,
    max_length: int | None = None,
    dropout: float = 0.1,
    bos_token_id: int = 0,
    pad_token_id: int = 1,
    eos_token_id: int = 2,
    hidden_size: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    intermediate_size: int | None = None,
    fast_training: bool = True,
) -> RobertaForMaskedLM:
    """A freshly initialised dense RoBERTa masked LM of model preset ``preset`` (arguments of
    :func:`mlm_config`): a :class:`comera.workloads.mlm.hf_model.CodeMaskedLM` with its decoder tied to the
    word embedding, with ``fast_training`` :class:`comera.models.dropout.FastDropout` and the ``"comera"``
    attention (the same evaluation outputs); ``comera_model`` records its arguments for
    :func:`comera.load_pretrained`.

    Shape:
        ``model(input_ids=(B, T), attention_mask=(B, T), labels=(B, T))`` with ``T <= max_length``;
        ``.logits`` is ``(B, T, vocab_size)``, ``.loss`` the mean cross-entropy over labels ``!= -100``.
    """
    if not isinstance(fast_training, bool):
        raise TypeError(f"fast_training must be a bool, got {fast_training!r}")
    kwargs: dict[str, Any] = {
        "max_length": max_length,
        "dropout": dropout,
        "bos_token_id": bos_token_id,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        **{
            name: value
            for name, value in (
                ("hidden_size", hidden_size),
                ("n_layers", n_layers),
                ("n_heads", n_heads),
                ("intermediate_size", intermediate_size),
            )
            if value is not None
        },
    }
    config = mlm_config(preset, vocab_size, **kwargs)
    _transformers()
    from comera.workloads.mlm.hf_model import ATTENTION, CodeMaskedLM, use_fast_dropout

    model = CodeMaskedLM(config)
    if fast_training:
        model.set_attn_implementation(ATTENTION)
        use_fast_dropout(model)
    setattr(
        model,
        MODEL_ATTRIBUTE,
        {
            "name": MODEL_NAME,
            "kwargs": {"preset": preset, "vocab_size": vocab_size, **kwargs, "fast_training": fast_training},
        },
    )
    return model
