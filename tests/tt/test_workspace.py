"""Scratch buffers reused across calls: grown to the largest call, released on request, results unchanged."""

import pytest
import torch

from comera import TTLinear, TTMEmbedding, TTMLinear
from comera.tt.lookup import ttm_lookup_split
from comera.tt.paths import tt_linear, ttm_linear
from comera.tt.workspace import Workspace


def test_take_grows_to_the_largest_request_and_reuses_it():
    workspace = Workspace()
    like = torch.zeros(1, dtype=torch.float64)
    big = workspace.take("a", (4, 5), like)
    assert big.shape == (4, 5) and big.dtype == torch.float64 and workspace.allocations == 1
    small = workspace.take("a", (3, 2), like)
    assert small.data_ptr() == big.data_ptr() and workspace.allocations == 1
    other = workspace.take("b", (2,), like)
    assert other.data_ptr() != big.data_ptr() and workspace.allocations == 2
    workspace.take("a", (30,), like)
    assert workspace.allocations == 3 and workspace.nbytes() == (30 + 2) * 8
    workspace.take("a", (4, 5), torch.zeros(1, dtype=torch.float32))  # another dtype: its own buffer
    assert workspace.allocations == 4
    workspace.release()
    assert workspace.nbytes() == 0


def _embedding():
    torch.manual_seed(0)
    return TTMEmbedding(3000, 48, row_shape=(10, 15, 20), col_shape=(4, 3, 4), rank=6, lookup="split")


def _lookup_step(layer, indices):
    layer.zero_grad()
    out = layer(indices)
    (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
    return out.detach().clone(), [core.grad.clone() for core in layer.cores]


def test_embedding_reuses_its_buffers_and_matches_a_lookup_without_them():
    layer = _embedding()
    large = torch.randint(0, 3000, (12000,), generator=torch.Generator().manual_seed(1))  # two chunks
    reference = {}
    for name, indices in (("large", large), ("small", large[:500])):
        halves = [core.detach().requires_grad_() for core in layer.gated_cores()]
        out = ttm_lookup_split(halves, indices, split=1)[:, :48]
        (out * torch.linspace(-1, 1, 48)).sum().backward()
        reference[name] = out.detach(), [core.grad for core in halves]
    first = _lookup_step(layer, large)
    allocations, size = layer.workspace.allocations, layer.workspace.nbytes()
    assert allocations > 0 and size > 0
    for name, indices in (("small", large[:500]), ("large", large)):
        out, grads = _lookup_step(layer, indices)
        torch.testing.assert_close(out, reference[name][0], rtol=1e-5, atol=1e-6)
        for grad, expected in zip(grads, reference[name][1]):  # gates are 1: core grads = gated-core grads
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-4)
        assert layer.workspace.allocations == allocations and layer.workspace.nbytes() == size
    # identical (bitwise) to the same call on a fresh module with no buffers yet
    again = _lookup_step(layer, large)
    fresh = _embedding()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(again[0], first[0])
    expected = _lookup_step(fresh, large)
    assert torch.equal(again[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(again[1], expected[1]))
    layer.release_workspace()
    assert layer.workspace.nbytes() == 0
    assert torch.equal(_lookup_step(layer, large)[0], first[0])


@pytest.mark.parametrize("kind", ["tt", "ttm"])
def test_linear_merge_order_reuses_backward_scratch_with_identical_results(kind):
    torch.manual_seed(2)
    if kind == "tt":
        layer = TTLinear(48, 40, in_shape=(4, 12), out_shape=(5, 8), rank=5, order="merge")
    else:
        layer = TTMLinear(48, 40, in_shape=(4, 12), out_shape=(5, 8), rank=5, order="merge")
    x = torch.randn(300, 48)

    def step(inputs, workspace):
        cores = [core.detach().requires_grad_() for core in layer.gated_cores()]
        bias = layer.bias.detach().requires_grad_()
        data = inputs.clone().requires_grad_()
        if kind == "tt":
            out = tt_linear(data, cores, 2, 40, bias, "merge", workspace=workspace)
        else:
            out = ttm_linear(data, cores, 40, bias, "merge", split=1, workspace=workspace)
        (out * torch.linspace(-1, 1, 40)).sum().backward()
        return [out.detach(), data.grad, bias.grad, *[core.grad for core in cores]]

    without = step(x, None)
    workspace = Workspace()
    with_reuse = step(x, workspace)
    allocations = workspace.allocations
    assert allocations == 1
    assert all(torch.equal(a, b) for a, b in zip(with_reuse, without))
    assert all(torch.equal(a, b) for a, b in zip(step(x[:100], workspace), step(x[:100], None)))
    assert all(torch.equal(a, b) for a, b in zip(step(x, workspace), without))
    assert workspace.allocations == allocations
    # the module path uses its own workspace, released on request
    layer(x).sum().backward()
    assert layer.workspace.nbytes() > 0
    layer.release_workspace()
    assert layer.workspace.nbytes() == 0
