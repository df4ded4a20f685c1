"""The sentence-pair model's width is a setting (``--set model.d_model=96 --set model.d_ff=384``) that the
``nli-*`` tensorization presets follow: every projection and the word table fold the new widths exactly, in
as many modes as the preset's, or the run is refused naming the size before any data is read."""

import math

import pytest
import torch

import comera
from comera.recipes.base import RecipeData, get_recipe
from comera.recipes.settings import tensorize_config
from comera.recipes.spec import run_spec
from comera.workloads import load_recipe

PROJECTIONS = ("query", "key", "value", "output", "ffn_in", "ffn_out")


def _data(vocab: int = 300, max_length: int = 16) -> RecipeData:
    return RecipeData(
        train=[],
        evals={},
        info={"vocab_size": vocab, "max_length": max_length, "num_classes": 2, "pad_token_id": 0},
    )


@pytest.mark.parametrize(
    ("preset", "width", "ffn", "heads"),
    [("smoke", 48, 96, 4), ("smoke", 46, 92, 2), ("small", 96, 384, 4), ("small", 192, 520, 4)],
)
def test_the_preset_folds_a_new_width_exactly_and_the_model_trains_through_it(preset, width, ffn, heads):
    load_recipe("nli")
    assignments = [f"model.d_model={width}", f"model.d_ff={ffn}", f"model.n_heads={heads}"]
    header = run_spec("nli", "comera", preset, assignments=assignments).header()
    model = get_recipe("nli").build_model(header["settings"]["model"], _data())
    config = tensorize_config(header["settings"])
    comera.tensorize_(model, config)
    layers = {name: module for name, module in model.named_modules() if isinstance(module, comera.TTLinear)}
    for kind in PROJECTIONS:
        found = [layer for name, layer in layers.items() if name.endswith(kind)]
        assert found, kind
        for layer in found:
            assert math.prod(layer.in_shape) == layer.in_features, (kind, layer.in_shape)
            assert math.prod(layer.out_shape) == layer.out_features, (kind, layer.out_shape)
            assert min(layer.in_shape + layer.out_shape) >= 2
    table = next(m for m in model.modules() if isinstance(m, comera.TTMEmbedding))
    assert math.prod(table.col_shape) == width
    ids = torch.randint(1, 300, (2, 16))
    logits = model(ids, exact_match_ids=torch.zeros_like(ids))
    assert logits.shape[-1] == 2 and bool(torch.isfinite(logits).all())


def test_the_preset_sizes_give_the_preset_layouts_unchanged():
    load_recipe("nli")
    for preset in ("smoke", "small", "paper"):
        header = run_spec("nli", "comera", preset).header()
        assert tensorize_config(header["settings"]) == comera.tensorize_preset(f"nli-{preset}")


@pytest.mark.parametrize(
    ("assignments", "message"),
    [
        (["model.d_model=47", "model.n_heads=1"], r"model.d_model 47 cannot be folded into 2 modes"),
        (["model.d_ff=37"], r"model.d_ff 37 cannot be folded into 2 modes"),
    ],
)
def test_a_width_the_preset_cannot_fold_is_refused_by_name_before_any_data_is_read(assignments, message):
    load_recipe("nli")
    with pytest.raises(ValueError, match=message):
        run_spec("nli", "comera", "smoke", assignments=assignments).header()
