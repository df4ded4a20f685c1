"""load_pretrained where a model is naturally loaded from: a base model built on the meta device, and a
fresh process that imported only ``comera``."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from comera import load_pretrained, save_pretrained, tensorize_


class TiedNet(nn.Module):
    """An embedding and a head sharing one weight, a mixing linear between them (the one tensorized)."""

    def __init__(self, vocab: int = 30, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _saved(tmp_path):
    torch.manual_seed(0)
    model = tensorize_(TiedNet(), rank=3, target_modules=["mix"])
    save_pretrained(model, tmp_path)
    return model


def test_a_meta_base_model_is_materialised_from_the_saved_weights(tmp_path):
    model = _saved(tmp_path)
    with torch.device("meta"):
        base = TiedNet()
    loaded = load_pretrained(tmp_path, base_model=base)
    assert loaded is base
    assert all(tensor.device.type == "cpu" for tensor in loaded.state_dict().values())
    assert loaded.head.weight is loaded.embed.weight, "the tie survives"
    ids = torch.randint(0, 30, (2, 5))
    assert torch.equal(loaded(ids), model(ids))


def test_a_meta_buffer_the_save_does_not_hold_is_refused_and_the_base_left_alone(tmp_path):
    _saved(tmp_path)
    with torch.device("meta"):
        base = TiedNet()
        base.register_buffer("scale", torch.ones(3), persistent=False)
    mix = base.mix
    with pytest.raises(ValueError, match=r"tensor 'scale' is on the meta device and the save does not hold"):
        load_pretrained(tmp_path, base_model=base)
    assert base.mix is mix and base.embed.weight.is_meta


def test_a_model_saved_from_a_builtin_class_loads_in_a_process_that_imported_only_comera(tmp_path):
    from comera.workloads.dlrm.model import DLRM

    torch.manual_seed(0)
    model = tensorize_(DLRM([20, 30], [4, 8], [8, 1]), rank=2, target_modules=["top.0"])
    save_pretrained(model, tmp_path)
    script = f"import comera; print(type(comera.load_pretrained({str(tmp_path)!r})).__name__)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DLRM"
