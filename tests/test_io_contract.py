"""The written format and the error contract of save_pretrained / load_pretrained / register_model.

Written files are read back with ``json`` and ``safetensors`` (not through comera), and every refused load
is checked to leave the base model exactly as it was: the same module objects and the same tensors.
"""

import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from comera import load_pretrained, prune_, register_model, save_pretrained, tensorize_
from comera.io import CONFIG_NAME, FORMAT_VERSION, MODEL_ATTRIBUTE, WEIGHTS_NAME, read_saved
from comera.nn.layer import ComeraLayer
from comera.tensorize import tensorize_configs


class Tiny(nn.Module):
    """An embedding and a linear: the smallest model tensorize_ converts both of (TTM, rank 2)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 24)
        self.proj = nn.Linear(24, 24)

    def forward(self, ids):
        return self.proj(self.embed(ids))


class TiedTiny(Tiny):
    """``Tiny`` plus an output head sharing the embedding's table (it becomes a TTMTiedHead)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(24, 40)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(super().forward(ids)))


class HeadFirst(nn.Module):
    """A tied head declared before its embedding, so ``named_modules`` lists the head first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(24, 40)
        self.embed = nn.Embedding(40, 24)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def _tensorized(model_class=Tiny):
    return tensorize_(model_class(), rank=2, embeddings=True, format="ttm")


def _ids():
    return torch.randint(0, 40, (2, 5))


def _save(model, directory):
    save_pretrained(model, directory)
    return directory / CONFIG_NAME, json.loads((directory / CONFIG_NAME).read_text())


def _snapshot(model):
    """The module objects by name and a copy of every tensor, to check that a refused load changed nothing."""
    return dict(model.named_modules()), _tensors(model)


def _tensors(model):
    return {
        key: value.clone() for key, value in model.state_dict().items() if isinstance(value, torch.Tensor)
    }


def _assert_unchanged(model, snapshot):
    modules, state = snapshot
    now = dict(model.named_modules())
    assert now.keys() == modules.keys()
    assert all(now[name] is module for name, module in modules.items())
    current = _tensors(model)
    assert current.keys() == state.keys()
    assert all(torch.equal(current[key], value) for key, value in state.items())


# register_model


@pytest.mark.parametrize("name", ["", 7, None])
def test_register_model_refuses_a_name_that_is_not_a_non_empty_string(name):
    with pytest.raises(ValueError, match=rf"name must be a non-empty string, got {re.escape(repr(name))}$"):
        register_model(name)


# What save_pretrained writes


def _tied_sequential():
    """A plain (untensorized) model with a tied weight and the three persistent buffers of a BatchNorm1d."""
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6))
    model[2].weight = model[0].weight
    return model


def test_config_records_library_and_model_class(tmp_path):
    _, config = _save(_tied_sequential(), tmp_path)
    assert config["library"] == "comera"
    # type(root).__module__ + "." + __qualname__ of nn.Sequential
    assert config["model_class"] == "torch.nn.modules.container.Sequential"


def test_config_lists_exactly_the_persistent_buffers_not_tied_parameters(tmp_path):
    """The tied ``2.weight`` is a parameter under its second name, so it is not listed as a buffer."""
    _, config = _save(_tied_sequential(), tmp_path)
    assert config["buffers"] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert config["aliases"] == {"2.weight": "0.weight"}


def test_read_saved_maps_an_alias_to_its_stored_name(tmp_path):
    save_pretrained(_tied_sequential(), tmp_path)
    saved = read_saved(tmp_path)
    assert set(load_file(tmp_path / WEIGHTS_NAME)) == {key for key in saved.tensors if key != "2.weight"}
    assert saved.stored_name("2.weight") == "0.weight"
    assert saved.stored_name("0.weight") == "0.weight"
    assert saved.stored_name("1.running_mean") == "1.running_mean"


def test_config_file_is_two_space_indented_json_ending_in_a_newline(tmp_path):
    save_pretrained(_tensorized(), tmp_path)
    text = (tmp_path / CONFIG_NAME).read_text()
    lines = text.split("\n")
    assert lines[0] == "{"
    assert lines[1] == f'  "format_version": {FORMAT_VERSION},'
    assert lines[-2:] == ["}", ""]


def test_weights_file_carries_the_pt_format_metadata(tmp_path):
    """Other safetensors / Hugging Face tools read ``{"format": "pt"}`` to know the tensors are PyTorch's."""
    save_pretrained(_tensorized(), tmp_path)
    with safe_open(tmp_path / WEIGHTS_NAME, framework="pt") as weights:
        assert weights.metadata() == {"format": "pt"}


