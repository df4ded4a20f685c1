"""The RoBERTa masked LM of workload 3: tied TTM head, dense reconstruction, pruning, save/load, presets."""

import copy
import math

import pytest
import torch
from torch import nn
from transformers import RobertaForMaskedLM

import comera
from comera.tensorize_config import preset_names
from comera.workloads.mlm.model import MODEL_PRESETS, build_mlm_model, mlm_config
from comera.workloads.mlm.presets import TENSORIZE_PRESETS

VOCAB = 300


def _tensorized(dtype=torch.float64) -> RobertaForMaskedLM:
    model = build_mlm_model("smoke", VOCAB, dropout=0.0)
    comera.tensorize_(model, TENSORIZE_PRESETS["mlm-smoke"])
    return model.to(dtype).eval()


def _inputs(batch=3, length=20) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, VOCAB, (batch, length))
    mask = torch.ones_like(ids)
    ids[0, -4:] = 1
    mask[0, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _assert_tied(model: RobertaForMaskedLM) -> None:
    head = model.lm_head.decoder
    embedding = model.roberta.embeddings.word_embeddings
    assert isinstance(head, comera.TTMTiedHead)
    assert head.embedding is embedding
    assert all(a is b for a, b in zip(head.embedding.cores, embedding.cores))


def _bias_shared(model: RobertaForMaskedLM) -> bool:
    """RoBERTa keeps the decoder's bias also as ``lm_head.bias``: one parameter, two names."""
    return model.lm_head.bias is model.lm_head.decoder.bias


def test_presets_are_registered_and_sized():
    assert {"mlm-paper", "mlm-small", "mlm-smoke"} <= set(preset_names())
    config = mlm_config("paper", 50265)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (12, 768, 12)
    assert (config.intermediate_size, config.max_position_embeddings) == (3072, 512 + 2)
    assert set(MODEL_PRESETS) == {"paper", "small", "smoke"}


def test_tensorization_converts_every_linear_and_ties_the_head():
    model = _tensorized()
    _assert_tied(model)
    assert _bias_shared(model)
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    assert linears == []
    tt = [name for name, module in model.named_modules() if isinstance(module, comera.TTLinear)]
    assert len(tt) == 2 * 6 + 1
    assert isinstance(model.roberta.embeddings.word_embeddings, comera.TTMEmbedding)
    assert isinstance(model.roberta.embeddings.position_embeddings, nn.Embedding)


def test_tensorized_model_equals_its_dense_reconstruction_in_float64():
    model = _tensorized()
    dense = comera.untensorize_(copy.deepcopy(model))
    assert dense.lm_head.decoder.weight is dense.roberta.embeddings.word_embeddings.weight
    with torch.no_grad():
        expected = model.roberta.embeddings.word_embeddings.to_dense()
        torch.testing.assert_close(dense.lm_head.decoder.weight, expected, rtol=0, atol=0)
        batch = _inputs()
        got = model(**batch).logits
        want = dense(**batch).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_tied_head_logits_match_hidden_times_table_transpose():
    model = _tensorized()
    with torch.no_grad():
        hidden = torch.randn(4, 7, model.config.hidden_size, dtype=torch.float64)
        table = model.roberta.embeddings.word_embeddings.to_dense()
        want = hidden @ table.T + model.lm_head.bias
        torch.testing.assert_close(model.lm_head.decoder(hidden), want, rtol=1e-10, atol=1e-10)


def _kill_some_gates(model: RobertaForMaskedLM) -> None:
    with torch.no_grad():
        model.roberta.embeddings.word_embeddings.gates[0][:2] = 0.0
        model.roberta.encoder.layer[0].attention.self.query.gates[0][:1] = 0.0


def test_head_stays_tied_after_pruning_and_outputs_are_unchanged():
    model = _tensorized()
    _kill_some_gates(model)
    batch = _inputs()
    with torch.no_grad():
        before = model(**batch).logits
    ranks_before = model.roberta.embeddings.word_embeddings.max_ranks
    result = comera.prune_(model)
    assert "roberta.embeddings.word_embeddings" in [layer.name for layer in result.layers]
    ranks_after = model.roberta.embeddings.word_embeddings.max_ranks
    assert ranks_after[0] == ranks_before[0] - 2
    _assert_tied(model)
    assert _bias_shared(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, before, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("with_base_model", [False, True])
def test_head_stays_tied_after_save_and_load(tmp_path, with_base_model):
    model = _tensorized(torch.float32)
    _kill_some_gates(model)
    comera.prune_(model)
    comera.save_pretrained(model, tmp_path)
    base = build_mlm_model("smoke", VOCAB, dropout=0.0) if with_base_model else None
    loaded = comera.load_pretrained(tmp_path, base_model=base).eval()
    _assert_tied(loaded)
    embedding = loaded.roberta.embeddings.word_embeddings
    assert embedding.max_ranks == model.roberta.embeddings.word_embeddings.max_ranks
    batch = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


@pytest.mark.parametrize("operation", ["load", "untensorize"])
def test_lm_head_bias_stays_one_parameter(tmp_path, operation):
    model = _tensorized(torch.float32)
    if operation == "load":
        comera.save_pretrained(model, tmp_path)
        model = comera.load_pretrained(tmp_path)
    else:
        model = comera.untensorize_(model)
    assert _bias_shared(model)


def test_paper_preset_compresses_the_whole_model_at_least_4x():
    config = TENSORIZE_PRESETS["mlm-paper"]
    with torch.device("meta"):
        dense = RobertaForMaskedLM(mlm_config("paper", 50265))
    dense_total = sum(p.numel() for p in dense.parameters())
    compressed_total = dense_total
    for name, module in dense.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head.decoder":
            layer = comera.TTLinear(
                module.in_features, module.out_features, rank=config.rank_for(name), **config.shapes_for(name)
            )
            cores = sum(core.numel() for core in layer.cores)
            compressed_total -= module.weight.numel() - cores
    table = comera.TTMEmbedding(50265, 768, rank=config.rank_for("roberta.embeddings.word_embeddings"))
    compressed_total -= 50265 * 768 - sum(core.numel() for core in table.cores)
    assert dense_total > 124_000_000
    assert dense_total / compressed_total >= 4.0


def test_model_is_rebuilt_by_name_from_its_recorded_arguments():
    model = build_mlm_model("smoke", VOCAB, max_length=16)
    assert model.comera_model == {
        "name": "roberta-mlm",
        "kwargs": {
            "preset": "smoke",
            "vocab_size": VOCAB,
            "max_length": 16,
            "dropout": 0.1,
            "bos_token_id": 0,
            "pad_token_id": 1,
            "eos_token_id": 2,
            "fast_training": True,
        },
    }
    assert model.config.max_position_embeddings == 18
    assert math.isclose(model.config.hidden_dropout_prob, 0.1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"preset": "huge", "vocab_size": 100}, "preset must be one of"),
        ({"preset": "smoke", "vocab_size": 3}, "vocab_size must be an int >= 5"),
        ({"preset": "smoke", "vocab_size": 100, "max_length": 1}, "max_length"),
        ({"preset": "smoke", "vocab_size": 100, "dropout": 1.0}, r"dropout must be a float in \[0, 1\)"),
        (
            {"preset": "smoke", "vocab_size": 100, "pad_token_id": 100},
            r"pad_token_id must be an int in \[0, 99\]",
        ),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_mlm_model(**kwargs)
