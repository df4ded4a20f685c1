"""Which children a parent reads the weight of instead of calling them (comera.weight_reads)."""

import pytest
import torch
from torch import nn

from comera.weight_reads import read_by_attribute


class Scaled(nn.Module):
    """Reads ``scale.bias`` in a property and calls ``proj``, whose weight its forward also reads (as T5's
    feed-forward reads ``wo.weight.dtype``): a layer without a dense weight cannot stand in for either."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Linear(1, 4)

    @property
    def offset(self) -> torch.Tensor:
        return self.scale.bias

    def forward(self, x):
        return self.proj(x).to(self.proj.weight.dtype) + self.offset


class CallingAttention(nn.MultiheadAttention):
    """A subclass that calls ``out_proj`` itself: it is no longer read by attribute."""

    def forward(self, x):
        return self.out_proj(x)


def test_a_child_read_and_never_called_is_listed_under_every_name_with_its_parent():
    attention = nn.MultiheadAttention(8, 2)
    model = nn.ModuleDict({"a": attention, "b": attention, "scaled": Scaled()})
    found = read_by_attribute(model)
    assert sorted(found) == ["a.out_proj", "b.out_proj", "scaled.proj", "scaled.scale"]
    assert found["a.out_proj"].startswith(
        "its parent MultiheadAttention reads out_proj.bias and out_proj.weight directly"
    )
    assert found["scaled.scale"].startswith("its parent Scaled reads scale.bias directly")
    assert found["scaled.proj"].startswith("its parent Scaled reads proj.weight directly")


def test_a_child_the_class_or_a_subclass_calls_is_not_read_by_attribute():
    assert read_by_attribute(CallingAttention(8, 2)) == {}


def test_t5s_feed_forward_output_stays_dense_and_the_converted_model_runs():
    """T5's feed-forward calls ``wo`` but first reads ``wo.weight.dtype``: converted with the default
    targets, ``wo`` stays an ``nn.Linear`` (the model's forward ran into a missing ``weight`` before), with
    a warning naming it; named as a target, it is refused with the reason."""
    transformers = pytest.importorskip("transformers")
    from comera import TensorizeConfig, TensorizeWarning, tensorize_

    def t5():
        config = transformers.T5Config(
            d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=100
        )
        return transformers.T5ForConditionalGeneration(config).eval()

    model = t5()
    with pytest.warns(
        TensorizeWarning, match=r"2 linear\(s\) stay dense .*'encoder.block.0.layer.1.DenseRel"
    ):
        tensorize_(model)
    feed_forward = model.encoder.block[0].layer[1].DenseReluDense
    assert type(feed_forward.wo) is nn.Linear and type(feed_forward.wi) is not nn.Linear
    logits = model(input_ids=torch.tensor([[1, 2, 3]]), decoder_input_ids=torch.tensor([[1, 2]])).logits
    assert logits.shape == (1, 2, 100) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"'encoder.block.0.layer.1.DenseReluDense.wo' cannot be tensorized"):
        tensorize_(t5(), TensorizeConfig(target_modules=["wo"]))
