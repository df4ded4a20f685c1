"""A LLaMA-style decoder for causal language-model pre-training, in one file: RMSNorm pre-norm blocks, causal
attention with rotary positions, a SwiGLU MLP, no biases, an LM head tied or not, every projection its own
``nn.Linear``, Hugging Face LLaMA's initialisation, and a key-value cache for generation. Details:
docs/llm.md, 'What exists'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera.checks import check_bool, check_int, check_number, check_optional_int
from comera.io import MODEL_ATTRIBUTE, register_model
from comera.models.sizes import config_from
from comera.workloads.llm import presets as _presets  # noqa: F401  (registers the llm-* tensorization presets)
from comera.workloads.llm.cache import KVCache

__all__ = [
    "IGNORE_INDEX",
    "MODEL_NAME",
    "MODEL_PRESETS",
    "LMConfig",
    "LlamaLM",
    "RMSNorm",
    "SwiGLU",
    "apply_rotary",
    "next_token_loss",
    "rotary_tables",
]

MODEL_NAME = "llama-lm"
IGNORE_INDEX = -100
"""The label of positions that carry no target (Hugging Face's convention)."""


@dataclass(frozen=True)
class LMConfig:
    """Sizes of a :class:`LlamaLM` (the defaults are the ``paper`` preset, GaLore's ``llama_60m``).

    Attributes:
        vocab_size: rows of the token embedding and outputs of the LM head (>= 2).
        hidden_size: model width ``D``; a multiple of ``n_heads`` with an even head size.
        n_layers: decoder blocks (>= 1).
        n_heads: attention heads; head size ``hidden_size // n_heads``.
        intermediate_size: inner width of the SwiGLU MLP (>= 1).
        max_seq_len: the longest input the model accepts (>= 1).
        rope_theta: base of the rotary frequencies ``theta ** (-2i / head_size)`` (> 0).
        norm_eps: epsilon of every RMSNorm (> 0).
        initializer_range: std of the normal initialisation of linear and embedding weights (> 0).
        tie_embeddings: the LM head reuses the embedding table (False: a separate matrix, as GaLore's
            LLaMA models).
        pad_token_id: the padding id, whose targets the loss skips; None when the data has no padding.
    """

    vocab_size: int = 32000
    hidden_size: int = 512
    n_layers: int = 8
    n_heads: int = 8
    intermediate_size: int = 1376
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_embeddings: bool = False
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_int(self.vocab_size, "vocab_size", 2)
        for name in ("hidden_size", "n_layers", "n_heads", "intermediate_size", "max_seq_len"):
            check_int(getattr(self, name), name, 1)
        if self.hidden_size % self.n_heads or (self.hidden_size // self.n_heads) % 2:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be n_heads ({self.n_heads}) times an even head size "
                "(rotary positions turn features in pairs)"
            )
        check_number(self.rope_theta, "rope_theta", 0.0, open_low=True)
        check_number(self.norm_eps, "norm_eps", 0.0, open_low=True)
        check_number(self.initializer_range, "initializer_range", 0.0, open_low=True)
        check_bool(self.tie_embeddings, "tie_embeddings")
        check_optional_int(self.pad_token_id, "pad_token_id", 0, self.vocab_size - 1)

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.hidden_size // self.n_heads


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # GaLore's llama_60m: 8 layers, width 512, 8 heads, SwiGLU 1376, 32000 tokens, 256-token sequences,
    # untied head: 58.07M parameters (2 * 32000 * 512 in the tables, 3.16M per block).
    "paper": {},
    # GaLore's llama_9m shape (4 layers, width 128, SwiGLU 352) with a 4096-token vocabulary: 1.85M
    # parameters, 4800 steps in about 15 minutes on 2 CPU cores; not to a plateau (docs/llm.md, "Plateau").
    "small": {"vocab_size": 4096, "hidden_size": 128, "n_layers": 4, "n_heads": 4, "intermediate_size": 352},
    # Tests: two tiny blocks; 88 = 8 x 11 keeps a prime factor in the MLP width, as 1376 = 32 x 43 does.
    "smoke": {
        "vocab_size": 96,
        "hidden_size": 32,
        "n_layers": 2,
        "n_heads": 4,
        "intermediate_size": 88,
        "max_seq_len": 32,
    },
}


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``y = x / sqrt(mean(x ** 2, -1) + eps) * weight``, computed in at least
    float32. Shapes: ``(*, dim) -> (*, dim)``, in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Unit weights."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(
    length: int,
    head_dim: int,
    theta: float,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles ``t * theta ** (-2i / head_dim)`` (position
    ``t = start .. start + length - 1``, frequency ``i``), each ``(length, head_dim // 2)``, computed in
    float64 and cast to ``dtype``."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    positions = torch.arange(start, start + length, device=device, dtype=torch.float64)
    angles = torch.outer(positions, frequencies)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair ``(x[..., i], x[..., i + d/2])`` of ``x`` ``(B, H, T, d)`` by the angle of its position
    and frequency (``cos``/``sin`` ``(T, d/2)``, :func:`rotary_tables`); returns ``(B, H, T, d)``."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions and bias-free ``q``/``k``/``v``/``o``: ``x``
    ``(B, T, D)``, ``cos``/``sin`` ``(T, head_dim / 2)`` -> ``(B, T, D)``; with a ``cache`` holding ``S``
    earlier positions, ``x`` holds the ``T`` new ones, stored in the cache's layer ``layer``.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.n_heads = config.n_heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        return x.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        q = apply_rotary(self._heads(self.q(x)), cos, sin)
        k = apply_rotary(self._heads(self.k(x)), cos, sin)
        v = self._heads(self.v(x))
        if cache is None:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = cache.length
            k, v = cache.update(layer, k, v)
            mask = cache.causal_mask(q.shape[2]) if start else None  # from position 0: plain causal
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not start)
        return self.o(context.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """LLaMA's MLP: ``down(silu(gate(x)) * up(x))``, bias-free. Shapes: ``(*, D) -> (*, D)``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm decoder block, ``x + attention(norm(x))`` then ``x + mlp(norm(x))``: ``x`` ``(B, T, D)``,
    ``cos``/``sin`` ``(T, head_dim / 2)`` -> ``(B, T, D)``; with a ``cache``, as :class:`Attention`.
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer)
        return x + self.mlp(self.mlp_norm(x))


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, pad_token_id: int | None = None
) -> torch.Tensor:
    """Mean cross entropy of ``logits[:, t]`` ``(B, T, V)`` against ``labels[:, t + 1]`` ``(B, T)`` over the
    targets that are neither ``-100`` nor ``pad_token_id`` (a scalar; 0 when no target is left).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be (B, T, V) and labels (B, T), got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    targets = labels[:, 1:]
    if pad_token_id is not None:
        targets = targets.masked_fill(targets == pad_token_id, IGNORE_INDEX)
    scored = logits[:, :-1].flatten(0, 1)
    scored = scored.to(torch.promote_types(scored.dtype, torch.float32))  # bfloat16 logits: the sum in fp32
    total = F.cross_entropy(scored, targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def _not_a_view(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as a tensor autograd sees as no view, without a copy: a TT head returns its 2-D result
    reshaped to ``(B, T, V)``, and FSDP2 warns when its root module returns a view. ``_unsafe_view`` is the
    reshape ``torch.matmul`` uses for its own fresh results; the base it aliases is the head's temporary,
    which nothing else holds."""
    return logits if logits._base is None else torch.ops.aten._unsafe_view(logits, logits.shape)


@register_model(MODEL_NAME)
class LlamaLM(nn.Module):
    """The LLaMA-style decoder, built with keyword sizes (the fields of :class:`LMConfig`), a ``config=`` or
    :meth:`from_preset` (``comera_model`` records them for :func:`comera.load_pretrained`): ``input_ids``
    ``(B, T)`` int64, ``1 <= T <= max_seq_len``, -> logits ``(B, T, V)``, position ``t`` seeing tokens ``<=
    t``; with a ``cache`` holding ``S`` positions, only the ``T`` new positions are computed (``S + T <=
    max_seq_len``) and the cache then holds ``S + T``.
    """

    def __init__(self, config: LMConfig | None = None, **sizes: Any) -> None:
        super().__init__()
        config = config_from(LMConfig, config, sizes, "LlamaLM")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init_weights)
        setattr(self, MODEL_ATTRIBUTE, {"name": MODEL_NAME, "kwargs": dataclasses.asdict(config)})

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaLM:
        """The model preset ``name`` ("paper", "small", "smoke") with the fields in ``overrides`` replaced,
        e.g. ``LlamaLM.from_preset("small", vocab_size=tokenizer_size)``."""
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown LM preset {name!r}; valid presets: {sorted(MODEL_PRESETS)}")
        return cls(**{**MODEL_PRESETS[name], **overrides})

    def _init_weights(self, module: nn.Module) -> None:
        """Hugging Face LLaMA's initialisation of one module: ``N(0, initializer_range)`` linear and
        embedding weights, unit norms (also what :func:`comera.materialize_` calls on a meta-built model)."""
        with torch.no_grad():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def new_cache(self, batch_size: int, max_length: int | None = None) -> KVCache:
        """An empty key-value cache for ``batch_size`` sequences of at most ``max_length`` positions
        (default and upper bound: ``max_seq_len``), on the device and in the dtype of the model's norms."""
        config = self.config
        max_length = config.max_seq_len if max_length is None else max_length
        check_int(max_length, "max_length", 1, config.max_seq_len)
        weight = self.norm.weight
        return KVCache(
            config.n_layers,
            batch_size,
            config.n_heads,
            config.head_dim,
            max_length,
            device=weight.device,
            dtype=weight.dtype,
        )

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        start = 0 if cache is None else cache.length
        if input_ids.dim() != 2 or not 1 <= input_ids.shape[1] <= self.config.max_seq_len - start:
            after = "" if cache is None else f" - the cache's {start} positions"
            raise ValueError(
                f"input_ids must be (B, T) with 1 <= T <= max_seq_len ({self.config.max_seq_len}){after}, "
                f"got {tuple(input_ids.shape)}"
            )
        if cache is not None:
            cache.check_room(*input_ids.shape)
        x = self.embed(input_ids)
        cos, sin = rotary_tables(
            input_ids.shape[1], self.config.head_dim, self.config.rope_theta, x.device, x.dtype, start
        )
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, layer)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return _not_a_view(self.lm_head(self.norm(x)))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`next_token_loss` of the logits of ``input_ids`` (``(B, T)``) against ``labels`` (``(B, T)``,
        default ``input_ids``), skipping the config's padding id; a scalar."""
        labels = input_ids if labels is None else labels
        return next_token_loss(self(input_ids), labels, self.config.pad_token_id)
