"""load_pretrained rejects weights it does not expect with the documented ValueError naming file and key.

The weights files are edited directly with safetensors (the writer under test is not involved), so the stray
tensors are exactly the ones the test adds.
"""

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from comera import load_pretrained, save_pretrained, tensorize_
from comera.io import WEIGHTS_NAME


class Net(nn.Module):
    def __init__(self, width=12):
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(x)))


def _add_tensors(path, extra):
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


def test_one_stray_tensor_raises_value_error_naming_file_and_key(tmp_path):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    _add_tensors(tmp_path / WEIGHTS_NAME, {"stray.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=rf"{WEIGHTS_NAME}: unexpected key 'stray\.weight' \(and 0 more\)"):
        load_pretrained(tmp_path, base_model=Net())


def test_several_stray_tensors_name_the_first_in_sorted_order_and_count_the_rest(tmp_path):
    save_pretrained(tensorize_(Net(), rank=2), tmp_path)
    extra = {"zeta": torch.ones(1), "alpha.bias": torch.ones(3), "mix.extra": torch.ones(2)}
    _add_tensors(tmp_path / WEIGHTS_NAME, extra)
    with pytest.raises(ValueError, match=r"unexpected key 'alpha\.bias' \(and 2 more\)") as raised:
        load_pretrained(tmp_path, base_model=Net())
    assert str(tmp_path / WEIGHTS_NAME) in str(raised.value)


def test_weights_of_a_larger_model_are_unexpected_for_a_smaller_one(tmp_path):
    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.extra = nn.LayerNorm(12)  # stays dense: its weights are plain state-dict entries

    save_pretrained(tensorize_(Wider(), rank=2), tmp_path)
    with pytest.raises(ValueError, match=r"unexpected key 'extra\.") as raised:
        load_pretrained(tmp_path, base_model=tensorize_(Net(), rank=2))
    assert not isinstance(raised.value, RuntimeError)


def test_the_untouched_files_still_load(tmp_path):
    model = tensorize_(Net(), rank=2)
    save_pretrained(model, tmp_path)
    x = torch.randn(4, 12)
    assert torch.equal(load_pretrained(tmp_path, base_model=Net())(x), model(x))
