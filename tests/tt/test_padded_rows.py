"""``padded_rows_linear`` against the plain product with the padding rows cut and the pinned row zeroed."""

import pytest
import torch

from comera.tt.padded import padded_rows_linear


def _reference(x, weight, bias, out_features, zero_row):
    kept = weight[:out_features].clone()
    if zero_row is not None:
        kept[zero_row] = 0.0
    return x @ kept.t() + (0 if bias is None else bias)


@pytest.mark.parametrize("zero_row", [None, 0, 4])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("out_features", [5, 7])
def test_values_and_gradients_match_the_sliced_product(zero_row, with_bias, out_features):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(out_features, dtype=torch.float64, generator=generator) if with_bias else None
    if bias is not None:
        bias.requires_grad_()
    got = padded_rows_linear(x, weight, bias, out_features, zero_row)
    want = _reference(x, weight, bias, out_features, zero_row)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [x, weight] + ([bias] if with_bias else [])
    upstream = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * upstream).sum(), inputs)
    want_grads = torch.autograd.grad((want * upstream).sum(), inputs)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert not got_grads[1][out_features:].any()
    assert torch.autograd.gradcheck(
        lambda *t: padded_rows_linear(*t[:2], t[2] if with_bias else None, out_features, zero_row),
        (x, weight, bias),
    )


@pytest.mark.parametrize(
    "out_features, zero_row, message",
    [
        (0, None, r"out_features must be in \[1, 7\], got 0"),
        (8, None, r"out_features must be in \[1, 7\], got 8"),
        (5, 5, r"zero_row must be in \[0, 4\] or None, got 5"),
        (5, -1, r"zero_row must be in \[0, 4\] or None"),
    ],
)
def test_bad_sizes_name_the_argument_and_range(out_features, zero_row, message):
    with pytest.raises(ValueError, match=message):
        padded_rows_linear(torch.randn(2, 4), torch.randn(7, 4), None, out_features, zero_row)
