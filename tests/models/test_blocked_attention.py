"""The block-by-block dropout attention against attention written out in float64 with the same keep mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera.models import blocked_attention
from comera.models.attention import attention_context
from comera.models.blocked_attention import blocked_dropout_attention
from comera.models.dropout import drop_threshold, keep_mask, quantized_p, random_bytes


def _head_views(batch: int, heads: int, length: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """``(B, H, T, d)`` as the projections give it: a head-split view of a ``(B, T, H, d)`` tensor."""
    x = torch.randn(batch, length, heads, width, generator=generator, dtype=torch.float64)
    return x.transpose(1, 2).requires_grad_()


def _reference(q, k, v, bias, keep, scale):
    # b batch, h head, i query, j key, e head feature
    scores = torch.einsum("bhie,bhje->bhij", q, k) * scale
    if bias is not None:
        scores = scores + bias
    return torch.einsum("bhij,bhje->bhie", scores.softmax(-1) * keep, v)


def _padding_bias(batch: int, keys: int, lengths: list[int]) -> torch.Tensor:
    bias = torch.zeros(batch, 1, 1, keys, dtype=torch.float64)
    for row, length in enumerate(lengths):
        bias[row, ..., length:] = float("-inf")
    return bias


@settings(deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 4),
    rows=st.integers(1, 7),
    keys=st.integers(1, 7),
    width=st.integers(1, 5),
    block=st.sampled_from([1, 7, 40, 1 << 19]),
    p=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
    padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_values_and_gradients_equal_the_written_out_attention(
    batch, heads, rows, keys, width, block, p, padded, seed
):
    """Every block layout (one head per block, groups of heads, all heads) gives the reference."""
    generator = torch.Generator().manual_seed(seed)
    q = _head_views(batch, heads, rows, width, generator)
    k, v = (_head_views(batch, heads, keys, width, generator) for _ in range(2))
    lengths = torch.randint(1, keys + 1, (batch,), generator=generator).tolist()
    bias = _padding_bias(batch, keys, lengths) if padded else None
    drop_bytes = torch.randint(0, 256, (batch, heads, rows, keys), generator=generator, dtype=torch.uint8)
    threshold, keep_scale, scale = drop_threshold(p), 1 / (1 - quantized_p(p)), 0.7
    keep = (drop_bytes >= threshold).double() * keep_scale
    grad = torch.randn(batch, heads, rows, width, generator=generator, dtype=torch.float64)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blocked_attention, "BLOCK_ELEMENTS", block)
        got = blocked_dropout_attention(q, k, v, bias, drop_bytes, threshold, scale, keep_scale)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want = _reference(q, k, v, bias, keep, scale)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)

    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_across_several_blocks(monkeypatch):
    monkeypatch.setattr(blocked_attention, "BLOCK_ELEMENTS", 12)
    generator = torch.Generator().manual_seed(0)
    q = _head_views(2, 3, 4, 3, generator)
    k, v = (_head_views(2, 3, 5, 3, generator) for _ in range(2))
    bias = _padding_bias(2, 5, [5, 2])
    drop_bytes = torch.randint(0, 256, (2, 3, 4, 5), generator=generator, dtype=torch.uint8)

    def attention(q, k, v):
        return blocked_dropout_attention(q, k, v, bias, drop_bytes, 64, 0.5, 4 / 3)

    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_output_and_gradients_are_stored_token_major():
    """So the caller's ``transpose(1, 2).flatten(2)`` and the projections' gradients need no copies."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (_head_views(2, 3, 4, 5, generator) for _ in range(3))
    drop_bytes = random_bytes((2, 3, 4, 4), "cpu")
    out = blocked_dropout_attention(q, k, v, None, drop_bytes, drop_threshold(0.1), 0.5, 1.1)
    assert out.transpose(1, 2).is_contiguous()
    grad_q, grad_k, grad_v = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(grad.transpose(1, 2).is_contiguous() for grad in (grad_q, grad_k, grad_v))


def test_attention_context_in_training_draws_the_same_mask_as_the_keep_mask():
    """The CPU training path of attention_context, bool mask included, against :func:`keep_mask`'s draws."""
    generator = torch.Generator().manual_seed(2)
    q, k, v = (_head_views(2, 2, 6, 4, generator) for _ in range(3))
    allowed = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    allowed[0, ..., 3:] = False
    torch.manual_seed(11)
    got = attention_context(q, k, v, allowed, 0.3, scale=0.4)
    torch.manual_seed(11)
    keep = keep_mask((2, 2, 6, 6), 0.3).double() / (1 - quantized_p(0.3))
    bias = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(got, _reference(q, k, v, bias, keep, 0.4), rtol=1e-12, atol=1e-12)


def test_the_dropout_rate_holds_through_the_attention():
    """With v = 1 each output entry is the kept probability mass times 1/(1-q); its mean over many rows is
    1 and the share of dropped probabilities matches q within binomial tolerance."""
    torch.manual_seed(0)
    batch, heads, length = 8, 4, 64
    q = torch.zeros(batch, heads, length, 1)
    k = torch.zeros(batch, heads, length, 1)
    v = torch.ones(batch, heads, length, 1)
    out = attention_context(q, k, v, None, 0.1)
    mass = out.flatten() * (1 - quantized_p(0.1))
    dropped = 1 - float(mass.mean())
    count = batch * heads * length * length
    q_used = quantized_p(0.1)
    assert abs(dropped - q_used) < 6 * (q_used * (1 - q_used) / count) ** 0.5


def test_bad_inputs_are_named():
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"random_bytes must be uint8 of shape \(1, 2, 3, 3\)"):
        blocked_dropout_attention(q, k, v, None, torch.zeros(1, 2, 3, 4, dtype=torch.uint8), 26, 1.0, 1.0)
    with pytest.raises(ValueError, match="random_bytes must be uint8"):
        blocked_dropout_attention(q, k, v, None, torch.zeros(1, 2, 3, 3), 26, 1.0, 1.0)
    bias = torch.zeros(1, 1, 1, 3, requires_grad=True)
    with pytest.raises(ValueError, match="bias: an attention bias that requires grad"):
        blocked_dropout_attention(q, k, v, bias, torch.zeros(1, 2, 3, 3, dtype=torch.uint8), 26, 1.0, 1.0)


def test_attention_context_blocks_only_scores_that_exceed_one_block(monkeypatch):
    """Scores that fit in one block take the plain path, larger ones the blocked kernel; both draw the same
    mask, so at the same seed they agree to rounding (float64)."""
    import comera.models.attention as attention

    calls = []
    blocked = attention.blocked_dropout_attention
    monkeypatch.setattr(
        attention, "blocked_dropout_attention", lambda *args: calls.append(1) or blocked(*args)
    )
    generator = torch.Generator().manual_seed(3)
    q, k, v = (_head_views(2, 3, 8, 4, generator) for _ in range(3))
    torch.manual_seed(5)
    plain = attention.attention_context(q, k, v, None, 0.2)
    assert calls == []
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 2 * 3 * 8 * 8 - 1)
    torch.manual_seed(5)
    blocks = attention.attention_context(q, k, v, None, 0.2)
    assert calls == [1]
    torch.testing.assert_close(blocks, plain, rtol=1e-12, atol=1e-12)
