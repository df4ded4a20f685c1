"""TTMEmbedding and TTMTiedHead against their dense tables (float64): rows, gradients, padding, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from comera import TTMEmbedding, TTMEmbeddingBag, TTMTiedHead
from comera.nn.embedding import LOOKUPS
from comera.nn.gated import GatedTrain
from comera.tt.cores import num_train_parameters

ROWS, DIM = 97, 10


def make_embedding(padding_idx=None, lookup="auto", rank=3, **kwargs) -> TTMEmbedding:
    """A 97 x 10 table on 4 * 5 * 5 = 100 rows and 2 * 3 * 2 = 12 columns (both padded), with uneven gates."""
    embedding = TTMEmbedding(
        ROWS,
        DIM,
        padding_idx,
        row_shape=(4, 5, 5),
        col_shape=(2, 3, 2),
        rank=rank,
        lookup=lookup,
        dtype=torch.float64,
        **kwargs,
    )
    with torch.no_grad():
        for gate in embedding.gates:
            gate.uniform_(0.5, 1.5)
        embedding.gates[0][0] = 0.001  # a dead entry: below tau
    return embedding


def dense_rows_and_grads(embedding, indices, grad_out):
    """Rows and parameter gradients through ``to_dense()`` (ttm_full), independent of the lookup."""
    rows = embedding.to_dense()[indices]
    params = [*embedding.cores, *embedding.gates]
    return rows.detach(), torch.autograd.grad((rows * grad_out).sum(), params)


def assert_matches_dense(embedding, indices):
    out = embedding(indices)
    assert out.shape == (*indices.shape, DIM)
    grad_out = torch.randn(out.shape, dtype=out.dtype)
    params = [*embedding.cores, *embedding.gates]
    grads = torch.autograd.grad((out * grad_out).sum(), params)
    ref_rows, ref_grads = dense_rows_and_grads(embedding, indices, grad_out)
    torch.testing.assert_close(out.detach(), ref_rows, rtol=1e-10, atol=1e-12)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)
    return grads


INDEX_CASES = {
    "duplicates_2d": [[5, 96, 5, 0], [5, 5, 40, 96]],
    "one": [17],
    "empty": [],
    "empty_2d": [[], []],
    "three_dims": [[[1, 2], [3, 1]], [[96, 0], [1, 1]]],
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
@pytest.mark.parametrize("lookup", LOOKUPS)
def test_every_lookup_matches_dense_rows_and_gradients(lookup, case):
    indices = torch.tensor(INDEX_CASES[case], dtype=torch.long)
    grads = assert_matches_dense(make_embedding(lookup=lookup), indices)
    assert grads[3][0] == 0  # gradient of the first gate (after 3 cores): its dead entry gets none


@pytest.mark.parametrize("lookup", LOOKUPS)
def test_int32_indices_and_repeated_heavy_batches(lookup):
    embedding = make_embedding(lookup=lookup)
    indices = torch.tensor([3, 3, 3, 3, 3, 3, 90, 3], dtype=torch.int32)
    assert_matches_dense(embedding, indices)


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 60),
    dim=st.integers(1, 9),
    order=st.integers(1, 4),
    rank=st.integers(1, 4),
    batch=st.integers(0, 10),
    seed=st.integers(0, 2**16),
)
def test_random_tables_match_dense(rows, dim, order, rank, batch, seed):
    torch.manual_seed(seed)
    row_shape = (1,) * (order - 1) + (rows,) if order > 1 else (rows,)
    embedding = TTMEmbedding(rows, dim, rank=rank, dtype=torch.float64)
    shaped = TTMEmbedding(rows, dim, rank=rank, row_shape=row_shape, dtype=torch.float64)
    for table in (embedding, shaped):
        assert math.prod(table.row_shape) >= rows and math.prod(table.col_shape) >= dim
        indices = torch.randint(0, rows, (batch,))
        out = table(indices)
        torch.testing.assert_close(out, table.to_dense()[indices], rtol=1e-10, atol=1e-12)


def test_padding_idx_reads_zero_and_gets_no_gradient():
    embedding = make_embedding(padding_idx=7)
    indices = torch.tensor([[7, 1, 7], [2, 7, 96]])
    out = embedding(indices)
    assert torch.all(out[indices == 7] == 0)
    assert torch.all(embedding.to_dense()[7] == 0)
    assert_matches_dense(embedding, indices)
    only_padding = embedding(torch.tensor([7, 7])).sum()
    grads = torch.autograd.grad(only_padding, [*embedding.cores, *embedding.gates], allow_unused=True)
    assert all(grad is None or torch.all(grad == 0) for grad in grads)


def test_negative_padding_idx_counts_from_the_end():
    assert make_embedding(padding_idx=-1).padding_idx == ROWS - 1
    with pytest.raises(ValueError, match=r"padding_idx must be in \[-97, 96\].*got 97"):
        make_embedding(padding_idx=ROWS)


def test_from_embedding_at_full_rank_reproduces_nn_embedding():
    dense = nn.Embedding(30, 6, padding_idx=4, dtype=torch.float64)
    embedding = TTMEmbedding.from_embedding(dense, rank=1000, row_shape=(2, 3, 5), col_shape=(3, 1, 2))
    assert embedding.padding_idx == 4 and embedding.cores[0].dtype == torch.float64
    indices = torch.tensor([[4, 0, 29], [13, 4, 13]])
    torch.testing.assert_close(embedding(indices), dense(indices), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(embedding.to_dense(), dense.weight.detach(), rtol=1e-9, atol=1e-9)


def test_from_embedding_truncates_to_the_requested_rank():
    dense = nn.Embedding(64, 16, dtype=torch.float64)
    low = TTMEmbedding.from_embedding(dense, rank=2, row_shape=(8, 8), col_shape=(4, 4))
    assert low.max_ranks == (2,) and low.ranks == (2,)
    error = torch.linalg.matrix_norm(low.to_dense() - dense.weight.detach())
    assert 0 < error < torch.linalg.matrix_norm(dense.weight.detach())


def test_from_embedding_rejects_unsupported_options():
    with pytest.raises(ValueError, match="max_norm"):
        TTMEmbedding.from_embedding(nn.Embedding(10, 4, max_norm=1.0))
    with pytest.raises(TypeError, match="nn.Embedding|Embedding"):
        TTMEmbedding.from_embedding(nn.Linear(3, 4))


def test_shapes_ranks_parameters_and_compression():
    embedding = make_embedding(rank=3)
    assert isinstance(embedding, GatedTrain)
    assert [tuple(core.shape) for core in embedding.cores] == [(1, 4, 2, 3), (3, 5, 3, 3), (3, 5, 2, 1)]
    assert embedding.to_dense().shape == (ROWS, DIM)
    assert embedding.max_ranks == (3, 3)
    assert embedding.ranks == (2, 3)  # the dead gate entry
    expected = 4 * 2 * 2 + 2 * 5 * 3 * 3 + 3 * 5 * 2
    assert embedding.num_parameters() == expected
    assert embedding.compression == pytest.approx(ROWS * DIM / expected)


def test_paper_table_defaults():
    embedding = TTMEmbedding(30522, 768, rank=32)
    assert len(embedding.row_shape) == 4
    assert 30522 <= math.prod(embedding.row_shape) <= 32000
    assert math.prod(embedding.col_shape) == 768
    bond_sizes = [m * n for m, n in zip(embedding.row_shape, embedding.col_shape)]
    assert embedding.num_parameters() == num_train_parameters(bond_sizes, embedding.max_ranks)


def test_dlrm_table_is_over_100x_smaller_at_rank_16():
    embedding = TTMEmbedding(10_000_000, 16, rank=16)
    assert math.prod(embedding.row_shape) >= 10_000_000
    assert embedding.compression >= 100
    rows = embedding(torch.tensor([0, 9_999_999, 123_456]))
    assert rows.shape == (3, 16)


def test_pruned_cores_keep_working():
    """Rank pruning slices cores and gates along their rank axes; the module must follow."""
    embedding = make_embedding(rank=3)
    with torch.no_grad():
        embedding.cores[0] = nn.Parameter(embedding.cores[0][..., 1:].clone())
        embedding.cores[1] = nn.Parameter(embedding.cores[1][1:, ..., :2].clone())
        embedding.cores[2] = nn.Parameter(embedding.cores[2][:2].clone())
        embedding.gates[0] = nn.Parameter(embedding.gates[0][1:].clone())
        embedding.gates[1] = nn.Parameter(embedding.gates[1][:2].clone())
    assert embedding.max_ranks == (2, 2)
    for lookup in LOOKUPS:
        embedding.lookup = lookup
        assert_matches_dense(embedding, torch.tensor([[0, 50, 96], [50, 50, 3]]))


@pytest.mark.parametrize(
    ("indices", "error", "message"),
    [
        (torch.tensor([3, 97]), IndexError, r"index 97 is out of range.*\[0, 96\]"),
        (torch.tensor([[3, 1000], [2, 5]]), IndexError, r"index 1000 is out of range.*\[0, 96\]"),
        (torch.tensor([-1, 5]), IndexError, r"index -1 is out of range.*\[0, 96\]"),
        (torch.tensor([1.0, 2.0]), TypeError, r"integer indices.*\[0, 96\].*torch.float32"),
        (torch.tensor([True]), TypeError, r"integer indices.*torch.bool"),
        (torch.tensor([1], dtype=torch.int16), TypeError, r"integer indices.*torch.int16"),
        ([1, 2], TypeError, r"torch.Tensor of indices in \[0, 96\]"),
    ],
)
def test_bad_indices_raise_with_value_and_range(indices, error, message):
    for module in (make_embedding(), TTMEmbeddingBag(ROWS, DIM, "sum", rank=2)):
        with pytest.raises(error, match=message):
            module(indices)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_embeddings": 0}, "num_embeddings must be an int >= 1"),
        ({"embedding_dim": 2.5}, "embedding_dim must be an int >= 1"),
        ({"lookup": "fast"}, "lookup must be one of"),
        ({"row_shape": (3, 3)}, r"prod\(row_shape\) = 9 must be >= 97"),
        ({"rank": 0}, "rank must be >= 1"),
        ({"dtype": torch.int64}, "floating-point"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, message):
    arguments = {"num_embeddings": ROWS, "embedding_dim": DIM, **kwargs}
    with pytest.raises(ValueError, match=message):
        TTMEmbedding(**arguments)


# ---- tied output head ----


@pytest.mark.parametrize("order", ["auto", "merge", "sequential", "dense"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_logits_match_dense_product(order, padding_idx):
    embedding = make_embedding(padding_idx=padding_idx)
    hidden = torch.randn(2, 3, DIM, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(ROWS, dtype=torch.float64, requires_grad=True)
    logits = embedding.tied_logits(hidden, bias, order)
    assert logits.shape == (2, 3, ROWS)
    reference = hidden @ embedding.to_dense().T + bias
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(logits)
    inputs = [hidden, bias, *embedding.cores, *embedding.gates]
    grads = torch.autograd.grad((logits * grad_out).sum(), inputs)
    ref_grads = torch.autograd.grad((reference * grad_out).sum(), inputs)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-10)


def test_tied_head_shares_the_embedding_parameters():
    embedding = make_embedding(padding_idx=0)
    head = TTMTiedHead(embedding)
    own = {id(param) for param in embedding.parameters()}
    head_params = list(head.parameters())
    assert own <= {id(param) for param in head_params}
    assert len(head_params) == len(own) + 1 and head.bias.shape == (ROWS,)
    hidden = torch.randn(5, DIM, dtype=torch.float64)
    torch.testing.assert_close(head(hidden), hidden @ embedding.to_dense().T)
    with torch.no_grad():
        embedding.cores[1].mul_(2.0)
    torch.testing.assert_close(head(hidden), hidden @ embedding.to_dense().T)
    assert TTMTiedHead(embedding, bias=False).bias is None


def test_tied_head_on_the_paper_table_does_not_keep_the_dense_table():
    embedding = TTMEmbedding(30522, 768, rank=32)
    hidden = torch.randn(4, 768, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logits = TTMTiedHead(embedding)(hidden)
    assert logits.shape == (4, 30522)
    assert max(saved) < 30522 * 768 // 4


def test_tied_logits_reject_bad_hidden():
    embedding = make_embedding()
    with pytest.raises(ValueError, match=r"hidden must have shape \(\*, 10\)"):
        embedding.tied_logits(torch.randn(3, 11, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        embedding.tied_logits(torch.ones(3, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="order must be one of"):
        TTMTiedHead(embedding, order="fastest")
    with pytest.raises(TypeError, match="TTMEmbedding"):
        TTMTiedHead(nn.Embedding(3, 4))
