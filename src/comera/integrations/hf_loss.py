"""A causal language model's next-token loss computed ``chunk_size`` tokens at a time, never holding the whole
``(batch, seq, vocab)`` logits (each chunk checkpointed, its logits recomputed in the backward), and the
``transformers.Trainer`` mixin that trains with it. Details: docs/training.md, 'The chunked causal-LM
loss'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Trainer
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkedLossMixin",
    "ChunkedLossTrainer",
    "check_chunk_size",
    "check_chunkable",
    "chunked_causal_lm_loss",
    "chunked_forward",
]

DEFAULT_CHUNK_SIZE = 256
"""Tokens per chunk when none is given: 256 rows of logits, 31 MiB of fp32 at a 32000-token vocabulary."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields of Hugging Face models whose forward changes the head's logits before the loss (Gemma's
soft-capping, Cohere's and Granite's scales): :func:`chunked_causal_lm_loss` would leave that out."""


def check_chunk_size(chunk_size: Any) -> int:
    """``chunk_size`` as an int, or ``ValueError`` naming it and the valid range (an integer >= 1)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1 (tokens per chunk), got {chunk_size!r}")
    return chunk_size


def _chunk_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """The summed cross-entropy of one chunk: ``hidden`` ``(tokens, width)``, ``targets`` ``(tokens,)``."""
    logits = head(hidden)
    if logits.dtype.itemsize < 4:
        logits = logits.float()  # upcast as Hugging Face's ForCausalLMLoss does (float64 stays float64)
    return nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``: labels shifted, ``ignore_index`` skipped, the mean
    or the sum over ``num_items_in_batch``) of ``head(hidden_states)``, ``chunk_size`` tokens at a time;
    logits below fp32 are upcast per chunk.

    Args:
        hidden_states: ``(..., seq, width)``, the base model's last hidden states.
        head: maps ``(tokens, width)`` to ``(tokens, vocab)`` logits (``model.lm_head``, any module).
        labels: ``(..., seq)`` token ids, ``hidden_states``' leading shape; shifted here.
        chunk_size: tokens per chunk, an integer >= 1 (larger than the token count: one chunk).
        ignore_index: the target id that counts for nothing.
        num_items_in_batch: divide the summed loss by this instead of taking the mean.
        shift_labels: ``(..., seq)`` targets already shifted (``labels`` then unused).

    Returns:
        The 0-dim loss, fp32 (float64 for a float64 head).

    Raises:
        ValueError: a bad ``chunk_size``, neither ``labels`` nor ``shift_labels``, or targets whose shape
            is not ``hidden_states``' without its last dimension.
    """
    chunk_size = check_chunk_size(chunk_size)
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels, got neither")
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if tuple(shift_labels.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(
            f"labels must have hidden_states' shape without its last dimension, "
            f"{tuple(hidden_states.shape[:-1])}, got {tuple(shift_labels.shape)}"
        )
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    total = sum(
        checkpoint(_chunk_loss_sum, head, part, part_targets, ignore_index, use_reentrant=False)
        for part, part_targets in zip(hidden.split(chunk_size), targets.split(chunk_size))
    )
    assert isinstance(total, torch.Tensor)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def check_chunkable(model: nn.Module) -> None:
    """``ValueError`` (one line, naming why) unless ``model`` is a Hugging Face causal LM in the form
    :class:`ChunkedLossMixin` needs: a ``base_model`` other than itself that returns the last hidden states
    first, a module ``lm_head`` that maps them to the logits, and no change of the logits between the two."""
    name = type(model).__name__
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError(
            f"loss_chunk_size needs a transformers causal LM with a base model (model.base_model, e.g. "
            f"LlamaForCausalLM.model); {name} has none"
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(
            f"loss_chunk_size needs the model's head as a module model.lm_head (hidden states to logits); "
            f"{name} has none"
        )
    config = getattr(model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        if getattr(config, field, None) not in (None, 1, 1.0):
            raise ValueError(
                f"loss_chunk_size cannot train {name}: its config.{field}={getattr(config, field)!r} changes "
                "the logits after model.lm_head, which the chunked loss leaves out"
            )


class ChunkedLossMixin:
    """A ``transformers.Trainer`` mixin (before ``Trainer`` in the bases) whose training loss, with
    ``loss_chunk_size=N`` (None: ``Trainer`` unchanged), is the base model's hidden states and
    :func:`chunked_causal_lm_loss` on ``model.lm_head`` (the output's ``logits`` None); evaluation,
    prediction, a label smoother and a ``compute_loss_func`` keep the full logits.

    Raises:
        ValueError: a bad ``loss_chunk_size``, or a model :func:`check_chunkable` refuses (at construction
            when the model is given, else at the first loss).
    """

    def __init__(self, *args: Any, loss_chunk_size: int | None = None, **kwargs: Any) -> None:
        self.loss_chunk_size = None if loss_chunk_size is None else _check_loss_chunk_size(loss_chunk_size)
        super().__init__(*args, **kwargs)
        if self.loss_chunk_size is not None and getattr(self, "model", None) is not None:
            check_chunkable(self.accelerator.unwrap_model(self.model))  # type: ignore[attr-defined]

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """``transformers.Trainer.compute_loss``, with the chunked loss where it applies (class docstring)."""
        chunked = (
            self.loss_chunk_size is not None
            and not return_outputs
            and "labels" in inputs
            and getattr(self, "label_smoother", None) is None
            and getattr(self, "compute_loss_func", None) is None
        )
        if not chunked:
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        inner = self.accelerator.unwrap_model(model)  # type: ignore[attr-defined]
        chunk: int = self.loss_chunk_size  # type: ignore[assignment]  # not None: checked above
        with chunked_forward(inner, chunk, self.accelerator.autocast):  # type: ignore[attr-defined]
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=False, num_items_in_batch=num_items_in_batch
            )


def _check_loss_chunk_size(value: Any) -> int:
    try:
        return check_chunk_size(value)
    except ValueError:
        raise ValueError(
            f"loss_chunk_size must be None or an integer >= 1 (tokens per chunk), got {value!r}"
        ) from None


@contextlib.contextmanager
def chunked_forward(
    model: nn.Module,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Iterator[None]:
    """Inside, ``model(**inputs)`` of a Hugging Face causal LM runs the base model and
    :func:`chunked_causal_lm_loss` on ``model.lm_head`` under ``autocast()``, returning a
    ``CausalLMOutputWithPast`` with ``loss`` set and ``logits`` None; ``model.forward`` is put back on the
    way out.

    Raises:
        ValueError: a bad ``chunk_size`` or a model :func:`check_chunkable` refuses.
    """
    chunk_size = check_chunk_size(chunk_size)
    check_chunkable(model)
    base, head = cast(nn.Module, model.base_model), cast(nn.Module, model.lm_head)

    def forward(**kwargs: Any) -> CausalLMOutputWithPast:
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)
        items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        with autocast():
            hidden = base(**kwargs)[0]
            loss = chunked_causal_lm_loss(
                hidden,
                head,
                labels,
                chunk_size=chunk_size,
                num_items_in_batch=items,
                shift_labels=shift_labels,
            )
        return CausalLMOutputWithPast(loss=loss, logits=None)

    own = vars(model)  # the instance's attributes: accelerate's autocast wrapper, if any, is "forward" here
    had_own, previous = "forward" in own, own.get("forward")
    own["forward"] = forward
    try:
        yield
    finally:
        if had_own:
            own["forward"] = previous
        else:
            del own["forward"]


class ChunkedLossTrainer(ChunkedLossMixin, Trainer):
    """``transformers.Trainer`` with :class:`ChunkedLossMixin`: ``ChunkedLossTrainer(model, args,
    loss_chunk_size=1024, ...)`` trains any Hugging Face causal LM with a ``base_model`` and an ``lm_head``
    (dense or tensorized, with any optimizer) without materialising its ``(batch, seq, vocab)`` logits."""
