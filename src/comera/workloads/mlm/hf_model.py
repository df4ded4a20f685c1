"""The Hugging Face side of the masked-LM workload (needs ``transformers``): :class:`CodeMaskedLM`, which can
score only the masked positions, the ``"comera"`` attention implementation (cheap dropout draws on CPU) and
:func:`use_fast_dropout`, each making a step cheaper without changing what is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, RobertaForMaskedLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_outputs import MaskedLMOutput

from comera.models.attention import attention_context
from comera.models.dropout import FastDropout

__all__ = ["ATTENTION", "IGNORE_INDEX", "CodeMaskedLM", "comera_attention", "use_fast_dropout"]

ATTENTION = "comera"
"""The name of the attention implementation registered here (``model.set_attn_implementation(ATTENTION)``)."""

IGNORE_INDEX = -100
"""The label of positions that are not predicted (Hugging Face's convention)."""


def comera_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature over :func:`attention_context`: ``query`` ``(B, H, Tq,
    d)``, ``key``/``value`` ``(B, H, Tk, d)``, ``attention_mask`` None or SDPA's boolean ``(B, 1, Tq, Tk)``
    -> ``((B, Tq, H, d), None)``.
    """
    context = attention_context(query, key, value, attention_mask, dropout, scaling)
    return context.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, comera_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_fast_dropout(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Dropout`` submodule of ``model`` by a :class:`FastDropout` of the same ``p``, in
    place; returns ``model``."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, FastDropout(child.p).train(child.training))
    return model


class CodeMaskedLM(RobertaForMaskedLM):
    """``RobertaForMaskedLM`` whose ``forward(..., masked_only=True)`` runs the LM head only on the ``N``
    positions with ``labels != -100``: ``logits`` ``(N, vocab_size)`` (``(B, T, vocab_size)`` while a CUDA
    graph is captured), ``loss`` their mean cross-entropy (0 when ``N == 0``); arguments after
    ``attention_mask`` go by keyword.
    """

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        masked_only: bool = False,
        **kwargs,
    ):
        labels = kwargs.get("labels")
        if not masked_only or labels is None:
            return super().forward(input_ids, attention_mask, *args, **kwargs)
        if args:
            raise TypeError("with masked_only=True, pass the arguments after attention_mask by keyword")
        kwargs.pop("labels")
        kwargs.pop("return_dict", None)
        hidden = self.roberta(input_ids, attention_mask=attention_mask, return_dict=True, **kwargs)[0]
        labels = labels.to(hidden.device)
        chosen = labels != IGNORE_INDEX
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            logits = self.lm_head(hidden)  # every position; cross_entropy skips the IGNORE_INDEX labels
            scored, targets = logits.flatten(0, 1), labels.flatten()
        else:
            logits = scored = self.lm_head(hidden[chosen])
            targets = labels[chosen]
        total = F.cross_entropy(scored, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return MaskedLMOutput(loss=total / chosen.sum().clamp(min=1), logits=logits)
