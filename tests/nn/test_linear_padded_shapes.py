"""Given shapes that pad a linear layer (product larger than the size), and the save/load of padded layers."""

import math

import pytest
import torch
from torch import nn

import comera
from comera import TTLinear, TTMLinear
from comera.tt.cores import tt_full, ttm_full

LAYERS = [TTLinear, TTMLinear]


def padded_reference(layer) -> torch.Tensor:
    """The ``(in, out)`` matrix of the padded train, rebuilt from the gated cores and cut to size."""
    cores = layer.gated_cores()
    if isinstance(layer, TTLinear):
        full = tt_full(cores).reshape(math.prod(layer.in_shape), math.prod(layer.out_shape))
    else:
        full = ttm_full(cores)
    return full[: layer.in_features, : layer.out_features]


@pytest.mark.parametrize("cls", LAYERS)
def test_given_padded_shapes_compute_the_cut_train(cls):
    torch.manual_seed(0)
    layer = cls(22, 43, rank=4, in_shape=(4, 6), out_shape=(6, 8), dtype=torch.float64)
    assert layer.in_shape == (4, 6) and layer.out_shape == (6, 8)
    x = torch.randn(5, 22, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ padded_reference(layer) + layer.bias)
    assert layer.to_dense().shape == (43, 22)


@pytest.mark.parametrize("cls", LAYERS)
def test_a_short_product_is_still_refused_naming_the_shape(cls):
    with pytest.raises(ValueError, match=r"prod\(out_shape\) = 42 must be >= 43"):
        cls(22, 43, in_shape=(4, 6), out_shape=(6, 7))


@pytest.mark.parametrize("cls", LAYERS)
def test_an_automatically_padded_layer_is_rebuilt_from_its_spec(cls):
    layer = cls(97, 53, rank=4)
    assert math.prod(layer.in_shape) > 97 and math.prod(layer.out_shape) > 53
    rebuilt = cls.from_spec(layer.spec())
    assert (rebuilt.in_shape, rebuilt.out_shape, rebuilt.max_ranks) == (
        layer.in_shape,
        layer.out_shape,
        layer.max_ranks,
    )


@pytest.mark.parametrize("format", ["tt", "ttm"])
def test_a_model_with_padded_layers_saves_and_loads(tmp_path, format):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(97, 53), nn.ReLU(), nn.Linear(53, 11))
    comera.tensorize_(model, rank=4, format=format)
    comera.save_pretrained(model, tmp_path)
    loaded = comera.load_pretrained(
        tmp_path, base_model=nn.Sequential(nn.Linear(97, 53), nn.ReLU(), nn.Linear(53, 11))
    )
    x = torch.randn(3, 97)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
