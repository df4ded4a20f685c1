"""Which children a parent reads the weight of instead of calling them (comera.weight_reads)."""

import torch
from torch import nn

from comera.weight_reads import read_by_attribute


class Scaled(nn.Module):
    """Reads ``scale.bias`` in a property and calls ``proj``, whose weight it also reads."""

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
    assert sorted(found) == ["a.out_proj", "b.out_proj", "scaled.scale"]
    assert found["a.out_proj"].startswith(
        "its parent MultiheadAttention reads out_proj.bias and out_proj.weight directly instead of calling"
    )
    assert found["scaled.scale"].startswith("its parent Scaled reads scale.bias directly")


def test_a_child_the_class_or_a_subclass_calls_is_not_read_by_attribute():
    assert read_by_attribute(CallingAttention(8, 2)) == {}
    assert "proj" not in read_by_attribute(Scaled())
