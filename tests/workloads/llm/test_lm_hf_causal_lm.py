"""Hugging Face causal LMs (``LlamaForCausalLM``, ``GPT2LMHeadModel``) through tensorize_: built for real or
on the meta device, tied heads kept tied, trained, saved and loaded into a fresh base with the same logits and
the same greedy generation."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import comera
from comera.tensorize_config import tensorize_preset
from comera.workloads.llm import presets  # noqa: F401  (registers llm-hf-llama and llm-hf-gpt2)

VOCAB = 128
LLAMA = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
GPT2 = dict(
    vocab_size=VOCAB,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
CASES = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**LLAMA, tie_word_embeddings=False), "llm-hf-llama"),
    "llama-tied": (LlamaForCausalLM, lambda: LlamaConfig(**LLAMA, tie_word_embeddings=True), "llm-hf-llama"),
    "gpt2": (GPT2LMHeadModel, lambda: GPT2Config(**GPT2), "llm-hf-gpt2"),
}


def build(case: str, meta: bool):
    cls, config, _ = CASES[case]
    if meta:
        with torch.device("meta"):
            return cls(config())
    return cls(config())


def tensorized(case: str, meta: bool):
    torch.manual_seed(0)
    model = comera.tensorize_(build(case, meta), tensorize_preset(CASES[case][2], rank=4))
    return comera.materialize_(model) if meta else model


def embedding_and_head(model):
    return model.get_input_embeddings(), model.lm_head


def batch(length=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    period = torch.randint(3, VOCAB, (4,), generator=generator)
    ids = period.repeat(length // 4)[None, :].repeat(4, 1)  # a repeating sequence: learnable in a few steps
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
@pytest.mark.parametrize("case", list(CASES))
def test_projections_and_embedding_are_converted_and_a_tied_head_stays_tied(case, meta):
    model = tensorized(case, meta)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    embedding, head = embedding_and_head(model)
    assert isinstance(embedding, comera.TTMEmbedding)
    tied = case != "llama"
    if tied:
        assert isinstance(head, comera.TTMTiedHead) and head.embedding is embedding
    else:
        assert isinstance(head, comera.TTLinear)
    converted = [
        name for name, m in model.named_modules() if isinstance(m, comera.TTLinear) and name != "lm_head"
    ]
    assert len(converted) == (2 * 7 if case.startswith("llama") else 2 * 4)
    if case.startswith("llama"):
        reference = build(case, meta=False)
        torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
@pytest.mark.parametrize("case", list(CASES))
def test_training_lowers_the_loss(case, meta):
    model = tensorized(case, meta).train()
    ids, mask = batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.15)
    assert losses[-1] < 0.5 * losses[0]
    embedding, head = embedding_and_head(model)
    assert case == "llama" or head.embedding is embedding  # training does not untie


@pytest.mark.parametrize("meta_base", [False, True], ids=["real-base", "meta-base"])
@pytest.mark.parametrize("case", list(CASES))
def test_save_then_load_into_a_fresh_base_gives_the_same_logits_and_generation(tmp_path, case, meta_base):
    model = tensorized(case, meta=False).train()
    ids, mask = batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(5):  # move away from the initialisation so that a load that misses a tensor shows
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    comera.save_pretrained(model, tmp_path)
    loaded = comera.load_pretrained(tmp_path, base_model=build(case, meta=meta_base)).eval()
    embedding, head = embedding_and_head(loaded)
    assert case == "llama" or head.embedding is embedding
    prompt, prompt_mask = ids[:2, :5], mask[:2, :5]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        options = dict(attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        expected = model.generate(prompt, **options)
        got = loaded.generate(prompt, **options)
    assert expected.shape == (2, 11)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
