"""The batch-sized custom autograd functions and the cost model."""

import pytest
import torch

from comera import TTLinear
from comera.tt.contract import low_rank_linear, ttm_split_linear
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
