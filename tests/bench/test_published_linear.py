"""The rebuilt published TT layer equals comera's layer (float64, values and gradients)."""

import pytest
import torch

from comera import TTLinear
from comera.bench.published_linear import PublishedTTLinear


@pytest.mark.parametrize("bias", [True, False])
def test_published_layer_matches_the_dense_weight(bias):
    torch.manual_seed(0)
    layer = TTLinear(20, 30, in_shape=(4, 5), out_shape=(5, 6), rank=3, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        layer.gates[1].uniform_(0.5, 1.5)
    x = torch.randn(7, 20, dtype=torch.float64, requires_grad=True)
    expected = x @ layer.to_dense().t() + (layer.bias if bias else 0.0)
    published = PublishedTTLinear(layer)(x)
    torch.testing.assert_close(published, expected)
    grad = torch.randn_like(published)
    (first,) = torch.autograd.grad(published, x, grad)
    (second,) = torch.autograd.grad(layer(x), x, grad)
    torch.testing.assert_close(first, second)


def test_published_layer_needs_a_tt_linear():
    with pytest.raises(TypeError, match="layer"):
        PublishedTTLinear(torch.nn.Linear(3, 3))
