"""The Hugging Face side of the masked-LM workload: its model class and its attention implementation.

Imported by :func:`comera.workloads.mlm.model.build_mlm_model` when a model is built (it needs
``transformers``, the optional ``hf`` extra). Three things make a pre-training step cheaper without changing
what is computed:

- :class:`CodeMaskedLM` scores only the masked positions when asked (``masked_only=True``): the LM head's
  ``(tokens, vocabulary)`` product, its softmax and their backward shrink to the ~15% of tokens that carry
  a label. The loss is the same mean cross-entropy over the masked tokens.
- The ``"comera"`` attention implementation (:data:`ATTENTION`, registered with ``transformers``'
  ``AttentionInterface`` and, with SDPA's boolean masks, ``AttentionMaskInterface``) runs
  :func:`comera.models.attention.attention_context`: SDPA, except on CPU in training, where the attention
  probabilities are dropped with cheap random draws.
- :func:`use_fast_dropout` swaps every ``nn.Dropout`` for :class:`comera.models.dropout.FastDropout`
  (``p`` quantised to 1/256: 0.1 becomes 0.1016).
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
    """``transformers``' attention-function signature over :func:`attention_context`.

    Shapes: ``query`` ``(B, H, Tq, d)``, ``key``/``value`` ``(B, H, Tk, d)``, ``attention_mask`` None or
    SDPA's boolean ``(B, 1, Tq, Tk)`` -> ``((B, Tq, H, d), None)`` (no attention weights are returned).
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
    """``RobertaForMaskedLM`` whose forward can score only the positions that carry a label.

    ``forward(input_ids, attention_mask, labels=labels, masked_only=True)``: the encoder runs on the whole
    ``(B, T)`` batch, the LM head only on the ``N`` positions with ``labels != -100``. The output's ``logits``
    are ``(N, vocab_size)`` (those positions in row-major order, so ``labels[labels != -100]`` are their
    targets) and ``loss`` is their mean cross-entropy, 0 when ``N == 0``. While a CUDA graph is being
    captured (where a data-dependent selection cannot run) the head scores every position and ``logits``
    are ``(B, T, vocab_size)``; the loss is the same. Without ``masked_only`` (the default) the forward is
    ``RobertaForMaskedLM``'s, positional arguments included; with ``masked_only``, everything after
    ``attention_mask`` goes by keyword.
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
