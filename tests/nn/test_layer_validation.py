"""Call-time validation that used to fail deep inside torch, and layers on the meta device."""

import pytest
import torch

from comera import TTLinear, TTMEmbedding, TTMEmbeddingBag, TTMLinear, TTMTiedHead


def test_tied_head_refuses_an_input_of_another_dtype_naming_it():
    head = TTMTiedHead(TTMEmbedding(30, 8, rank=3))
    with pytest.raises(ValueError, match=r"hidden dtype torch.float64 does not match.*float32"):
        head(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("offsets", [[0, -2, 3], [0, 4, 1], [1, 3], [0, 7]])
def test_bag_refuses_offsets_that_are_negative_decreasing_or_out_of_range(offsets):
    bag = TTMEmbeddingBag(30, 8, rank=3, mode="sum")
    with pytest.raises(ValueError, match=r"offsets must start at 0, never decrease"):
        bag(torch.arange(6), torch.tensor(offsets))


def test_bag_with_valid_offsets_matches_the_dense_bag():
    bag = TTMEmbeddingBag(30, 8, rank=3, mode="mean", include_last_offset=True, dtype=torch.float64)
    dense = torch.nn.EmbeddingBag.from_pretrained(
        bag.to_dense().detach(), mode="mean", include_last_offset=True
    )
    ids, offsets = torch.tensor([3, 1, 4, 1, 5, 9]), torch.tensor([0, 2, 2, 6])
    torch.testing.assert_close(bag(ids, offsets), dense(ids, offsets), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "make, make_input, shape",
    [
        (lambda: TTLinear(12, 10, rank=3, device="meta"), lambda: torch.empty(4, 12, device="meta"), (4, 10)),
        (
            lambda: TTMLinear(12, 10, in_shape=(3, 4), out_shape=(2, 5), rank=3, device="meta"),
            lambda: torch.empty(2, 3, 12, device="meta"),
            (2, 3, 10),
        ),
        (
            lambda: TTMEmbedding(30, 8, padding_idx=1, rank=3, device="meta"),
            lambda: torch.zeros(4, 3, dtype=torch.long, device="meta"),
            (4, 3, 8),
        ),
        (
            lambda: TTMEmbeddingBag(30, 8, rank=3, include_last_offset=True, device="meta"),
            lambda: (
                torch.zeros(6, dtype=torch.long, device="meta"),
                torch.zeros(4, dtype=torch.long, device="meta"),
            ),
            (3, 8),
        ),
        (
            lambda: TTMTiedHead(TTMEmbedding(30, 8, rank=3, device="meta")),
            lambda: torch.empty(5, 8, device="meta"),
            (5, 30),
        ),
    ],
)
def test_meta_layers_print_and_propagate_shapes(make, make_input, shape):
    layer = make()
    assert "max_ranks=(3" in repr(layer)  # the stored ranks stand for the active ones on meta
    inputs = make_input()
    out = layer(*inputs) if isinstance(inputs, tuple) else layer(inputs)
    assert out.is_meta and tuple(out.shape) == shape


def test_meta_layer_called_with_real_input_says_so():
    layer = TTLinear(12, 10, rank=3, device="meta")
    with pytest.raises(ValueError, match=r"meta device.*input is on cpu"):
        layer(torch.randn(2, 12))


def test_table_shapes_of_different_lengths_are_padded_with_size_1_modes():
    torch.manual_seed(0)
    dense = torch.nn.Embedding(30, 8, padding_idx=2, dtype=torch.float64)
    table = TTMEmbedding.from_embedding(dense, row_shape=(2, 3, 5), col_shape=(8,), rank=10_000)
    assert table.row_shape == (2, 3, 5) and table.col_shape == (8, 1, 1)
    ids = torch.tensor([[0, 2, 29], [7, 7, 13]])
    torch.testing.assert_close(table(ids), dense(ids), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
@pytest.mark.parametrize("order", ["dense", "merge", "sequential"])
def test_a_non_finite_input_row_stays_in_its_row_as_documented(cls, order):
    torch.manual_seed(0)
    layer = cls(12, 10, in_shape=(3, 4), out_shape=(2, 5), rank=3, order=order, dtype=torch.float64)
    weight = layer.to_dense().detach()
    x = torch.randn(4, 12, dtype=torch.float64)
    x[1, 5] = float("inf")
    out = layer(x).detach()
    dense = x @ weight.T + layer.bias.detach()
    finite_rows = [0, 2, 3]
    torch.testing.assert_close(out[finite_rows], dense[finite_rows], rtol=1e-10, atol=1e-10)
    assert not torch.isfinite(out[1]).any()
    if order == "dense":
        assert torch.equal(out[1], dense[1])
