"""Text generation with a :class:`~comera.workloads.llm.model.LlamaLM` and its key-value cache (``T + N - 1``
positions for ``N`` new tokens after a prompt of ``T``): greedy, or sampled with temperature and ``top_k``
from a seeded generator; the context is never slid. Details: docs/llm.md, 'Generation'.
"""

from __future__ import annotations

import torch

from comera.checks import check_int, check_number, check_optional_int
from comera.workloads.llm.model import LlamaLM

__all__ = ["generate", "next_tokens"]

_SEED_HIGH = 2**64 - 1


def next_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each sequence from its last logits ``(B, V)`` -> ``(B,)`` int64: ``argmax`` when
    ``temperature`` is 0, else a draw from ``softmax(logits / temperature)`` over the ``top_k`` largest
    logits (all when None); the arguments are checked by :func:`generate`.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = _tempered(logits.to(torch.promote_types(logits.dtype, torch.float32)), temperature)
    if top_k is None:
        return torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator).squeeze(1)
    kept, indices = scaled.topk(top_k, dim=-1)
    choice = torch.multinomial(kept.softmax(dim=-1), 1, generator=generator)
    return indices.gather(1, choice).squeeze(1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` up to a shift per row (which the softmax ignores), finite or ``-inf`` for any
    ``temperature > 0``: each row's largest logit is subtracted first and stays 0, so a temperature too small
    for the logits' dtype (``1e-45`` rounds to 0 in float32) gives ``-inf`` to the others, not ``nan``, and
    the draw takes a most likely token, as greedy decoding does."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    return torch.where(shifted < 0, shifted / temperature, torch.zeros_like(shifted))


def _check_arguments(
    model: LlamaLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int | None,
    eos_id: int | None,
) -> None:
    if not isinstance(model, LlamaLM):
        raise TypeError(f"model must be a LlamaLM (comera.workloads.llm.model), got {type(model).__name__}")
    vocab, context = model.config.vocab_size, model.config.max_seq_len
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (B, T) tensor of token ids with T >= 1, got {shape}")
    if input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must hold int64 token ids, got {input_ids.dtype}")
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        raise ValueError(
            f"input_ids must be token ids in [0, {vocab - 1}] (the model's vocabulary), got values in "
            f"[{int(input_ids.min())}, {int(input_ids.max())}]"
        )
    check_int(max_new_tokens, "max_new_tokens", 1)
    check_number(temperature, "temperature", 0.0)
    check_optional_int(top_k, "top_k", 1, vocab)
    if top_k is not None and temperature == 0:
        raise ValueError(
            f"top_k={top_k} needs sampling: give temperature > 0 with it, or leave top_k None (at "
            "temperature 0 decoding is greedy and top_k would change nothing)"
        )
    check_optional_int(seed, "seed", 0, _SEED_HIGH)
    check_optional_int(eos_id, "eos_id", 0, vocab - 1)
    length = input_ids.shape[1]
    if length + max_new_tokens > context:
        room = f"at most {context - length} new tokens" if length < context else "a prompt shorter than that"
        raise ValueError(
            f"the prompt's {length} tokens plus max_new_tokens ({max_new_tokens}) exceed the model's context "
            f"(max_seq_len {context}); ask for {room}"
        )


@torch.no_grad()
def generate(
    model: LlamaLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Continue each prompt of ``input_ids`` by up to ``max_new_tokens`` tokens, one position per token; the
    model's mode is left as it is (call ``model.eval()`` first).

    Args:
        model: the decoder, dense or tensorized, before or after :func:`comera.prune_`.
        input_ids: the prompts, ``(B, T)`` int64 ids in ``[0, vocab_size)``, ``T >= 1``.
        max_new_tokens: tokens to add, >= 1, with ``T + max_new_tokens <= max_seq_len`` (else
            ``ValueError``: the context is not slid).
        temperature: 0 for greedy decoding, else > 0 to sample from ``softmax(logits / temperature)``.
        top_k: when sampling, draw only among the ``top_k`` most likely tokens (``1 <= top_k <= vocab_size``);
            None for all. Refused at ``temperature`` 0 (``ValueError``).
        seed: seed of the sampling generator, in ``[0, 2**64 - 1]``; None draws a fresh seed. The global
            random state is never used nor changed.
        eos_id: a token that ends a sequence (generation stops once every sequence has produced it, an ended
            sequence is filled with it); None: always ``max_new_tokens`` tokens.

    Returns:
        ``(B, T + N)`` int64: the prompts followed by ``N <= max_new_tokens`` new tokens each.
    """
    _check_arguments(model, input_ids, max_new_tokens, temperature, top_k, seed, eos_id)
    batch, length = input_ids.shape
    generator = torch.Generator(device=input_ids.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    cache = model.new_cache(batch, length + max_new_tokens)
    logits = model(input_ids, cache)[:, -1]
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    pieces = [input_ids]
    for step in range(max_new_tokens):
        token = next_tokens(logits, float(temperature), top_k, generator)
        if eos_id is not None:
            token = token.masked_fill(finished, eos_id)
            finished |= token == eos_id
        pieces.append(token[:, None])
        if step + 1 == max_new_tokens or (eos_id is not None and bool(finished.all())):
            break
        logits = model(token[:, None], cache)[:, -1]
    return torch.cat(pieces, dim=1)
