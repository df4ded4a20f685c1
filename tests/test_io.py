"""save_pretrained / load_pretrained: exact round trips after pruning, base models, clear errors."""

import json

import pytest
import torch
from torch import nn

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
    with pytest.raises(ValueError, match=rf"{WEIGHTS_NAME}: missing key 'gate"):
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
