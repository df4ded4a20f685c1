"""The tensorization presets of the language-model workload: what they convert, their layouts and sizes."""

import math

import pytest
import torch
from torch import nn

import comera
from comera.tensorize_config import preset_names, tensorize_preset
from comera.workloads.llm.model import LlamaLM
from comera.workloads.llm.presets import RECIPE_PRESETS

TARGETS = ("attention.q", "attention.k", "attention.v", "attention.o", "mlp.gate", "mlp.up", "mlp.down")


def tensorized(preset: str, **overrides) -> LlamaLM:
    with torch.device("meta"):
        model = LlamaLM.from_preset(preset, **overrides)
    comera.tensorize_(model, tensorize_preset(f"llm-{preset}"))
    return comera.materialize_(model)


def test_presets_are_registered_when_the_model_module_is_imported():
    assert {"llm-paper", "llm-small", "llm-smoke", "llm-hf-llama", "llm-hf-gpt2"} <= set(preset_names())


@pytest.mark.parametrize("preset", ["paper", "smoke"])
@pytest.mark.parametrize("tie", [False, True])
def test_every_projection_becomes_tt_and_the_embedding_ttm(preset, tie):
    model = tensorized(preset, tie_embeddings=tie)
    assert [name for name, m in model.named_modules() if isinstance(m, nn.Linear)] == []
    for block in model.blocks:
        for name in TARGETS:
            assert isinstance(block.get_submodule(name), comera.TTLinear), name
    assert isinstance(model.embed, comera.TTMEmbedding)
    if tie:
        assert isinstance(model.lm_head, comera.TTMTiedHead) and model.lm_head.embedding is model.embed
    else:
        assert isinstance(model.lm_head, comera.TTLinear)


@pytest.mark.parametrize("tie", [False, True])
def test_the_small_preset_makes_the_projections_ttm_and_keeps_embedding_and_head_dense(tie):
    model = tensorized("small", tie_embeddings=tie)
    assert [name for name, m in model.named_modules() if isinstance(m, nn.Linear)] == ["lm_head"]
    assert type(model.embed) is nn.Embedding
    if tie:
        assert model.lm_head.weight is model.embed.weight
    for block in model.blocks:
        for name in TARGETS:
            layer = block.get_submodule(name)
            assert isinstance(layer, comera.TTMLinear), name
            assert max(layer.max_ranks) == 16
    up = model.blocks[0].mlp.up
    assert (up.in_shape, up.out_shape) == ((4, 4, 8), (4, 8, 11))


def test_paper_layouts_refactor_1376_exactly_and_keep_the_named_ranks():
    model = tensorized("paper")
    mlp = model.blocks[0].mlp
    assert (mlp.up.in_shape, mlp.up.out_shape) == ((8, 8, 8), (4, 8, 43))
    assert (mlp.down.in_shape, mlp.down.out_shape) == ((43, 8, 4), (8, 8, 8))
    assert math.prod(mlp.up.out_shape) == 1376 == math.prod(mlp.down.in_shape)  # no padding
    assert mlp.up.max_ranks == (8, 32, 32, 32, 32)
    assert model.embed.row_shape == (40, 20, 40) and model.embed.col_shape == (8, 8, 8)
    assert max(model.embed.max_ranks) == 32


def test_the_llm_md_table_of_1376_layouts_is_what_tt_linear_builds():
    def cores(out_shape):
        layer = comera.TTLinear(512, 1376, bias=False, in_shape=(8, 8, 8), out_shape=out_shape, rank=32)
        return sum(core.numel() for core in layer.cores), layer.max_ranks[-1]

    table = {(4, 8, 43): (23968, 32), (8, 11, 16): (24384, 16), (16, 11, 8): (29568, 8)}
    for layout, expected in table.items():
        assert cores(layout) == expected
    automatic = comera.TTLinear(512, 1376, bias=False, rank=32)
    assert automatic.out_shape == (17, 9, 9)
    assert (sum(core.numel() for core in automatic.cores), automatic.max_ranks[-1]) == (30385, 9)


@pytest.mark.parametrize("preset, at_least", [("paper", 5.0), ("small", 3.9)])
def test_tensorized_layers_are_compressed_at_least_5x(preset, at_least):
    """At the start ``paper`` is >= 5x, ``small`` (TTM projections at rank 16, width 128) >= 3.9x; the late
    stage's target (a fraction of the size) takes both to >= 5x."""
    with torch.device("meta"):
        dense = LlamaLM.from_preset(preset)
    model = tensorized(preset)
    converted = {
        name
        for name, m in model.named_modules()
        if isinstance(m, (comera.TTLinear, comera.TTMLinear, comera.TTMEmbedding))
    }
    targeted = sum(module.weight.numel() for name, module in dense.named_modules() if name in converted)
    layers = [
        m for m in model.modules() if isinstance(m, (comera.TTLinear, comera.TTMLinear, comera.TTMEmbedding))
    ]
    stored = sum(core.numel() for layer in layers for core in layer.cores)
    assert targeted / stored >= at_least
    target_ratio = RECIPE_PRESETS[preset]["method"]["comera"]["method"]["target_ratio"]
    assert targeted / (stored * target_ratio) >= 5.0


def test_a_tensorized_model_returns_logits_that_are_no_view():
    model = tensorized("smoke")
    ids = torch.randint(0, 96, (2, 8))
    logits = model(ids)
    assert logits._base is None  # FSDP2 warns when its root module returns a view
    logits.sum().backward()
    reference = tensorized("smoke")
    reference.load_state_dict(model.state_dict())
    assert torch.equal(reference(ids), logits.detach())
    assert all(param.grad is not None for param in model.parameters() if param.requires_grad)
