"""The default lookup runs under torch.compile(fullgraph=True): no unique, no host sync, no graph break."""

import torch

from comera import TTMEmbedding


def test_auto_lookup_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    embedding = TTMEmbedding(60, 12, padding_idx=2, row_shape=(3, 4, 5), col_shape=(2, 3, 2), rank=3)
    indices = torch.tensor([[2, 7, 7, 7], [7, 59, 0, 7]])  # repeats: eager mode deduplicates these

    def step(inp):
        return embedding(inp).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    params = list(embedding.parameters())
    eager_loss = step(indices)
    eager_grads = torch.autograd.grad(eager_loss, params)
    compiled_loss = compiled(indices)
    compiled_grads = torch.autograd.grad(compiled_loss, params)
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
