"""load_pretrained into a Hugging Face base built on the meta device whose non-persistent buffers (LLaMA's
rotary frequencies) are not in the save: the model's own ``_init_weights`` computes them."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import comera

CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    max_position_embeddings=32,
)


def test_unsaved_rotary_buffers_of_a_meta_base_are_computed(tmp_path):
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = comera.tensorize_(LlamaForCausalLM(config).eval(), rank=4)
    comera.save_pretrained(model, tmp_path)
    with torch.device("meta"):
        base = LlamaForCausalLM(config)
    loaded = comera.load_pretrained(tmp_path, base_model=base).eval()
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    rotary = loaded.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, model.model.rotary_emb.inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(
        rotary.original_inv_freq, model.model.rotary_emb.original_inv_freq, rtol=0, atol=0
    )
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_failed_load_leaves_the_meta_base_untouched(tmp_path):
    config = LlamaConfig(**CONFIG)
    comera.save_pretrained(comera.tensorize_(LlamaForCausalLM(config), rank=4), tmp_path)
    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "vocab_size": 256}))
    with pytest.raises(ValueError, match="embed_tokens"):
        comera.load_pretrained(tmp_path, base_model=base)
    assert base.model.rotary_emb.inv_freq.is_meta and base.model.embed_tokens.weight.is_meta
