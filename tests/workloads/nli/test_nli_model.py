"""TransformerClassifier against Hugging Face BERT, its own tensorized form, and the padding contract."""

import copy
import re

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from comera import compression_report, load_pretrained, save_pretrained, tensorize_, untensorize_
from comera.models.dropout import keep_mask, quantized_p
from comera.tensorize_config import tensorize_preset
from comera.workloads.nli.model import (
    MODEL_PRESETS,
    SelfAttention,
    TransformerClassifier,
    TransformerConfig,
    padding_bias,
)
from comera.workloads.nli.presets import TENSORIZE_PRESETS

SMOKE = MODEL_PRESETS["smoke"]

# Hugging Face parameter names -> ours (applied in order).
_RENAMES = [
    (r"^bert\.embeddings\.word_embeddings\.", "embeddings.word."),
    (r"^bert\.embeddings\.position_embeddings\.", "embeddings.position."),
    (r"^bert\.embeddings\.token_type_embeddings\.", "embeddings.token_type."),
    (r"^bert\.embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^bert\.encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"blocks.\1.attention.\2."),
    (r"^bert\.encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attention.output."),
    (r"^bert\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"blocks.\1.attention_norm."),
    (r"^bert\.encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.ffn_in."),
    (r"^bert\.encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.ffn_out."),
    (r"^bert\.encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"blocks.\1.ffn_norm."),
    (r"^bert\.pooler\.dense\.", "pooler."),
]


def _our_name(hf_name: str) -> str:
    for pattern, replacement in _RENAMES:
        hf_name = re.sub(pattern, replacement, hf_name)
    return hf_name


def _batch(vocab: int, batch: int = 3, length: int = 9, lengths=(9, 6, 4)):
    ids = torch.randint(1, vocab, (batch, length))
    types = torch.zeros(batch, length, dtype=torch.long)
    types[:, length // 2 :] = 1
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids.masked_fill(mask == 0, 0), types * mask, mask


def test_dense_model_equals_hugging_face_bert_in_float64():
    config = BertConfig(
        vocab_size=SMOKE["vocab_size"],
        hidden_size=SMOKE["d_model"],
        num_hidden_layers=SMOKE["n_layers"],
        num_attention_heads=SMOKE["n_heads"],
        intermediate_size=SMOKE["d_ff"],
        max_position_embeddings=SMOKE["max_positions"],
        type_vocab_size=2,
        num_labels=SMOKE["num_classes"],
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        pad_token_id=0,
    )
    reference = BertForSequenceClassification(config).double().eval()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    ours = TransformerClassifier.from_preset("smoke").double().eval()
    state = {
        _our_name(name): value for name, value in reference.state_dict().items() if "position_ids" not in name
    }
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    ids, types, mask = _batch(SMOKE["vocab_size"])
    want = reference(input_ids=ids, token_type_ids=types, attention_mask=mask).logits
    got = ours(ids, token_type_ids=types, attention_mask=mask)
    assert got.shape == (3, SMOKE["num_classes"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_padding_does_not_change_the_real_tokens():
    model = TransformerClassifier.from_preset("smoke").double().eval()
    ids, types, mask = _batch(SMOKE["vocab_size"], batch=1, length=6, lengths=(6,))
    alone = model(ids, types, mask)
    padded_ids = torch.cat([ids, torch.randint(1, SMOKE["vocab_size"], (1, 5))], dim=1)
    padded_types = torch.cat([types, torch.ones(1, 5, dtype=torch.long)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded_ids, padded_types, padded_mask), alone, rtol=1e-12, atol=1e-12)
    unmasked = model(padded_ids, padded_types, torch.ones_like(padded_mask))
    assert not torch.allclose(unmasked, alone)


def test_training_attention_drops_probabilities_with_the_fast_mask():
    attention = SelfAttention(d_model=8, n_heads=2, attention_p=0.25).double().train()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    _, _, mask = _batch(10, batch=2, length=5, lengths=(5, 3))
    bias = padding_bias(mask, torch.float64)
    torch.manual_seed(7)
    got = attention(x, bias)
    torch.manual_seed(7)
    keep = keep_mask((2, 2, 5, 5), 0.25).double() / (1 - quantized_p(0.25))
    # b batch, h head, i query, j key, d head feature
    q, k, v = (
        layer(x).view(2, 5, 2, 4).transpose(1, 2)
        for layer in (attention.query, attention.key, attention.value)
    )
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / 2.0
    scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
    probs = scores.softmax(-1) * keep
    context = torch.einsum("bhij,bhjd->bihd", probs, v).reshape(2, 5, 8)
    torch.testing.assert_close(got, attention.output(context), rtol=1e-12, atol=1e-12)


def test_tensorized_smoke_preset_equals_its_dense_reconstruction():
    model = TransformerClassifier.from_preset("smoke").double().eval()
    tensorize_(model, TENSORIZE_PRESETS["nli-smoke"])
    dense = untensorize_(copy.deepcopy(model))
    assert not any(hasattr(m, "cores") for m in dense.modules())
    ids, types, mask = _batch(SMOKE["vocab_size"])
    torch.testing.assert_close(model(ids, types, mask), dense(ids, types, mask), rtol=1e-10, atol=1e-12)


def test_paper_preset_shapes_give_the_reference_parameter_counts():
    config = TENSORIZE_PRESETS["nli-paper"]
    assert config.shapes_for("embeddings.word") == {"row_shape": (16, 20, 10, 10), "col_shape": (4, 4, 8, 6)}
    assert config.shapes_for("blocks.3.attention.value") == {"in_shape": (12, 8, 8), "out_shape": (8, 8, 12)}
    assert config.shapes_for("blocks.0.ffn_out") == {"in_shape": (16, 16, 12), "out_shape": (8, 8, 12)}
    assert config.shapes_for("pooler") == {"in_shape": (12, 8, 8), "out_shape": (8, 8, 12)}
    assert config.rank_for("embeddings.word") == 32 and config.rank_for("blocks.5.ffn_in") == 30
    assert tensorize_preset("nli-paper") is config


def test_small_preset_compression_at_initialisation():
    model = TransformerClassifier.from_preset("small")
    report = compression_report(tensorize_(model, TENSORIZE_PRESETS["nli-small"]))
    assert report.tensorized_ratio > 20  # 21.2x at the initial ranks; the late stage halves the size


def test_save_and_load_rebuild_the_tensorized_model(tmp_path):
    model = TransformerClassifier.from_preset("smoke", vocab_size=50, num_classes=2).double().eval()
    tensorize_(model, TENSORIZE_PRESETS["nli-smoke"])
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path).eval()
    assert isinstance(loaded, TransformerClassifier) and loaded.config.vocab_size == 50
    ids, types, mask = _batch(50)
    torch.testing.assert_close(loaded(ids, types, mask), model(ids, types, mask), rtol=0, atol=0)


def test_fullgraph_compile_of_a_training_step_matches_eager():
    torch._dynamo.reset()
    model = TransformerClassifier.from_preset("smoke", n_layers=1)
    ids, types, mask = _batch(SMOKE["vocab_size"])

    def step():
        return model(ids, types, mask).logsumexp(-1).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    eager = step()
    torch.manual_seed(5)
    torch.testing.assert_close(compiled(), eager, rtol=1e-5, atol=1e-6)


def test_dropout_changes_the_output_in_training_only():
    model = TransformerClassifier.from_preset("smoke")
    ids, types, mask = _batch(SMOKE["vocab_size"])
    model.eval()
    assert torch.equal(model(ids, types, mask), model(ids, types, mask))
    model.train()
    assert not torch.equal(model(ids, types, mask), model(ids, types, mask))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 10, "n_heads": 3}, "multiple of n_heads"),
        ({"dropout": 1.0}, r"dropout must be a finite number in \[0.0, 1.0\)"),
        ({"pad_token_id": 96}, r"pad_token_id must be an int in \[0, 95\]"),
        ({"n_layers": 0}, "n_layers must be an int >= 1"),
        ({"hidden": 3}, "unknown TransformerClassifier argument"),
    ],
)
def test_bad_sizes_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerClassifier(**{**SMOKE, **kwargs})


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'paper', 'small', 'smoke'"):
        TransformerClassifier.from_preset("large")
    assert TransformerClassifier(config=TransformerConfig(**SMOKE)).config.d_model == 16


def test_training_step_compiles_fullgraph_and_equals_eager_with_the_same_draws():
    """Compiled training (plain-op attention, graph-break free) against eager training (blocked attention).

    With inductor's ``fallback_random`` both draw the dropout bytes from the same generator, so in float64
    outputs and gradients agree to rounding.
    """
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = TransformerClassifier.from_preset("smoke").double().train()
    ids, types, mask = _batch(SMOKE["vocab_size"])
    runs = []
    with inductor_config.patch(fallback_random=True):
        for forward in (torch.compile(model, fullgraph=True), model):
            torch.manual_seed(3)
            logits = forward(ids, types, mask)
            query_grad = torch.autograd.grad(logits.square().sum(), model.blocks[0].attention.query.weight)
            runs.append((logits, query_grad[0]))
    (compiled, compiled_grad), (eager, eager_grad) = runs
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-10, atol=1e-12)
    torch.manual_seed(4)
    assert not torch.allclose(model(ids, types, mask), eager)


