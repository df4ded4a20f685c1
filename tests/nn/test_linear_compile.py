"""torch.compile(fullgraph=True) runs the layers (forward and backward) with no graph break."""

import pytest
import torch

from comera import TTLinear, TTMLinear


@pytest.mark.parametrize("cls", [TTLinear, TTMLinear])
def test_fullgraph_compile_matches_eager(cls):
    torch._dynamo.reset()
    layer = cls(48, 40, rank=4, in_shape=(4, 12), out_shape=(8, 5))
    x = torch.randn(2, 9, 48, requires_grad=True)

    def step(inp):
        return layer(inp).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_loss = step(x)
    eager_grads = torch.autograd.grad(eager_loss, [x, *layer.parameters()])
    compiled_loss = compiled(x)
    compiled_grads = torch.autograd.grad(compiled_loss, [x, *layer.parameters()])
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
