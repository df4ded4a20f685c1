"""save_pretrained / load_pretrained: exact round trips after pruning, base models, clear errors."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import comera
from comera import (
    TTLinear,
    compression_report,
    load_pretrained,
    prune_,
    register_model,
    save_pretrained,
    tensorize_,
)
from comera.io import CONFIG_NAME, MODEL_ATTRIBUTE, WEIGHTS_NAME
from comera.tt.shapes import resolve_ranks


class Net(nn.Module):
    def __init__(self, vocab=40, width=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(torch.tanh(self.mix(h)) * self.gate(h))


def _pruned_model():
    torch.manual_seed(0)
    model = tensorize_(Net().double(), rank=4, embeddings=True, format="ttm")
    with torch.no_grad():
        model.mix.gates[0][[0, 2]] = 0.0
        model.embed.gates[0][1] = 0.0
        model.gate.gates[0].zero_()
        model.gate.bias.normal_()
    prune_(model)
    return model


def test_round_trip_after_pruning_reproduces_outputs(tmp_path):
    model = _pruned_model()
    ids = torch.randint(0, 40, (3, 7))
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["layers"]["mix"]["rank"] == list(model.mix.max_ranks)
    assert config["layers"]["gate"]["kind"] == "RemovedLinear"
    assert config["dtype"] == "float64" and config["library_version"]
    assert not list(tmp_path.glob("*.tmp"))
    loaded = load_pretrained(tmp_path, base_model=Net().double())
    assert torch.equal(loaded(ids), model(ids))
    assert loaded.head.embedding is loaded.embed
    assert str(compression_report(loaded)) == str(compression_report(model))


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.table = nn.Embedding(64, 32)

    def forward(self, ids):
        return self.proj(self.table(ids))


@pytest.mark.parametrize("tensorized", ["proj", "table"])
def test_a_bond_pruned_past_what_its_neighbour_can_use_loads_with_its_stored_rank(tmp_path, tensorized):
    """Pruning trims each bond by its own gates: with a bond cut to 1, its neighbour keeps more directions
    than that rank times the core between them can use, a rank the constructor would clip (the TT layer's
    last bond cut: 8 beside 1 on a mode of 4; the TTM table's first: 12 beside 1 on a core of 2 x 4). The
    save records the stored ranks; the load rebuilds exactly those shapes and the same outputs."""
    torch.manual_seed(0)
    if tensorized == "proj":
        shapes = {"proj": {"in_shape": (2, 4, 4), "out_shape": (4, 2, 4)}}
        model = tensorize_(Projection().double(), target_modules=["proj"], rank=8, shape_pattern=shapes)
        cut = -1
    else:
        shapes = {"table": {"row_shape": (2, 4, 4, 2), "col_shape": (2, 2, 4, 2)}}
        model = tensorize_(
            Projection().double(),
            target_modules=["proj"],
            exclude_modules=["proj"],
            embeddings=["table"],
            rank=12,
            shape_pattern=shapes,
        )
        cut = 0
    layer = getattr(model, tensorized)
    with torch.no_grad():
        layer.gates[cut][1:] = 0.0
    prune_(model)
    ranks = layer.max_ranks
    assert ranks[cut] == 1 and resolve_ranks(ranks, layer.bond_sizes) != ranks
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, base_model=Projection().double())
    assert getattr(loaded, tensorized).max_ranks == ranks
    ids = torch.randint(0, 64, (3, 5))
    assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize(("rank", "ranks"), [(8, (2, 8, 2)), ([1, 2, 4, 2, 1], (2, 4, 2))])
def test_a_spec_whose_rank_is_an_int_or_boundary_inclusive_rebuilds_as_the_constructor_reads_it(rank, ranks):
    """``from_spec`` restores a sequence of stored ranks exactly, but an int still means the constructor's
    clipped ranks (8 on the edge bonds of modes 2 is 2), and the boundary-inclusive form its inner entries."""
    spec = {**TTLinear(8, 8, in_shape=(2, 4), out_shape=(4, 2), rank=2).spec(), "rank": rank}
    assert TTLinear.from_spec(spec).max_ranks == ranks


def test_registered_model_is_rebuilt_from_the_config(tmp_path):
    @register_model("test-io-net")
    class Registered(Net):
        pass

    model = Registered(vocab=24).double()
    setattr(model, MODEL_ATTRIBUTE, {"name": "test-io-net", "kwargs": {"vocab": 24}})
    tensorize_(model, rank=3)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    ids = torch.randint(0, 24, (2, 5))
    assert isinstance(loaded, Registered) and isinstance(loaded.mix, TTLinear)
    assert torch.equal(loaded(ids), model(ids))


def test_unregistered_model_needs_a_base_model(tmp_path):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    with pytest.raises(ValueError, match=rf"{CONFIG_NAME}.*'model'.*base_model"):
        load_pretrained(tmp_path)


def test_missing_files_raise_naming_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        load_pretrained(tmp_path, base_model=Net())
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        load_pretrained(tmp_path, base_model=Net())


def test_truncated_weights_raise(tmp_path):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    data = (tmp_path / WEIGHTS_NAME).read_bytes()
    (tmp_path / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{WEIGHTS_NAME}.*truncated or corrupt"):
        load_pretrained(tmp_path, base_model=Net())


def test_corrupt_or_incomplete_config_raises_naming_the_key(tmp_path):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    path = tmp_path / CONFIG_NAME
    config = json.loads(path.read_text())
    path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{CONFIG_NAME}: not valid JSON"):
        load_pretrained(tmp_path, base_model=Net())
    path.write_text(json.dumps({k: v for k, v in config.items() if k != "layers"}))
    with pytest.raises(ValueError, match=r"missing key 'layers'"):
        load_pretrained(tmp_path, base_model=Net())
    config["layers"]["mix"]["in_shape"] = [3, 5]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'layers\.mix'"):
        load_pretrained(tmp_path, base_model=Net())


def test_weights_that_do_not_match_the_model_raise_naming_the_key(tmp_path):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    with pytest.raises(ValueError, match=rf"{WEIGHTS_NAME}: key 'embed.weight' has shape"):
        load_pretrained(tmp_path, base_model=Net(vocab=50))
    other = tmp_path / "other"
    model = tensorize_(Net(), rank=2)
    del model.gate
    model.gate = nn.Identity()
    save_pretrained(model, other)
    with pytest.raises(
        ValueError, match=rf"{WEIGHTS_NAME}: missing key 'gate\.weight' \(expected shape \(24, 24\)\)"
    ):
        load_pretrained(other, base_model=Net())


def test_hf_model_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.RobertaConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=200,
        max_position_embeddings=20,
    )
    torch.manual_seed(0)
    model = transformers.RobertaForMaskedLM(config).eval()
    tensorize_(model, rank=4, embeddings=["word_embeddings"])
    with torch.no_grad():
        model.roberta.encoder.layer[0].attention.self.query.gates[0][:2] = 0.0
    prune_(model)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, base_model=transformers.RobertaForMaskedLM(config).eval())
    ids = torch.randint(3, 200, (2, 8))
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def _sequential(rank):
    torch.manual_seed(rank)
    return tensorize_(nn.Sequential(nn.Linear(32, 64)), rank=rank)


def test_failed_save_over_an_existing_save_keeps_the_old_one(tmp_path):
    """Issue case: the weights used to be replaced before the config failed to encode."""
    folder, tmp_path = tmp_path, tmp_path / "save"
    old = _sequential(4)
    save_pretrained(old, tmp_path)
    new = _sequential(2)
    new.comera_model = {"name": "x", "kwargs": {"dtype": torch.float16}}
    with pytest.raises(TypeError, match="not JSON-serializable"):
        save_pretrained(new, tmp_path)
    loaded = load_pretrained(tmp_path, base_model=nn.Sequential(nn.Linear(32, 64)))
    x = torch.randn(3, 32)
    assert torch.equal(loaded(x), old(x))
    assert [path.name for path in folder.iterdir()] == ["save"]


def test_save_killed_while_writing_keeps_the_complete_old_save(tmp_path, monkeypatch):
    import comera.atomic

    folder, tmp_path = tmp_path, tmp_path / "save"
    tmp_path.mkdir()
    old = _sequential(4)
    (tmp_path / "tokenizer.json").write_text("{}")
    save_pretrained(old, tmp_path)
    real_fsync, calls = comera.atomic.os.fsync, []

    def failing_fsync(handle):
        calls.append(handle)
        if len(calls) == 2:  # after the first of the two files
            raise OSError("disk full")
        real_fsync(handle)

    monkeypatch.setattr(comera.atomic.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(_sequential(2), tmp_path)
    monkeypatch.undo()
    loaded = load_pretrained(tmp_path, base_model=nn.Sequential(nn.Linear(32, 64)))
    x = torch.randn(3, 32)
    assert torch.equal(loaded(x), old(x))
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    save_pretrained(_sequential(2), tmp_path)
    assert set(load_pretrained(tmp_path, base_model=nn.Sequential(nn.Linear(32, 64)))[0].max_ranks) == {2}
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    assert [path.name for path in folder.iterdir()] == ["save"]


def _snapshot(model):
    return {name: type(module) for name, module in model.named_modules()}, {
        key: value.clone() for key, value in model.state_dict().items()
    }


def test_failed_load_leaves_the_base_model_unchanged(tmp_path):
    """Issue case: with a truncated weights file the base's linears used to become random TT layers."""
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    data = (tmp_path / WEIGHTS_NAME).read_bytes()
    (tmp_path / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    base = Net()
    kinds, state = _snapshot(base)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_pretrained(tmp_path, base_model=base)
    assert _snapshot(base)[0] == kinds
    assert all(torch.equal(value, state[key]) for key, value in base.state_dict().items())


def test_load_with_a_weight_of_the_wrong_shape_leaves_the_base_unchanged(tmp_path):
    model = tensorize_(Net(), rank=2)
    save_pretrained(model, tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_NAME)
    tensors["mix.cores.0"] = torch.zeros(1, 2, 9)
    save_file(tensors, tmp_path / WEIGHTS_NAME)
    base = Net()
    kinds, _ = _snapshot(base)
    with pytest.raises(ValueError, match=r"key 'mix.cores.0' has shape \(1, 2, 9\)"):
        load_pretrained(tmp_path, base_model=base)
    assert _snapshot(base)[0] == kinds


class Other(Net):
    def __init__(self, change):
        super().__init__()
        if change == "type":
            self.mix = nn.Conv1d(24, 24, 1)
        elif change == "size":
            self.mix = nn.Linear(24, 30)
        elif change == "bias":
            self.mix = nn.Linear(24, 24, bias=False)
        else:
            del self.mix


@pytest.mark.parametrize(
    "change, match",
    [
        ("type", r"module 'mix': expected Linear with .* found Conv1d"),
        (
            "size",
            r"module 'mix': expected Linear attributes .*'out_features': 24.*found .*'out_features': 30",
        ),
        ("bias", r"module 'mix': expected Linear attributes .*'bias': True.*found .*'bias': False"),
        ("missing", r"the base model has no module 'mix' \(recorded: a TTLinear\)"),
    ],
)
def test_load_refuses_a_base_model_whose_module_does_not_match(tmp_path, change, match):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    base = Other(change)
    kinds, _ = _snapshot(base)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path, base_model=base)
    assert _snapshot(base)[0] == kinds


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("aliases", [], r"comera_config.json: key 'aliases' must be an object"),
        ("format_version", 0, r"comera_config.json: key 'format_version' is 0"),
        ("format_version", -5, r"key 'format_version' is -5"),
        ("format_version", True, r"key 'format_version' is True"),
        ("format_version", 99, r"key 'format_version' is 99"),
        ("dtype", "float99", r"key 'dtype' is 'float99'"),
        ("layers", {"mix": {"kind": "Nope"}}, r"key 'layers.mix.kind': unknown layer kind 'Nope'"),
        ("tensorize_configs", [{"rank": -1}], r"key 'tensorize_configs'"),
    ],
)
def test_malformed_config_values_are_refused_naming_the_file_and_key(tmp_path, key, value, match):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    path = tmp_path / CONFIG_NAME
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    base = Net()
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path, base_model=base)
    assert isinstance(base.mix, nn.Linear)


