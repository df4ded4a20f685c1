"""TTM tables in eval mode without autograd reuse merged halves; rows follow every change of the cores."""

from __future__ import annotations

import pytest
import torch

from comera import TTMEmbedding, TTMEmbeddingBag


def make_table(cls=TTMEmbedding, **kwargs):
    torch.manual_seed(0)
    table = cls(97, 10, row_shape=(4, 5, 5), col_shape=(2, 3, 2), rank=3, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for gate in table.gates:
            gate.uniform_(0.5, 1.5)
    return table.eval()


def cached(table) -> bool:
    return "_inference_cache" in table.__dict__


@pytest.mark.parametrize("lookup", ["split", "optimized", "auto"])
def test_eval_rows_match_the_table_and_follow_updates(lookup):
    table = make_table(lookup=lookup)
    ids = torch.tensor([[3, 96, 3], [0, 50, 7]])
    optimizer = torch.optim.SGD(table.parameters(), lr=0.5)
    with torch.no_grad():
        torch.testing.assert_close(table(ids), table.to_dense()[ids])
    assert cached(table)
    table.train()
    table(ids).square().sum().backward()
    optimizer.step()
    table.eval()
    with torch.no_grad():
        torch.testing.assert_close(table(ids), table.to_dense()[ids])
        table.gates[0][1] = 0.0
        torch.testing.assert_close(table(ids), table.to_dense()[ids])


def test_naive_lookup_and_training_calls_build_no_cache():
    table = make_table(lookup="naive")
    with torch.no_grad():
        table(torch.tensor([1, 2]))
    assert not cached(table)
    table.lookup = "split"
    table(torch.tensor([1, 2])).sum().backward()
    table.train()
    with torch.no_grad():
        table(torch.tensor([1, 2]))
    assert not cached(table)


def test_bag_in_eval_mode_pools_the_cached_rows():
    bag = make_table(TTMEmbeddingBag, mode="sum", lookup="split")
    ids, offsets = torch.tensor([4, 9, 4, 60]), torch.tensor([0, 3])
    dense = bag.to_dense()
    with torch.inference_mode():
        got = bag(ids, offsets)
    want = torch.stack([dense[ids[:3]].sum(0), dense[ids[3:]].sum(0)])
    torch.testing.assert_close(got, want.detach())
    assert cached(bag)
