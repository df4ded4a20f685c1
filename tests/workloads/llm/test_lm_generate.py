"""The key-value cache and generation of the LLaMA-style decoder, against the no-cache full forward."""

import math

import numpy as np
import pytest
import torch

import comera
from comera.nn.removed import RemovedLinear
from comera.tensorize_config import tensorize_preset
from comera.workloads.llm.cache import KVCache
from comera.workloads.llm.generate import generate, next_tokens
from comera.workloads.llm.model import LlamaLM

VOCAB = 96


def build(kind: str, dtype: torch.dtype = torch.float32) -> LlamaLM:
    """A smoke model: ``dense``, ``tt`` (tensorized, untied head), ``tt-tied`` or ``pruned`` (tensorized,
    tied head, some ranks cut and one projection removed by comera.prune_)."""
    torch.manual_seed(0)
    model = LlamaLM.from_preset("smoke", tie_embeddings=kind in ("tt-tied", "pruned"))
    if kind != "dense":
        comera.tensorize_(model, tensorize_preset("llm-smoke"))
    if kind == "pruned":
        with torch.no_grad():
            model.blocks[0].attention.q.gates[0][:2] = 0.0
            model.embed.gates[0][:1] = 0.0
            for gate in model.blocks[1].mlp.up.gates:
                gate.zero_()
        comera.prune_(model)
        assert isinstance(model.blocks[1].mlp.up, RemovedLinear)
        assert model.blocks[0].attention.q.max_ranks[0] == 2
    return model.to(dtype).eval()


