"""Under autocast, the output dtype follows nn.Linear's whatever the contraction order and batch size."""

import pytest
import torch

from comera import TTLinear, TTMEmbedding, TTMLinear, TTMTiedHead

ORDERS = ("auto", "merge", "sequential", "dense")
CASES = [(cls, order) for cls in (TTLinear, TTMLinear) for order in ORDERS] + [(TTLinear, "factors")]


@pytest.mark.parametrize("cls, order", CASES)
@pytest.mark.parametrize("batch", [8, 4096])
def test_linear_output_dtype_under_autocast_matches_nn_linear(cls, order, batch):
    torch.manual_seed(0)
    layer = cls(256, 256, rank=8, order=order)
    dense = torch.nn.Linear(256, 256)
    with torch.no_grad():
        dense.weight.copy_(layer.to_dense())
        dense.bias.copy_(layer.bias)
    x = torch.randn(batch, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = layer(x), dense(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.05, atol=0.05)
    out.float().sum().backward()
    assert all(core.grad is not None and core.grad.dtype == torch.float32 for core in layer.cores)


@pytest.mark.parametrize("batch", [4, 2048])
def test_tied_head_output_dtype_under_autocast_matches_nn_linear(batch):
    table = TTMEmbedding(300, 32, padding_idx=0, rank=4)
    head = TTMTiedHead(table)
    dense = torch.nn.Linear(32, 300)
    x = torch.randn(batch, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head(x).dtype == dense(x).dtype == torch.bfloat16
    assert head(x).dtype == torch.float32
