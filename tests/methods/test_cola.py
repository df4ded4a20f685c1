"""CoLA: the bottleneck layer against a direct numpy computation, its initial scale, ranks, and the exact
parameter counts and whole-model compression of a converted model."""

import numpy as np
import pytest
import torch
from torch import nn

from comera.methods import MethodContext
from comera.methods.cola import CoLALinear, CoLAMethod, cola_rank
from comera.report import compression_report
from comera.tensorize_config import TensorizeConfig


def test_forward_is_b_silu_a_x_plus_bias():
    layer = CoLALinear(6, 5, 3, dtype=torch.float64)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    a, b, bias = (p.detach().numpy() for p in (layer.cola_a, layer.cola_b, layer.bias))
    z = x.numpy() @ a.T
    expected = (z / (1.0 + np.exp(-z))) @ b.T + bias
    np.testing.assert_allclose(layer(x).detach().numpy(), expected, rtol=1e-12, atol=1e-12)


def test_identity_activation_is_a_plain_low_rank_linear():
    layer = CoLALinear(6, 5, 2, activation="identity", bias=False, dtype=torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64)
    product = (layer.cola_b @ layer.cola_a).detach()
    torch.testing.assert_close(layer(x), x @ product.T, rtol=1e-12, atol=1e-12)
    assert torch.linalg.matrix_rank(product) == 2


def test_initial_product_has_glorot_variance():
    torch.manual_seed(3)
    layer = CoLALinear(300, 200, 60)
    product = (layer.cola_b @ layer.cola_a).detach()
    assert product.var().item() == pytest.approx(1 / 500, rel=0.05)


def test_ranks_and_bad_ranks():
    assert cola_rank(512, 2048, 0, 0.25) == 128
    assert cola_rank(16, 32, 0, 0.25) == 4 and cola_rank(3, 3, 0, 0.25) == 1
    assert cola_rank(16, 32, 40, 0.25) == 16 and cola_rank(16, 32, 5, 0.25) == 5
    with pytest.raises(
        ValueError, match=r"rank must be in \[1, min\(in_features, out_features\)\] = \[1, 4\]"
    ):
        CoLALinear(4, 8, 5)
    with pytest.raises(ValueError, match=r"activation must be one of \('silu', 'gelu', 'relu', 'identity'\)"):
        CoLALinear(4, 8, 2, activation="tanh")


def test_converted_model_counts_and_compression():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))
    dense = compression_report(model).model_dense_params
    context = MethodContext(tensorize=TensorizeConfig(target_modules=["0", "2"]), settings={})
    model = CoLAMethod().prepare(model, context)
    first, second = model[0], model[2]
    assert (first.rank, second.rank) == (4, 8) and isinstance(model[4], nn.Linear)
    assert first.num_parameters() == 4 * 16 + 32 * 4 + 32 and first.dense_num_parameters() == 16 * 32 + 32
    assert second.num_parameters() == 8 * 32 + 32 * 8 + 32
    params = sum(p.numel() for p in model.parameters())
    assert params == first.num_parameters() + second.num_parameters() + 32 * 3 + 3
    assert compression_report(model).model_params == params
    assert dense == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 3 + 3
    assert dense / params == pytest.approx(1699 / 867)