def test_a_shared_one_element_parameter_is_stored_once(tmp_path):
    model = nn.Sequential(nn.PReLU(), nn.PReLU())
    model[1].weight = model[0].weight
    _, config = _save(model, tmp_path)
    assert config["aliases"] == {"1.weight": "0.weight"}
    assert set(load_file(tmp_path / WEIGHTS_NAME)) == {"0.weight"}


class _TwoEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("first", torch.zeros(0))
        self.register_buffer("second", torch.zeros(0))


def test_distinct_empty_tensors_are_each_stored_not_aliased(tmp_path):
    """Empty tensors all report storage pointer 0; that must not make them look shared."""
    model = _TwoEmpty()
    assert model.first.untyped_storage().data_ptr() == model.second.untyped_storage().data_ptr()
    _, config = _save(model, tmp_path)
    assert config["aliases"] == {}
    assert set(load_file(tmp_path / WEIGHTS_NAME)) == {"first", "second"}


# What save_pretrained refuses (and then writes nothing)


def test_save_refuses_nan_in_the_config_and_writes_nothing(tmp_path):
    """JSON has no NaN: a config holding one would not be valid JSON for other readers."""
    model = _tensorized()
    setattr(model, MODEL_ATTRIBUTE, {"name": "x", "kwargs": {"scale": math.nan}})
    target = tmp_path / "save"
    with pytest.raises(TypeError, match=rf"cannot save to {re.escape(str(target))}: .*not JSON-serializable"):
        save_pretrained(model, target)
    assert list(tmp_path.iterdir()) == []


class _Pointer(ComeraLayer, nn.Module):
    """A layer whose spec names a module it holds outside the module tree."""

    kind = "TestIOContractPointer"

    def __init__(self, target):
        super().__init__()
        self._target = (target,)  # a tuple: not registered as a submodule

    def spec(self, name_of=None):
        return {"kind": self.kind, "target": name_of(self._target[0])}


@pytest.fixture
def pointer_kind(layer_registry):
    """``_Pointer`` registered for one test only."""
    layer_registry(_Pointer)


def test_save_refuses_a_layer_referring_to_a_module_outside_the_model(tmp_path, pointer_kind):
    model = nn.Sequential(nn.Linear(3, 3), _Pointer(nn.Identity()))
    target = tmp_path / "save"
    with pytest.raises(ValueError, match=r"^a layer refers to a Identity that is not part of the model$"):
        save_pretrained(model, target)
    assert list(tmp_path.iterdir()) == []


class _Unregistered(ComeraLayer, nn.Module):
    """A layer type never passed to register_layer: a save of it could not be loaded."""

    kind = "TestIOContractUnregistered"

    def spec(self, name_of=None):
        return {"kind": self.kind}


def test_save_refuses_an_unregistered_layer_kind_naming_the_config_path(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), _Unregistered())
    target = tmp_path / "save"
    path = re.escape(str(target / CONFIG_NAME))
    with pytest.raises(ValueError, match=rf"^{path}: key 'layers\.1\.kind': unknown layer kind"):
        save_pretrained(model, target)
    assert list(tmp_path.iterdir()) == []


# Malformed configs: ValueError naming the file and the key, and the base model untouched


def _edit(config, key, value):
    if key is None:
        return value
    if isinstance(key, tuple):
        config[key[0]][key[1]] = value
    else:
        config[key] = value
    return config


@pytest.mark.parametrize(
    "key, value, message",
    [
        (None, [], "expected a JSON object at the top level"),
        (
            "aliases",
            {"proj.weight": 1},
            r"key 'aliases' must be an object \{tensor name: stored tensor name\}",
        ),
        ("buffers", [1], "key 'buffers' must be a list of tensor names"),
        ("buffers", "proj.bias", "key 'buffers' must be a list of tensor names"),
        ("layers", [], r"key 'layers' must be an object \{module name: layer spec\}"),
        (("layers", "proj"), {}, r"key 'layers\.proj': a layer spec must be an object with a 'kind'"),
        ("tensorize_configs", {}, "key 'tensorize_configs' must be a list"),
    ],
)
def test_malformed_config_is_refused_naming_the_file_and_key(tmp_path, key, value, message):
    path, config = _save(_tensorized(), tmp_path)
    path.write_text(json.dumps(_edit(config, key, value)))
    base = Tiny()
    snapshot = _snapshot(base)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}$"):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)


