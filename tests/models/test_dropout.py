"""Fast dropout keeps dropout's meaning: independent keep decisions at rate 1 - q, scaling 1 / (1 - q)."""

import math

import numpy as np
import pytest
import torch

from comera.models.dropout import FastDropout, fast_dropout, keep_mask, quantized_p

N = 1 << 20


def _tolerance(rate: float, n: int, sigmas: float = 5.0) -> float:
    return sigmas * math.sqrt(rate * (1 - rate) / n)


def test_quantized_p_is_p_rounded_to_1_over_256():
    assert quantized_p(0.1) == 26 / 256
    assert quantized_p(0.5) == 0.5
    assert quantized_p(0.0) == 0.0
    assert quantized_p(1e-6) == 1 / 256
    assert quantized_p(0.9999) == 255 / 256


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_tolerance(p):
    kept = keep_mask((N,), p).double().mean().item()
    want = 1 - quantized_p(p)
    assert abs(kept - want) < _tolerance(want, N)


def test_every_byte_of_a_word_keeps_at_the_same_rate():
    keep = keep_mask((N,), 0.3).view(-1, 8).double().mean(0)
    want = 1 - quantized_p(0.3)
    assert (keep - want).abs().max().item() < _tolerance(want, N // 8)


def test_keep_decisions_are_uncorrelated():
    keep = keep_mask((N,), 0.25).double().numpy()
    tol = 5.0 / math.sqrt(N)
    for lag in (1, 2, 7, 8, 9, 64):
        corr = np.corrcoef(keep[:-lag], keep[lag:])[0, 1]
        assert abs(corr) < tol, (lag, corr)
    other = keep_mask((N,), 0.25).double().numpy()
    assert abs(np.corrcoef(keep, other)[0, 1]) < tol


def test_pairs_of_decisions_are_independent():
    keep = keep_mask((N,), 0.5).view(-1, 2)
    both = (keep[:, 0] & keep[:, 1]).double().mean().item()
    assert abs(both - 0.25) < _tolerance(0.25, N // 2)


def test_kept_entries_are_scaled_and_dropped_ones_are_zero():
    x = torch.randn(4096, dtype=torch.float64) + 3.0
    y = fast_dropout(x, 0.2)
    scale = 1.0 / (1.0 - quantized_p(0.2))
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] * scale, rtol=0, atol=1e-15)
    assert 0 < kept.sum() < x.numel()


def test_expectation_is_the_input():
    x = torch.full((N,), 2.0, dtype=torch.float64)
    mean = fast_dropout(x, 0.1).mean().item()
    q = quantized_p(0.1)
    assert abs(mean - 2.0) < 5 * 2.0 * math.sqrt(q / (1 - q) / N)


def test_gradient_is_the_same_mask_and_scale():
    x = torch.randn(3, 5, 7, requires_grad=True)
    torch.manual_seed(3)
    y = fast_dropout(x, 0.4)
    grad = torch.randn_like(y)
    y.backward(grad)
    scale = 1.0 / (1.0 - quantized_p(0.4))
    torch.testing.assert_close(x.grad, torch.where(y != 0, grad * scale, 0.0))


def test_same_seed_same_mask_and_shape_kept():
    torch.manual_seed(1)
    a = keep_mask((3, 5, 11), 0.1)
    torch.manual_seed(1)
    b = keep_mask((3, 5, 11), 0.1)
    assert a.shape == (3, 5, 11) and a.dtype == torch.bool and torch.equal(a, b)


def test_module_is_identity_in_eval_and_for_p_zero():
    x = torch.randn(10, 10)
    module = FastDropout(0.5).eval()
    assert module(x) is x
    assert fast_dropout(x, 0.0) is x
    assert "0.5" in repr(module)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, "0.1", True])
def test_bad_p_names_the_range(p):
    with pytest.raises(ValueError, match=r"p must be a finite number in \[0.0, 1.0\)"):
        FastDropout(p)