def test_a_shared_module_loads_as_one_layer_under_both_names(tmp_path):
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = self.a

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model = tensorize_(Shared(), rank=3)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path, base_model=Shared())
    assert loaded.a is loaded.b and isinstance(loaded.a, TTLinear)
    x = torch.randn(2, 16)
    assert torch.equal(loaded(x), model(x))


def test_a_save_of_an_earlier_format_is_refused_saying_what_to_do(tmp_path):
    """Format 1 (the layer kind under "type", the ranks under "ranks") is not converted: one line names the
    file, the key, the version read and the way on."""
    model = _pruned_model()
    save_pretrained(model, tmp_path)
    path = tmp_path / CONFIG_NAME
    config = json.loads(path.read_text())
    config["format_version"] = 1
    for spec in config["layers"].values():
        spec["type"] = spec.pop("kind")
    path.write_text(json.dumps(config))
    message = f"{path}: key 'format_version' is 1; comera {comera.__version__} reads version 2 only: save"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        load_pretrained(tmp_path, base_model=Net().double())


def test_registered_model_built_with_layers_loads_after_a_layer_was_removed(tmp_path):
    @register_model("test-io-built-with-layers")
    class Built(nn.Sequential):
        def __init__(self):
            super().__init__(TTLinear(16, 12, rank=3), nn.Tanh(), TTLinear(12, 4, rank=3))
            self.comera_model = {"name": "test-io-built-with-layers", "kwargs": {}}

    model = Built()
    with torch.no_grad():
        model[0].gates[0].zero_()
        model[2].gates[0][1:] = 0.0
    prune_(model)
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    x = torch.randn(2, 16)
    assert type(loaded[0]).__name__ == "RemovedLinear" and loaded[2].max_ranks == model[2].max_ranks
    assert torch.equal(loaded(x), model(x))


def test_saving_through_a_symlinked_folder_keeps_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    save_pretrained(_sequential(4), tmp_path / "link")
    second = _sequential(2)
    save_pretrained(second, tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "real"]
    loaded = load_pretrained(tmp_path / "real", base_model=nn.Sequential(nn.Linear(32, 64)))
    x = torch.randn(2, 32)
    assert torch.equal(loaded(x), second(x))
