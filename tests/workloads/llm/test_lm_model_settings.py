"""The model's shape is a setting of the language-model and masked-LM runs: ``--set model.hidden_size=96``
and a TOML ``[model]`` section, checked before any data is read, recorded in ``config.json``, followed by the
tensorization preset (its foldings) or refused naming the size."""

import math

import pytest
import torch
from torch import nn

import comera
from comera.recipes.base import RecipeData, get_recipe
from comera.recipes.settings import check_recorded_settings, tensorize_config
from comera.recipes.spec import run_spec
from comera.workloads import load_recipe

PROJECTIONS = ("attention.q", "attention.k", "attention.v", "attention.o", "mlp.gate", "mlp.up", "mlp.down")


def _llm_data(vocab: int = 96, seq_len: int = 32) -> RecipeData:
    return RecipeData(
        train=[], evals={}, info={"vocab_size": vocab, "seq_len": seq_len, "special_ids": {"pad": 0}}
    )


@pytest.mark.parametrize(
    ("preset", "sizes"),
    [("smoke", (48, 3, 4, 120)), ("small", (96, 2, 4, 264)), ("small", (64, 1, 2, 176))],
)
def test_llm_sizes_build_the_model_and_the_preset_folds_its_widths(preset, sizes):
    load_recipe("llm")
    hidden, layers, heads, inner = sizes
    assignments = [
        f"model.hidden_size={hidden}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.intermediate_size={inner}",
    ]
    header = run_spec("llm", "comera", preset, assignments=assignments).header()
    model_section = header["settings"]["model"]
    assert [
        model_section[key] for key in ("hidden_size", "n_layers", "n_heads", "intermediate_size")
    ] == list(sizes)
    model = get_recipe("llm").build_model(model_section, _llm_data())
    assert (model.config.hidden_size, len(model.blocks), model.config.n_heads) == (hidden, layers, heads)
    assert model.blocks[0].mlp.gate.out_features == inner
    config = tensorize_config(header["settings"])
    comera.tensorize_(model, config)
    for block in model.blocks:
        for name in PROJECTIONS:
            layer = block.get_submodule(name)
            assert isinstance(layer, comera.TTMLinear if preset == "small" else comera.TTLinear), name
            assert math.prod(layer.in_shape) == layer.in_features, (name, layer.in_shape)
            assert math.prod(layer.out_shape) == layer.out_features, (name, layer.out_shape)
            assert min(layer.in_shape + layer.out_shape) >= 2
    logits = model(torch.randint(0, 96, (2, 8)))
    assert logits.shape == (2, 8, 96) and bool(torch.isfinite(logits).all())


def test_the_preset_sizes_give_the_preset_layouts_unchanged():
    load_recipe("llm")
    header = run_spec("llm", "comera", "small").header()
    assert tensorize_config(header["settings"]) == comera.tensorize_preset("llm-small")


@pytest.mark.parametrize(
    ("workload", "preset", "assignments", "message"),
    [
        ("llm", "small", ["model.hidden_size=100"], r"model.hidden_size \(100\) must be n_heads \(4\) times"),
        ("llm", "small", ["model.n_layers=0"], r"model.n_layers must be an int >= 1, got 0"),
        (
            "llm",
            "small",
            ["model.hidden_size=74", "model.n_heads=1"],
            r"model.hidden_size 74 cannot be folded",
        ),
        ("llm", "small", ["model.intermediate_size=37"], r"model.intermediate_size 37 cannot be folded"),
        ("llm", "small", ["model.hidden_size=96.5"], r"model.hidden_size must be of type int"),
        ("llm", "small", ["model.width=96"], r"unknown key model.width; valid keys of \[model\]"),
        (
            "mlm",
            "smoke",
            ["model.n_heads=3"],
            r"model.hidden_size \(32\) must be a multiple of n_heads \(3\)",
        ),
        ("mlm", "smoke", ["model.intermediate_size=0"], r"model.intermediate_size must be an int >= 1"),
        (
            "mlm",
            "small",
            ["model.hidden_size=262", "model.n_heads=2"],
            r"model.hidden_size 262 cannot be folded",
        ),
    ],
)
def test_a_bad_size_is_refused_by_name_before_any_data_is_read(workload, preset, assignments, message):
    load_recipe(workload)
    with pytest.raises(ValueError, match=message):
        run_spec(workload, "comera", preset, assignments=assignments).header()


def test_a_toml_model_section_sets_the_sizes(tmp_path):
    load_recipe("llm")
    config = tmp_path / "run.toml"
    config.write_text("[model]\nhidden_size = 64\nintermediate_size = 176\nn_heads = 2\n")
    settings = run_spec("llm", "dense", "small", config_file=config).header()["settings"]
    assert (settings["model"]["hidden_size"], settings["model"]["n_heads"]) == (64, 2)
    assert settings["model"]["n_layers"] == 4, "a size the file does not name stays the preset's"


def test_a_run_recorded_before_the_sizes_were_settings_is_refused_naming_them():
    load_recipe("llm")
    header = run_spec("llm", "comera", "small").header()
    assert check_recorded_settings(header, "config.json", "start again") is None
    recorded = {
        **header,
        "settings": {**header["settings"], "model": {"preset": "small", "tie_embeddings": False}},
    }
    with pytest.raises(
        ValueError, match=r"^config.json: settings written by an earlier comera \(missing model\."
    ):
        check_recorded_settings(recorded, "config.json", "start again")
    with pytest.raises(ValueError, match=r"model.hidden_size, .*; start again$"):
        check_recorded_settings(recorded, "config.json", "start again")


def test_mlm_sizes_build_the_model_and_fold_its_widths():
    load_recipe("mlm")
    assignments = [
        "model.hidden_size=48",
        "model.n_layers=1",
        "model.n_heads=3",
        "model.intermediate_size=96",
    ]
    header = run_spec("mlm", "comera", "smoke", assignments=assignments).header()
    data = RecipeData(
        train=[],
        evals={},
        info={"vocab_size": 300, "seq_len": 32, "special_ids": {"bos": 0, "pad": 1, "eos": 2}},
    )
    model = get_recipe("mlm").build_model(header["settings"]["model"], data)
    config = model.config
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.intermediate_size,
    ) == (
        48,
        1,
        3,
        96,
    )
    comera.tensorize_(model, tensorize_config(header["settings"]))
    layers = [module for module in model.modules() if isinstance(module, comera.TTLinear)]
    assert layers and all(math.prod(layer.in_shape) == layer.in_features for layer in layers)
    assert not [name for name, module in model.named_modules() if type(module) is nn.Linear]
