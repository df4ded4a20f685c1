"""A new layer type is one class: registered, it converts back, saves, loads, prunes and reports with no
change elsewhere in the library."""

from typing import Any

import pytest
import torch
from torch import nn

from comera import compression_report, load_pretrained, prune_, save_pretrained, untensorize_
from comera.nn import GatedTrain
from comera.nn.layer import spec_arguments
from comera.nn.removed import RemovedLinear
from comera.report import saved_compression_report


class LowRankLinear(GatedTrain):
    """``y = x A diag(g) B + b`` with ``A`` ``(in, r)`` and ``B`` ``(r, out)``: a two-core train."""

    dense_type = nn.Linear
    role = "linear"
    format = "low-rank"
    report_format = "low-rank"

    def __init__(self, in_features, out_features, rank, bias=True, *, tau=1e-2, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self._build_train([(1, in_features, rank), (rank, out_features, 1)], tau, device, dtype)
        with torch.no_grad():
            for core in self.cores:
                core.normal_(0.0, 0.3)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @property
    def bond_sizes(self):
        return (self.in_features, self.out_features)

    def dense_num_parameters(self):
        return self.in_features * self.out_features

    def to_dense(self):
        left, right = self.gated_cores()
        return (left[0] @ right[..., 0]).t()

    def forward(self, x):
        left, right = self.gated_cores()
        out = x @ left[0] @ right[..., 0]
        return out if self.bias is None else out + self.bias

    def spec(self, name_of=None) -> dict[str, Any]:
        return {"kind": self.kind, **self.dense_attributes(), "rank": self.max_ranks[0], "tau": self.tau}

    @classmethod
    def from_spec(cls, spec, *, device=None, dtype=None, resolve=None):
        return cls(**spec_arguments(cls, spec), device=device, dtype=dtype)

    def to_dense_module(self, dense_of=None):
        like = self.cores[0]
        linear = nn.Linear(self.in_features, self.out_features, self.bias is not None, dtype=like.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def pruned_stand_in(self):
        removed = RemovedLinear(self.in_features, self.out_features, bias=False, dtype=self.cores[0].dtype)
        removed.bias = self.bias
        return removed

    def dense_attributes(self):
        return {
            "in_features": self.in_features,
            "out_features": self.out_features,
            "bias": self.bias is not None,
        }

    @property
    def mode_shapes(self):
        return ((self.in_features,), (self.out_features,))


@pytest.fixture
def registered(layer_registry):
    return layer_registry(LowRankLinear)


def _base():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8, dtype=torch.float64), nn.Tanh(), nn.Linear(8, 3, dtype=torch.float64)
    )


@pytest.mark.parametrize("dead", [False, True])
def test_a_registered_new_layer_type_works_everywhere(registered, tmp_path, dead):
    model = _base()
    model[0] = registered(6, 8, rank=4, dtype=torch.float64)
    with torch.no_grad():
        model[0].gates[0][[0, 2]] = 0.0
        if dead:
            model[0].gates[0].zero_()
    x = torch.randn(5, 6, dtype=torch.float64)
    before = model(x)
    prune_(model)
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
    assert type(model[0]) is (RemovedLinear if dead else registered)
    save_pretrained(model, tmp_path)
    assert str(saved_compression_report(tmp_path)) == str(compression_report(model))
    loaded = load_pretrained(tmp_path, base_model=_base())
    assert torch.equal(loaded(x), model(x))
    untensorize_(loaded)
    assert type(loaded[0]) is nn.Linear
    torch.testing.assert_close(loaded(x), before, rtol=1e-12, atol=1e-12)
