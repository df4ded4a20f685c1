"""torch.export.export of a tensorized model: the exported program, run with autograd on (outside
``torch.no_grad``), gives the eager model's output and parameter gradients, in training and in eval mode."""

import pytest
import torch
from torch import nn

import comera

VOCAB, WIDTH, HIDDEN = 1024, 256, 1024  # sizes at which the TT layers take the merge-first GEMM path


def _model(layer_format: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH)
    )
    return comera.tensorize_(model, rank=8, embeddings=True, format=layer_format)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("layer_format", ["tt", "ttm"])
def test_the_exported_program_matches_eager_with_autograd_on(layer_format, mode):
    model = getattr(_model(layer_format), mode)()
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    assert torch.is_grad_enabled()
    exported = torch.export.export(model, (ids,)).module()
    want = model(ids)
    got = exported(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = dict(model.named_parameters())
    want_grads = torch.autograd.grad(want.square().sum(), list(params.values()))
    exported_params = dict(exported.named_parameters())
    got_grads = torch.autograd.grad(got.square().sum(), [exported_params[name] for name in params])
    for name, got_grad, want_grad in zip(params, got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5, msg=name)