def prompts(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy_without_cache(model: LlamaLM, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The reference: each step re-runs the full prefix and takes the most likely last token."""
    ids = input_ids
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


KINDS = ["dense", "tt", "tt-tied", "pruned"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_logits_through_the_cache_equal_the_full_forward(kind, dtype, tolerance):
    """Chunks of several positions (a causal mask after cached ones) and single positions, at their absolute
    rotary positions, give the logits of the whole sequence's forward."""
    model = build(kind, dtype)
    ids = prompts(3, 20)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(3)
        pieces = [model(ids[:, :7], cache), model(ids[:, 7:12], cache)]
        pieces += [model(ids[:, t : t + 1], cache) for t in range(12, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=tolerance)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_with_the_cache_equals_the_no_cache_reference_exactly(kind):
    model = build(kind)
    ids = prompts(3, 5)
    got = generate(model, ids, 20)
    assert got.shape == (3, 25) and torch.equal(got[:, :5], ids)
    assert torch.equal(got, greedy_without_cache(model, ids, 20))


@pytest.mark.parametrize("kind", ["dense", "pruned"])
def test_each_new_token_costs_one_position(kind):
    """The first projection and the embedding see the prompt once, then one row per sequence and step."""
    model = build(kind)
    seen = {"q": 0, "embed": 0}

    def counter(name):
        def hook(module, args):
            seen[name] += args[0].shape[:-1].numel() if name == "q" else args[0].numel()

        return hook

    model.blocks[0].attention.q.register_forward_pre_hook(counter("q"))
    model.embed.register_forward_pre_hook(counter("embed"))
    batch, length, new = 2, 7, 9
    generate(model, prompts(batch, length), new)
    assert seen == {"q": batch * (length + new - 1), "embed": batch * (length + new - 1)}


def test_sampling_is_reproducible_with_a_seed_and_varies_without():
    model = build("tt")
    ids = prompts(2, 4)
    state = torch.get_rng_state()
    first = generate(model, ids, 24, temperature=1.0, seed=7)
    assert torch.equal(first, generate(model, ids, 24, temperature=1.0, seed=7))
    assert not torch.equal(first, generate(model, ids, 24, temperature=1.0, seed=8))
    assert not torch.equal(
        generate(model, ids, 24, temperature=1.0), generate(model, ids, 24, temperature=1.0)
    )
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is neither used nor moved
    assert not torch.equal(first, generate(model, ids, 24))  # sampling is not greedy at temperature 1


@pytest.mark.parametrize("kind", ["dense", "tt-tied"])
def test_top_k_one_is_greedy(kind):
    model = build(kind)
    ids = prompts(2, 4)
    sampled = generate(model, ids, 16, temperature=2.0, top_k=1, seed=3)
    assert torch.equal(sampled, generate(model, ids, 16))


def test_draws_follow_the_tempered_softmax_over_the_top_k():
    """Frequencies of 20000 draws against the probabilities computed with numpy (4 standard errors)."""
    logits_row = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    temperature, top_k, draws = 0.7, 4, 20000
    kept = np.argsort(-logits_row)[:top_k]
    expected = np.zeros_like(logits_row)
    weights = np.exp(logits_row[kept] / temperature)
    expected[kept] = weights / weights.sum()
    logits = torch.tensor(logits_row).repeat(draws, 1)
    tokens = next_tokens(logits, temperature, top_k, torch.Generator().manual_seed(0))
    frequencies = np.bincount(tokens.numpy(), minlength=len(logits_row)) / draws
    error = np.sqrt(expected * (1 - expected) / draws)
    assert np.all(np.abs(frequencies - expected) <= 4 * error + 1e-12), (frequencies, expected)
    assert set(np.flatnonzero(frequencies)) == set(kept)


def test_eos_stops_generation_and_fills_finished_sequences():
    model = build("dense")
    ids = prompts(2, 5)
    reference = greedy_without_cache(model, ids, 12)
    eos = int(reference[0, 5 + 3])  # the first sequence's fourth new token
    if eos in reference[0, 5 : 5 + 3].tolist():
        pytest.fail("the chosen end token appears earlier; pick another position")
    alone = generate(model, ids[:1], 12, eos_id=eos)
    assert torch.equal(alone, reference[:1, : 5 + 4])  # stops right after producing it
    both = generate(model, ids, 12, eos_id=eos)
    row_two = reference[1, 5:].tolist()
    if eos in row_two:
        stop = row_two.index(eos) + 1
        assert both.shape[1] == 5 + max(4, stop)
    else:
        assert both.shape[1] == 5 + 12
        assert torch.equal(both[1], reference[1])
    assert torch.equal(both[0, : 5 + 4], reference[0, : 5 + 4])
    assert (both[0, 5 + 4 :] == eos).all()


def test_the_context_is_refused_not_slid():
    model = build("dense")  # max_seq_len 32
    assert generate(model, prompts(1, 30), 2).shape == (1, 32)
    with pytest.raises(
        ValueError,
        match=r"prompt's 30 tokens plus max_new_tokens \(3\) exceed .*max_seq_len "
        r"32\); ask for at most 2 new tokens",
    ):
        generate(model, prompts(1, 30), 3)
    with pytest.raises(ValueError, match="ask for a prompt shorter than that"):
        generate(model, prompts(1, 32), 1)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ({"max_new_tokens": 0}, ValueError, r"max_new_tokens must be an int >= 1, got 0"),
        ({"max_new_tokens": 2.0}, ValueError, r"max_new_tokens must be an int >= 1"),
        ({"temperature": -0.5}, ValueError, r"temperature must be a finite number in \[0.0, inf\)"),
        ({"temperature": math.inf}, ValueError, r"temperature must be a finite number"),
        ({"top_k": 0}, ValueError, r"top_k must be an int in \[1, 96\], got 0"),
        ({"top_k": 97}, ValueError, r"top_k must be an int in \[1, 96\], got 97"),
        ({"seed": -1}, ValueError, r"seed must be an int in \[0, 18446744073709551615\]"),
        ({"eos_id": 96}, ValueError, r"eos_id must be an int in \[0, 95\]"),
        (
            {"input_ids": torch.zeros(4, dtype=torch.int64)},
            ValueError,
            r"input_ids must be a \(B, T\) tensor",
        ),
        ({"input_ids": torch.zeros(1, 0, dtype=torch.int64)}, ValueError, r"T >= 1, got \(1, 0\)"),
        ({"input_ids": torch.zeros(1, 3)}, ValueError, r"input_ids must hold int64 token ids"),
        (
            {"input_ids": torch.tensor([[1, 96]])},
            ValueError,
            r"token ids in \[0, 95\].*got values in \[1, 96\]",
        ),
        ({"model": torch.nn.Linear(2, 2)}, TypeError, r"model must be a LlamaLM .*got Linear"),
    ],
)
def test_bad_arguments_are_named_with_their_valid_range(arguments, error, match):
    call = {"model": build("dense"), "input_ids": prompts(1, 3), "max_new_tokens": 4, **arguments}
    with pytest.raises(error, match=match):
        generate(**call)


def test_the_cache_refuses_what_does_not_fit():
    model = build("dense")
    with pytest.raises(ValueError, match=r"max_length must be an int in \[1, 32\], got 33"):
        model.new_cache(1, 33)
    cache = model.new_cache(2, 8)
    with torch.no_grad():
        model(prompts(2, 6), cache)
        with pytest.raises(ValueError, match="input_ids has 1 sequences but the cache was made for 2"):
            model(prompts(1, 1), cache)
        with pytest.raises(ValueError, match="the cache holds 6 of at most 8 positions: 3 more do not fit"):
            model(prompts(2, 3), cache)
        assert cache.length == 6  # a refused step leaves the cache as it was
    full = model.new_cache(1)
    with torch.no_grad():
        model(prompts(1, 30), full)
        with pytest.raises(ValueError, match=r"1 <= T <= max_seq_len \(32\) - the cache's 30 positions"):
            model(prompts(1, 3), full)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        KVCache(2, 1, 4, 0, 8)


def test_the_cache_mask_lets_each_new_position_see_the_keys_up_to_itself():
    cache = KVCache(1, 1, 1, 2, 10)
    cache.advance(3)
    mask = cache.causal_mask(4)
    expected = torch.tensor([[key <= 3 + row for key in range(7)] for row in range(4)])
    assert torch.equal(mask, expected)
    assert cache.causal_mask(1) is None


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324, 1e-30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("top_k", [None, 3])
def test_a_tiny_temperature_draws_the_most_likely_token(temperature, dtype, top_k):
    """However small the temperature (below float32's smallest number, down to the smallest double), the
    draw is well defined and is the argmax, as the limit of the tempered softmax is."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[:, 7] = logits.float().amax() + 1  # one clear maximum per row whatever the rounding
    tokens = next_tokens(logits, temperature, top_k, torch.Generator().manual_seed(1))
    assert torch.equal(tokens, torch.full((64,), 7))


def test_a_tiny_temperature_generates_the_greedy_continuation():
    model = build("tt-tied")
    ids = prompts(2, 4)
    assert torch.equal(generate(model, ids, 12, temperature=1e-45, seed=0), generate(model, ids, 12))


def test_top_k_without_sampling_is_refused_naming_both():
    model = build("dense")
    with pytest.raises(ValueError, match=r"top_k=5 needs sampling: give temperature > 0 with it"):
        generate(model, prompts(1, 4), 2, top_k=5)