def test_exact_match_embedding_adds_its_row_to_every_flagged_token():
    """With the flag table's row 0 at zero, flags of 0 give the model without the table; all flags 1 give
    that model with row 1 added to both token-type rows (the same addend at every position)."""
    torch.manual_seed(0)
    with_flags = TransformerClassifier.from_preset("smoke", exact_match=True).double().eval()
    plain = TransformerClassifier.from_preset("smoke").double().eval()
    state = {k: v for k, v in with_flags.state_dict().items() if not k.startswith("embeddings.exact_match")}
    plain.load_state_dict(state)
    with torch.no_grad():
        with_flags.embeddings.exact_match.weight[0].zero_()
    ids, types, mask = _batch(SMOKE["vocab_size"])
    zeros = torch.zeros_like(ids)
    torch.testing.assert_close(with_flags(ids, types, mask, zeros), plain(ids, types, mask), rtol=0, atol=0)
    with torch.no_grad():
        plain.embeddings.token_type.weight += with_flags.embeddings.exact_match.weight[1]
    torch.testing.assert_close(
        with_flags(ids, types, mask, torch.ones_like(ids)), plain(ids, types, mask), rtol=1e-12, atol=1e-12
    )


def test_exact_match_flags_are_required_when_built_with_them_and_ignored_otherwise():
    ids, types, mask = _batch(SMOKE["vocab_size"])
    with pytest.raises(ValueError, match="exact_match_ids is required"):
        TransformerClassifier.from_preset("smoke", exact_match=True)(ids, types, mask)
    plain = TransformerClassifier.from_preset("smoke").eval()
    torch.testing.assert_close(plain(ids, types, mask, torch.ones_like(ids)), plain(ids, types, mask))
    with pytest.raises(TypeError, match="exact_match must be a bool"):
        TransformerClassifier.from_preset("smoke", exact_match=1)
