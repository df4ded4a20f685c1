"""TTMEmbeddingBag against bags pooled by hand from its dense table (float64), and against nn.EmbeddingBag."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comera import TTMEmbeddingBag
from comera.nn.embedding import LOOKUPS

ROWS, DIM = 60, 7


def make_bag(mode, padding_idx=None, lookup="auto", include_last_offset=False) -> TTMEmbeddingBag:
    bag = TTMEmbeddingBag(
        ROWS,
        DIM,
        mode,
        include_last_offset=include_last_offset,
        padding_idx=padding_idx,
        row_shape=(3, 4, 5),
        col_shape=(2, 2, 2),
        rank=3,
        lookup=lookup,
        dtype=torch.float64,
    )
    with torch.no_grad():
        for gate in bag.gates:
            gate.uniform_(0.5, 1.5)
    return bag


def pooled_reference(table, bags, mode, weights=None, padding_idx=None):
    """Pool rows of ``table`` bag by bag in Python: the independent reference."""
    pooled = []
    for number, bag in enumerate(bags):
        kept = [(position, index) for position, index in enumerate(bag) if index != padding_idx]
        if not kept:
            pooled.append(table.new_zeros(table.shape[1]))
            continue
        rows = torch.stack([table[index] for _, index in kept])
        if weights is not None:
            rows = rows * torch.stack([weights[number][position] for position, _ in kept]).unsqueeze(1)
        if mode == "sum":
            pooled.append(rows.sum(0))
        elif mode == "mean":
            pooled.append(rows.mean(0))
        else:
            pooled.append(rows.max(0).values)
    return torch.stack(pooled)


BAGS = [[3, 3, 59], [], [0], [7, 3, 12, 12], [3]]


def flat_with_offsets(bags, include_last_offset=False):
    flat = torch.tensor([index for bag in bags for index in bag])
    starts = [0]
    for bag in bags:
        starts.append(starts[-1] + len(bag))
    offsets = torch.tensor(starts if include_last_offset else starts[:-1])
    return flat, offsets


def assert_close_with_gradients(bag, output, reference, extra=()):
    grad_out = torch.randn(output.shape, dtype=output.dtype)
    params = [*bag.cores, *bag.gates, *extra]
    grads = torch.autograd.grad((output * grad_out).sum(), params)
    ref_grads = torch.autograd.grad((reference * grad_out).sum(), params)
    torch.testing.assert_close(output, reference, rtol=1e-10, atol=1e-12)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lookup", LOOKUPS)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_offsets_bags_match_pooled_dense_rows(mode, lookup):
    bag = make_bag(mode, lookup=lookup)
    flat, offsets = flat_with_offsets(BAGS)
    output = bag(flat, offsets)
    assert output.shape == (len(BAGS), DIM)
    assert_close_with_gradients(bag, output, pooled_reference(bag.to_dense(), BAGS, mode))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_two_dimensional_input_and_include_last_offset(mode):
    bag = make_bag(mode)
    equal = [[1, 2, 2], [59, 0, 1]]
    output = bag(torch.tensor(equal))
    assert_close_with_gradients(bag, output, pooled_reference(bag.to_dense(), equal, mode))
    last = make_bag(mode, include_last_offset=True)
    flat, offsets = flat_with_offsets(BAGS, include_last_offset=True)
    torch.testing.assert_close(last(flat, offsets), pooled_reference(last.to_dense(), BAGS, mode))


def test_per_sample_weights_weight_each_row_in_sum_mode():
    bag = make_bag("sum")
    flat, offsets = flat_with_offsets(BAGS)
    weights = torch.randn(flat.shape, dtype=torch.float64, requires_grad=True)
    output = bag(flat, offsets, per_sample_weights=weights)
    per_bag = weights.split([len(indices) for indices in BAGS])
    reference = pooled_reference(bag.to_dense(), BAGS, "sum", weights=per_bag)
    assert_close_with_gradients(bag, output, reference, extra=[weights])


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_entries_are_left_out_of_their_bag(mode):
    bag = make_bag(mode, padding_idx=3)
    flat, offsets = flat_with_offsets(BAGS)
    output = bag(flat, offsets)
    reference = pooled_reference(bag.to_dense(), BAGS, mode, padding_idx=3)
    assert_close_with_gradients(bag, output, reference)
    assert torch.all(output[4] == 0)  # the bag [3] holds only padding


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_from_embedding_bag_at_full_rank_reproduces_nn_embedding_bag(mode):
    dense = nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=0, dtype=torch.float64)
    bag = TTMEmbeddingBag.from_embedding_bag(dense, rank=1000, row_shape=(3, 4, 5), col_shape=(7, 1, 1))
    assert bag.mode == mode and bag.padding_idx == 0
    flat, offsets = flat_with_offsets([[0, 5, 5], [], [59, 0], [0]])
    torch.testing.assert_close(bag(flat, offsets), dense(flat, offsets), rtol=1e-9, atol=1e-9)


def test_bad_bag_arguments_raise():
    with pytest.raises(ValueError, match="mode must be one of"):
        TTMEmbeddingBag(ROWS, DIM, "median")
    bag = make_bag("mean")
    with pytest.raises(ValueError, match="1-D .* or 2-D"):
        bag(torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises((ValueError, NotImplementedError, RuntimeError), match="per_sample_weights"):
        bag(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(IndexError, match=r"index 60 is out of range.*\[0, 59\]"):
        bag(torch.tensor([1, 60]), torch.tensor([0]))


def test_float_offsets_are_refused():
    bag = TTMEmbeddingBag(20, 4, row_shape=(4, 5), col_shape=(2, 2), rank=2)
    with pytest.raises(TypeError, match="offsets must hold integer positions .* got dtype torch.float32"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0.0, 2.0]))
