"""The masked LM's training speed-ups against plain ``RobertaForMaskedLM``: scoring only the masked positions,
the ``"comera"`` attention implementation and the fast dropout.

References are independent of the code under test: Hugging Face's own forward (full logits, its loss, SDPA
attention) on the same weights in float64, and for the training-mode attention a reference written out here
from the same random draws.
"""

import pytest
import torch
from torch import nn
from transformers import RobertaForMaskedLM

import comera
from comera.models.dropout import FastDropout, keep_mask, quantized_p
from comera.workloads.mlm.hf_model import comera_attention
from comera.workloads.mlm.model import build_mlm_model, mlm_config
from comera.workloads.mlm.presets import TENSORIZE_PRESETS

VOCAB = 300


def _batch(seed=0, batch=3, length=14):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, -5:], mask[0, -5:] = 1, 0
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(batch, length, generator=generator) < 0.3
    chosen[0, -5:] = False
    labels[chosen] = torch.randint(5, VOCAB, (int(chosen.sum()),), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _plain_copy(model):
    """A ``RobertaForMaskedLM`` with SDPA and ``nn.Dropout``, holding the same weights."""
    plain = RobertaForMaskedLM(mlm_config("smoke", VOCAB, dropout=0.0)).to(torch.float64)
    plain.load_state_dict(model.state_dict())
    return plain


@pytest.mark.parametrize("tensorized", [False, True])
def test_masked_only_scores_equal_the_full_logits_at_the_masked_positions(tensorized):
    torch.manual_seed(0)
    model = build_mlm_model("smoke", VOCAB, dropout=0.0)
    if tensorized:
        comera.tensorize_(model, TENSORIZE_PRESETS["mlm-smoke"])
    model = model.to(torch.float64).train()
    batch = _batch()
    chosen = batch["labels"] != -100
    full = model(**batch)
    sparse = model(**batch, masked_only=True)
    assert sparse.logits.shape == (int(chosen.sum()), VOCAB)
    torch.testing.assert_close(sparse.logits, full.logits[chosen], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse.loss, full.loss, rtol=1e-12, atol=1e-12)
    params = [param for param in model.parameters() if param.requires_grad]
    sparse_grads = torch.autograd.grad(sparse.loss, params, allow_unused=True)
    full_grads = torch.autograd.grad(full.loss, params, allow_unused=True)
    for got, want in zip(sparse_grads, full_grads):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_masked_only_without_masked_tokens_is_a_zero_loss_that_reaches_no_parameter_with_a_gradient():
    model = build_mlm_model("smoke", VOCAB, dropout=0.0).to(torch.float64)
    batch = _batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    output = model(**batch, masked_only=True)
    assert output.logits.shape == (0, VOCAB)
    assert float(output.loss.detach()) == 0.0
    output.loss.backward()
    assert all(param.grad is None or not param.grad.any() for param in model.parameters())


def test_comera_attention_in_evaluation_equals_hugging_face_sdpa_with_padding():
    torch.manual_seed(1)
    model = build_mlm_model("smoke", VOCAB, dropout=0.1).to(torch.float64).eval()
    assert model.config._attn_implementation == "comera"
    plain = _plain_copy(model).eval()
    assert plain.config._attn_implementation == "sdpa"
    batch = _batch(seed=2)
    del batch["labels"]
    torch.testing.assert_close(model(**batch).logits, plain(**batch).logits, rtol=1e-12, atol=1e-12)


def test_training_attention_drops_probabilities_with_the_fast_mask_and_respects_padding():
    """The CPU training path against softmax-with-padding and the same keep mask written out here."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    allowed[1, :, :, 4:] = False
    module = nn.Module().train()
    torch.manual_seed(7)
    context, weights = comera_attention(module, q, k, v, allowed, scaling=0.3, dropout=0.2)
    assert weights is None
    torch.manual_seed(7)
    keep = keep_mask((2, 3, 6, 6), 0.2).double() / (1 - quantized_p(0.2))
    scores = (q @ k.transpose(-2, -1)) * 0.3
    scores = scores.masked_fill(~allowed, float("-inf"))
    expected = (scores.softmax(-1) * keep) @ v
    torch.testing.assert_close(context, expected.transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_fast_training_swaps_every_dropout_and_can_be_turned_off():
    fast = build_mlm_model("smoke", VOCAB, dropout=0.1)
    kinds = {type(module) for module in fast.modules()}
    assert nn.Dropout not in kinds and FastDropout in kinds
    assert all(module.p == 0.1 for module in fast.modules() if isinstance(module, FastDropout))
    plain = build_mlm_model("smoke", VOCAB, dropout=0.1, fast_training=False)
    assert FastDropout not in {type(module) for module in plain.modules()}
    assert plain.config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="fast_training must be a bool"):
        build_mlm_model("smoke", VOCAB, fast_training="yes")


def test_fast_dropout_in_training_keeps_the_documented_rate():
    torch.manual_seed(0)
    model = build_mlm_model("smoke", VOCAB, dropout=0.25).train()
    dropout = next(module for module in model.modules() if isinstance(module, FastDropout))
    out = dropout(torch.ones(400_000))
    dropped = float((out == 0).double().mean())
    q = quantized_p(0.25)
    # 6 binomial standard deviations
    assert abs(dropped - q) < 6 * (q * (1 - q) / 400_000) ** 0.5
    torch.testing.assert_close(out[out != 0], torch.full_like(out[out != 0], 1 / (1 - q)))


def test_positional_arguments_keep_the_parent_meaning():
    """``RobertaForMaskedLM.forward``'s third positional argument is ``token_type_ids``, not ``labels``."""
    model = build_mlm_model("smoke", VOCAB, dropout=0.0).to(torch.float64).eval()
    batch = _batch()
    types = torch.zeros_like(batch["input_ids"])
    positional = model(batch["input_ids"], batch["attention_mask"], types)
    keyword = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=types
    )
    assert positional.loss is None
    torch.testing.assert_close(positional.logits, keyword.logits)
    with pytest.raises(TypeError, match="by keyword"):
        model(batch["input_ids"], batch["attention_mask"], types, labels=batch["labels"], masked_only=True)
