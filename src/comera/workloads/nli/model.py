"""The six-encoder transformer of the paper's sentence-pair workload, in one file: a BERT-style post-LN
encoder classifying ``[CLS] a [SEP] b [SEP]`` from its [CLS] token, every projection its own ``nn.Linear``,
attention through :func:`comera.models.attention.attention_context` with no host sync. Details:
docs/method.md, 'Experiments and workloads'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera.checks import check_int, check_number
from comera.io import MODEL_ATTRIBUTE, register_model
from comera.models.attention import attention_context
from comera.models.dropout import FastDropout
from comera.models.sizes import config_from

__all__ = [
    "MODEL_NAME",
    "MODEL_PRESETS",
    "TransformerConfig",
    "TransformerClassifier",
    "padding_bias",
]

MODEL_NAME = "transformer-classifier"
_INIT_STD = 0.02


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of a :class:`TransformerClassifier` (the defaults are the paper's ``paper`` preset).

    Attributes:
        vocab_size: rows of the word embedding.
        d_model: hidden size; a multiple of ``n_heads``.
        n_layers: encoder blocks.
        n_heads: attention heads (head size ``d_model // n_heads``).
        d_ff: inner size of the feed-forward layers.
        max_positions: rows of the learned position embedding (the longest input).
        type_vocab_size: token types (2: first and second sentence).
        num_classes: outputs of the classifier.
        dropout: drop probability on embeddings, sublayer outputs and the pooled vector (quantised to
            1/256, see :mod:`comera.models.dropout`).
        attention_dropout: drop probability on attention probabilities; None means ``dropout``.
        layer_norm_eps: epsilon of every LayerNorm.
        pad_token_id: the padding id (its embedding row starts at zero and gets no gradient).
        exact_match: add a learned embedding of each token's exact-match flag
            (:func:`comera.workloads.nli.pairs.exact_match_flags`); off in the paper's model.
    """

    vocab_size: int = 30522
    d_model: int = 768
    n_layers: int = 6
    n_heads: int = 12
    d_ff: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    num_classes: int = 3
    dropout: float = 0.1
    attention_dropout: float | None = None
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    exact_match: bool = False

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions", "type_vocab_size")
        for name in (*sizes, "num_classes"):
            check_int(getattr(self, name), name, 1)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        check_number(self.dropout, "dropout", 0.0, 1.0, open_high=True)
        if self.attention_dropout is not None:
            check_number(self.attention_dropout, "attention_dropout", 0.0, 1.0, open_high=True)
        check_number(self.layer_norm_eps, "layer_norm_eps", 0.0, open_low=True)
        check_int(self.pad_token_id, "pad_token_id", 0, self.vocab_size - 1)
        if not isinstance(self.exact_match, bool):
            raise TypeError(f"exact_match must be a bool, got {self.exact_match!r}")

    @property
    def attention_p(self) -> float:
        """The drop probability on attention probabilities."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # The paper's six-encoder model (BERT-base widths, 6 blocks, the bert-base-uncased vocabulary, MNLI).
    "paper": {},
    # A CPU demo model: 2 blocks of width 128 (4 heads of 32), FFN 512: about 0.4M encoder weights, so a
    # step of 32 pairs of 64 tokens costs ~5 GFLOP and the embedded task trains in minutes on 2 cores. The
    # vocabulary is the data's (2,048 WordPieces for the embedded task); 2 classes (matches / doesn't).
    "small": {
        "vocab_size": 2048,
        "d_model": 128,
        "n_layers": 2,
        "n_heads": 4,
        "d_ff": 512,
        "max_positions": 128,
        "num_classes": 2,
    },
    # Tests: two tiny blocks.
    "smoke": {
        "vocab_size": 96,
        "d_model": 16,
        "n_layers": 2,
        "n_heads": 2,
        "d_ff": 32,
        "max_positions": 32,
        "num_classes": 3,
    },
}


def padding_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias ``(B, 1, 1, T)`` from a ``(B, T)`` mask (nonzero/True = real token): 0 for real
    tokens, ``-inf`` for padding; every query must see at least one real key.
    """
    keep = attention_mask[:, None, None, :].bool()
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate ``query``/``key``/``value``/``output`` projections:
    ``x`` (B, T, D), ``bias`` (B, 1, 1, T) additive or None -> (B, T, D).
    """

    def __init__(self, d_model: int, n_heads: int, attention_p: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attention_p = attention_p
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        context = attention_context(q, k, v, bias, self.attention_p if self.training else 0.0)
        return self.output(context.transpose(1, 2).flatten(2))


class EncoderBlock(nn.Module):
    """Post-LN encoder block: attention and feed-forward sublayers, each ``LayerNorm(x + dropout(f(x)))``;
    ``x`` (B, T, D), ``bias`` (B, 1, 1, T) or None -> (B, T, D).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config.d_model, config.n_heads, config.attention_p)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(config.d_model, config.d_ff)
        self.ffn_out = nn.Linear(config.d_ff, config.d_model)
        self.ffn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = FastDropout(config.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        h = self.attention_norm(x + self.dropout(self.attention(x, bias)))
        return self.ffn_norm(h + self.dropout(self.ffn_out(F.gelu(self.ffn_in(h)))))


class Embeddings(nn.Module):
    """Word + learned position + token type (+ exact-match flag) embeddings, then LayerNorm and dropout:
    ``input_ids``, ``token_type_ids`` and ``exact_match_ids`` (B, T) int64 -> (B, T, D);
    ``exact_match_ids`` is required when the config has ``exact_match``, ignored otherwise.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_positions, config.d_model)
        self.token_type = nn.Embedding(config.type_vocab_size, config.d_model)
        self.exact_match = nn.Embedding(2, config.d_model) if config.exact_match else None
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = FastDropout(config.dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        exact_match_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        if self.exact_match is not None:
            if exact_match_ids is None:
                raise ValueError(
                    "exact_match_ids is required: the model was built with exact_match=True (pass the "
                    "batch's 'exact_match_ids', 0/1 per token)"
                )
            x = x + self.exact_match(exact_match_ids)
        return self.dropout(self.norm(x))


@register_model(MODEL_NAME)
class TransformerClassifier(nn.Module):
    """BERT-style post-LN encoder with a [CLS] classification head, built with keyword sizes (the fields of
    :class:`TransformerConfig`), a ``config=`` or :meth:`from_preset`: ``input_ids`` (B, T) int64, ``T <=
    max_positions``, ``token_type_ids`` (B, T) or None, ``attention_mask`` (B, T) or None,
    ``exact_match_ids`` (B, T) 0/1 (with ``exact_match=True``) -> logits (B, num_classes).
    """

    def __init__(self, config: TransformerConfig | None = None, **sizes: Any) -> None:
        super().__init__()
        config = config_from(TransformerConfig, config, sizes, "TransformerClassifier")
        self.config = config
        self.embeddings = Embeddings(config)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_layers))
        self.pooler = nn.Linear(config.d_model, config.d_model)
        self.dropout = FastDropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.num_classes)
        self.apply(self._init_weights)
        setattr(self, MODEL_ATTRIBUTE, {"name": MODEL_NAME, "kwargs": dataclasses.asdict(config)})

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> TransformerClassifier:
        """The model preset ``name`` ("paper", "small", "smoke") with sizes in ``overrides`` replaced (e.g.
        ``TransformerClassifier.from_preset("small", vocab_size=tokenizer_size, num_classes=2)``).
        """
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown transformer preset {name!r}; valid presets: {sorted(MODEL_PRESETS)}")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms, a zero padding row."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=_INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        exact_match_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids, exact_match_ids)
        bias = None if attention_mask is None else padding_bias(attention_mask, x.dtype)
        for block in self.blocks:
            x = block(x, bias)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(self.dropout(pooled))