def test_an_alias_of_a_tensor_missing_from_the_weights_is_refused_naming_both(tmp_path):
    path, config = _save(_tensorized(), tmp_path)
    config["aliases"] = {"extra.weight": "ghost.weight"}
    path.write_text(json.dumps(config))
    base = Tiny()
    snapshot = _snapshot(base)
    weights = re.escape(str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ValueError, match=rf"^{weights}: key 'ghost\.weight' \(aliased by 'extra\.weight'\)"):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)


def test_a_config_without_the_optional_buffers_key_loads(tmp_path):
    """``buffers`` is informational (for reports) and not required: configs without it still load."""
    model = _tensorized()
    path, config = _save(model, tmp_path)
    del config["buffers"]
    path.write_text(json.dumps(config))
    ids = _ids()
    assert torch.equal(load_pretrained(tmp_path, base_model=Tiny())(ids), model(ids))


def test_a_base_model_without_a_recorded_module_is_refused_naming_the_config(tmp_path):
    path, _ = _save(_tensorized(), tmp_path)
    base = Tiny()
    del base.proj
    snapshot = _snapshot(base)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: key 'layers\.proj': the base model has no module 'proj'"
    ):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)


def test_a_layer_spec_that_cannot_be_rebuilt_is_refused_naming_the_config(tmp_path):
    path, config = _save(_tensorized(), tmp_path)
    config["layers"]["proj"]["in_shape"] = [3, 5]  # 15 != in_features 24
    path.write_text(json.dumps(config))
    base = Tiny()
    snapshot = _snapshot(base)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: key 'layers\.proj': cannot rebuild the layer \("
    ):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)


def test_a_tied_head_whose_embedding_is_not_recorded_is_refused_naming_both(tmp_path):
    path, config = _save(_tensorized(TiedTiny), tmp_path)
    assert config["layers"]["head"]["embedding"] == "embed"
    del config["layers"]["embed"]
    path.write_text(json.dumps(config))
    base = TiedTiny()
    snapshot = _snapshot(base)
    message = (
        r"key 'layers\.head': cannot rebuild the layer "
        r"\(it refers to 'embed', which is not a recorded layer\)"
    )
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}$"):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)


