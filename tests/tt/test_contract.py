"""The batch-sized custom autograd functions and the cost model."""

import math

import pytest
import torch

from comera import TTLinear
from comera.tt.contract import low_rank_linear, tt_merge_linear, ttm_split_linear
from comera.tt.costs import choose_order, tt_order_costs, ttm_best_split, ttm_order_costs


@pytest.mark.parametrize("with_bias", [True, False])
def test_low_rank_linear_gradcheck(with_bias):
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    left = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    right = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_bias else None
    inputs = (x, left, right, bias)
    assert torch.autograd.gradcheck(low_rank_linear, inputs)
    expected = x @ left @ right + (bias if with_bias else 0)
    torch.testing.assert_close(low_rank_linear(*inputs), expected)


def test_ttm_split_linear_gradcheck_and_value():
    rows_left, cols_left, rank, rows_right, cols_right = 2, 3, 2, 3, 2
    x = torch.randn(4, rows_left * rows_right, dtype=torch.float64, requires_grad=True)
    left = torch.randn(rows_left, cols_left, rank, dtype=torch.float64, requires_grad=True)
    right = torch.randn(rank, rows_right, cols_right, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(cols_left * cols_right, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ttm_split_linear, (x, left, right, bias))
    weight = torch.einsum("ija,akl->ikjl", left, right).reshape(rows_left * rows_right, -1)
    torch.testing.assert_close(ttm_split_linear(x, left, right, bias), x @ weight + bias)


def test_merge_order_saves_only_input_and_small_intermediate():
    """Batch-sized tensors kept for backward: the input and the (B, r+1) product, nothing output-sized."""
    batch, rank = 512, 6
    layer = TTLinear(64, 256, rank=rank, in_shape=(8, 8), out_shape=(16, 16), order="merge")
    x = torch.randn(batch, 64, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    batch_sized = sorted(tuple(t.shape) for t in saved if t.dim() >= 1 and t.shape[0] == batch)
    assert batch_sized == sorted([(batch, 64), (batch, rank + 1)])


def test_cost_model_prefers_merge_for_large_batches_and_is_monotone():
    in_modes, out_modes, ranks = (8, 8, 12), (12, 8, 8), (8, 30, 30, 30, 8)
    large = tt_order_costs(4096, in_modes, out_modes, ranks, backward=True)
    assert choose_order(large) == "merge"
    small = tt_order_costs(1, in_modes, out_modes, ranks, backward=True)
    assert all(small[name] < large[name] for name in large)
    full_rank = tt_order_costs(64, (4,), (4,), (4,), backward=False)
    assert choose_order(full_rank) == "dense"


def test_ttm_split_choice_is_the_cheapest():
    rows, cols, ranks = (4, 8, 8), (8, 8, 4), (16, 16)
    split, cost = ttm_best_split(256, rows, cols, ranks, backward=True)
    costs = ttm_order_costs(256, rows, cols, ranks, backward=True)
    assert costs["merge"] == pytest.approx(cost)
    assert 1 <= split <= 2


def _random_tt_cores(modes, ranks, generator):
    full = (1, *ranks, 1)
    return [
        torch.randn(full[k], size, full[k + 1], dtype=torch.float64, generator=generator).requires_grad_()
        for k, size in enumerate(modes)
    ]


@pytest.mark.parametrize(
    "in_modes, out_modes, ranks, in_features, out_features, with_bias, num_gates",
    [
        ((2, 3), (3, 2), (2, 3, 2), 6, 6, True, 3),
        ((2, 3, 2), (2, 2, 3, 2), (2, 3, 2, 3, 2, 2), 10, 19, True, 6),
        ((4,), (5,), (3,), 3, 4, False, 1),
        ((2, 2, 2), (3,), (1, 2, 2), 7, 3, True, 0),
        ((2, 2), (2, 3), (2, 3, 2), 4, 5, False, 2),
    ],
)
def test_tt_merge_linear_matches_dense_reference_and_gradcheck(
    in_modes, out_modes, ranks, in_features, out_features, with_bias, num_gates
):
    """Against the float64 dense weight of the gated train; a gate entry at zero (a dead rank) included."""
    generator = torch.Generator().manual_seed(len(ranks) + num_gates)
    cores = _random_tt_cores(in_modes + out_modes, ranks, generator)
    gates = [torch.randn(rank, dtype=torch.float64, generator=generator) for rank in ranks[:num_gates]]
    if gates:
        gates[0][0] = 0.0
    gates = [gate.requires_grad_() for gate in gates]
    x = torch.randn(5, in_features, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(out_features, dtype=torch.float64, generator=generator) if with_bias else None
    if bias is not None:
        bias.requires_grad_()
    num_in, num_cores = len(in_modes), len(cores)

    def function(x, bias, *tensors):
        return tt_merge_linear(x, tensors[:num_cores], num_in, out_features, bias, gates=tensors[num_cores:])

    full = cores[0] * gates[0] if gates else cores[0]
    for k, core in enumerate(cores[1:], start=1):
        gated = core * gates[k] if k < len(gates) else core
        full = torch.tensordot(full, gated, dims=([full.dim() - 1], [0]))
    weight = full.reshape(math.prod(in_modes), math.prod(out_modes))[:in_features, :out_features]
    expected = x @ weight + (bias if with_bias else 0)
    torch.testing.assert_close(function(x, bias, *cores, *gates), expected)
    assert torch.autograd.gradcheck(function, (x, bias, *cores, *gates))


def test_tt_merge_linear_refuses_a_gate_per_core():
    cores = [torch.randn(1, 2, 2), torch.randn(2, 2, 1)]
    with pytest.raises(ValueError, match="gates must hold at most len\\(cores\\) - 1 = 1"):
        tt_merge_linear(torch.randn(3, 2), cores, 1, 2, gates=[torch.ones(2), torch.ones(1)])


def test_tt_merge_linear_keeps_no_merged_factor_for_backward():
    """Kept between forward and backward: the input, the (B, r+1) product, the cores and the gates."""
    generator = torch.Generator().manual_seed(0)
    cores = [
        core.float().detach().requires_grad_()
        for core in _random_tt_cores((4, 8, 8, 4), (6, 6, 6), generator)
    ]
    gates = [torch.rand(6, generator=generator).requires_grad_() for _ in range(3)]
    x = torch.randn(32, 32, requires_grad=True)
    bias = torch.zeros(32, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tt_merge_linear(x, cores, 2, 32, bias, gates=gates)
    parameters = {tensor.data_ptr() for tensor in (*cores, *gates)}
    others = [tensor for tensor in saved if tensor.data_ptr() not in parameters]
    assert len(saved) - len(others) == len(cores) + len(gates)
    assert sorted(tuple(tensor.shape) for tensor in others) == [(32, 7), (32, 32)]
    out.sum().backward()
    assert all(tensor.grad is not None and tensor.grad.abs().sum() > 0 for tensor in (*cores, *gates))


def test_tt_merge_linear_under_bf16_autocast_gives_fp32_gradients_close_to_fp32():
    generator = torch.Generator().manual_seed(1)
    cores = [
        core.float().detach().requires_grad_()
        for core in _random_tt_cores((4, 4, 4, 4), (4, 4, 4), generator)
    ]
    x = torch.randn(8, 16)

    def core_grads(autocast):
        for core in cores:
            core.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = tt_merge_linear(x, cores, 2, 16)
        out.float().square().sum().backward()
        return [core.grad.clone() for core in cores]

    reference, mixed = core_grads(False), core_grads(True)
    for exact, approx in zip(reference, mixed):
        assert approx.dtype == torch.float32
        torch.testing.assert_close(approx, exact, rtol=0.1, atol=0.1 * exact.abs().max().item())