def test_a_recorded_module_with_only_integer_parameters_is_refused_as_a_mismatch(tmp_path):
    """Placement takes the dtype of floating parameters only: an integer one must not become the layer's."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.count = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)

    path, _ = _save(_tensorized(), tmp_path)
    base = Tiny()
    base.proj = Counter()
    snapshot = _snapshot(base)
    with pytest.raises(
        ValueError, match=rf"^{re.escape(str(path))}: key 'layers\.proj': .*expected Linear .* found Counter$"
    ):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)


# Registered models (load_pretrained without base_model)


@register_model("test-io-contract-sequential")
def _registered_sequential():
    return nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 8))


def _registered_save(tmp_path, record):
    model = _registered_sequential()
    setattr(model, MODEL_ATTRIBUTE, record)
    tensorize_(model, rank=2, format="ttm")
    return model, *_save(model, tmp_path)


def test_an_unregistered_model_is_refused_naming_the_saved_class_and_the_remedy(tmp_path):
    path, _ = _save(tensorize_(nn.Sequential(nn.Linear(24, 24)), rank=2), tmp_path)
    message = (
        r"key 'model' names no registered comera model "
        r"\(saved from torch\.nn\.modules\.container\.Sequential\); pass base_model= the untensorized model"
    )
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}$"):
        load_pretrained(tmp_path)


def test_an_unknown_model_name_is_refused_listing_the_registered_ones(tmp_path):
    _, path, config = _registered_save(tmp_path, {"name": "test-io-contract-sequential", "kwargs": {}})
    config["model"]["name"] = "test-io-contract-missing"
    path.write_text(json.dumps(config))
    message = (
        r"key 'model\.name' is 'test-io-contract-missing', not a registered model; registered: \[.*\] "
        r"\(import the module that registers it with comera\.register_model\)"
    )
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}$") as raised:
        load_pretrained(tmp_path)
    assert "'test-io-contract-sequential'" in str(raised.value).rsplit("registered: ", 1)[1]


def test_model_kwargs_that_are_not_an_object_are_refused(tmp_path):
    _, path, config = _registered_save(tmp_path, {"name": "test-io-contract-sequential", "kwargs": {}})
    config["model"]["kwargs"] = [24]
    path.write_text(json.dumps(config))
    message = r"key 'model\.kwargs' must be an object of keyword arguments"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}$"):
        load_pretrained(tmp_path)


def test_a_registered_model_recorded_without_kwargs_loads_and_keeps_its_record(tmp_path):
    model, _, config = _registered_save(tmp_path, {"name": "test-io-contract-sequential"})
    loaded = load_pretrained(tmp_path)
    assert getattr(loaded, MODEL_ATTRIBUTE) == config["model"] == {"name": "test-io-contract-sequential"}
    x = torch.randn(3, 24)
    assert torch.equal(loaded(x), model(x))


@register_model("test-io-contract-head-first")
def _registered_head_first():
    return _tensorized(HeadFirst)


def test_a_registered_model_whose_tied_head_precedes_its_embedding_loads(tmp_path):
    """The head is recorded first; loading must rebuild the table it refers to before it."""
    model = _registered_head_first()
    setattr(model, MODEL_ATTRIBUTE, {"name": "test-io-contract-head-first", "kwargs": {}})
    _, config = _save(model, tmp_path)
    assert list(config["layers"]) == ["head", "head.embedding"]
    loaded = load_pretrained(tmp_path)
    assert loaded.head.embedding is loaded.embed
    ids = _ids()
    assert torch.equal(loaded(ids), model(ids))


# What a successful load restores


def test_load_restores_the_tensorize_configs_recorded_in_the_file(tmp_path):
    _, config = _save(_tensorized(), tmp_path)
    assert config["tensorize_configs"]
    loaded = load_pretrained(tmp_path, base_model=Tiny())
    assert [entry.to_dict() for entry in tensorize_configs(loaded)] == config["tensorize_configs"]


def _removed_embedding_model():
    """A float64 Tiny whose embedding was pruned away: a RemovedEmbedding holds no parameter."""
    model = _tensorized(lambda: Tiny().double())
    with torch.no_grad():
        model.embed.gates[0].zero_()
    prune_(model)
    assert type(model.embed).__name__ == "RemovedEmbedding" and not list(model.embed.parameters())
    return model


def test_reloading_into_a_pruned_model_keeps_the_saved_dtype_for_parameterless_layers(tmp_path):
    """The base's RemovedEmbedding has no parameter to take the dtype from: the saved dtype is used."""
    model = _removed_embedding_model()
    save_pretrained(model, tmp_path)
    pruned = load_pretrained(tmp_path, base_model=Tiny().double())
    reloaded = load_pretrained(tmp_path, base_model=pruned)
    ids = _ids()
    assert reloaded.embed(ids).dtype == torch.float64
    assert torch.equal(reloaded(ids), model(ids))


def test_layers_are_built_on_the_base_module_device_not_the_default_device(tmp_path):
    """Under a ``meta`` default device the rebuilt layers still follow the base model (on the CPU)."""
    model = _tensorized()
    save_pretrained(model, tmp_path)
    base = Tiny()
    with torch.device("meta"):
        loaded = load_pretrained(tmp_path, base_model=base)
    assert {tensor.device for tensor in loaded.state_dict().values()} == {torch.device("cpu")}
    ids = _ids()
    assert torch.equal(loaded(ids), model(ids))


# A load that fails after layers were swapped in


def test_an_interrupted_load_puts_the_original_modules_back(tmp_path):
    """The interrupt comes from loading the state dict, after every recorded layer was replaced."""
    save_pretrained(_tensorized(TiedTiny), tmp_path)
    base = TiedTiny()

    def interrupt(*args):
        raise KeyboardInterrupt("interrupted while loading the state dict")

    base.register_load_state_dict_pre_hook(interrupt)
    snapshot = _snapshot(base)
    with pytest.raises(KeyboardInterrupt, match="interrupted while loading the state dict"):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)
    assert base.head.weight is base.embed.weight


class _WithExtraState(Tiny):
    """Tiny with a submodule that expects extra state (``_extra_state``), which the save does not have."""

    def __init__(self):
        super().__init__()
        self.counter = _Counter()


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


def test_a_base_expecting_state_the_save_lacks_is_refused_and_left_unchanged(tmp_path):
    """The load is strict: a key the model expects but the file lacks is an error, not skipped."""
    save_pretrained(_tensorized(), tmp_path)
    base = _WithExtraState()
    snapshot = _snapshot(base)
    with pytest.raises(ValueError, match=r"missing key 'counter\._extra_state' \(any shape\)"):
        load_pretrained(tmp_path, base_model=base)
    _assert_unchanged(base, snapshot)
