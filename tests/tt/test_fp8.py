"""FP8 batch-sized GEMMs (:mod:`comera.tt.fp8`) against fp32 references.

Error bound used below. Rounding to nearest with ``p`` significand bits has a relative error of at most
``u = 2^-p`` per entry: ``u = 2^-4`` for E4M3 (3 stored mantissa bits + the implicit one) and ``u = 2^-3`` for
E5M2. Per-tensor amax scaling maps each operand's largest entry to the format's largest value, so all but
negligibly small entries are normal numbers and keep that relative precision; a quantised operand is the
exact one plus a perturbation of relative Frobenius norm at most ``u``. The perturbations are uncorrelated
with the data and with each other, so to first order they add in quadrature through the GEMMs (a product
``A B`` of perturbed operands is off by ``dA B + A dB``, whose Frobenius norm relative to ``||A B||`` is
about ``sqrt(u_A^2 + u_B^2)`` for data without special alignment). An output therefore lies within
``sqrt(sum u_i^2)`` over every quantisation upstream of it:

- ``Y = Q(Q(X) Q(L)) Q(R)``: four E4M3 roundings, bound ``2 * 2^-4 = 0.125``;
- ``dX = Q(Q(dY) Q(R)^T) Q(L)^T``: ``dY`` and ``U`` in E5M2, ``R`` and ``L`` in E4M3, bound ``0.198``;
- ``dL = (Q(U)^T Q(X))^T``: the same four roundings (``X`` instead of ``L``), bound ``0.198``;
- ``dR = Q(T)^T Q(dY)``: ``X``, ``L``, ``T`` in E4M3 and ``dY`` in E5M2, bound ``0.165``;
- ``db = sum(dY)`` in fp32: fp32 accuracy.

The root-mean-square rounding error is below ``u`` (``u / sqrt(3)`` for a uniform error), so measured
errors sit at 30-45 % of the bounds (0.038, 0.084, 0.085, 0.070 for Gaussian data); each test also checks
that the error is above ``u_E4M3 / 8``, i.e. that the GEMMs really ran in FP8 (fp32 would give ~1e-7).
"""

import math

import pytest
import torch

from comera.tt.fp8 import (
    FORWARD_FORMAT,
    GRADIENT_FORMAT,
    fp8_low_rank_linear,
    fp8_supported,
    quantize,
    scaled_matmul,
)

# small FP8 GEMMs on CPU are dominated by per-call overhead, which grows with threads on a busy CPU
pytestmark = [
    pytest.mark.skipif(
        not fp8_supported("cpu"), reason="torch._scaled_mm with FP8 operands is unavailable on this CPU build"
    ),
    pytest.mark.usefixtures("one_thread"),
]

E4M3_U = 2.0**-4
E5M2_U = 2.0**-3
BOUNDS = {
    "y": math.sqrt(4 * E4M3_U**2),
    "x": math.sqrt(2 * E4M3_U**2 + 2 * E5M2_U**2),
    "left": math.sqrt(2 * E4M3_U**2 + 2 * E5M2_U**2),
    "right": math.sqrt(3 * E4M3_U**2 + E5M2_U**2),
}
FLOOR = E4M3_U / 8


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _operands(batch, m, r, n, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, m, generator=generator)
    left = torch.randn(m, r, generator=generator) / math.sqrt(m)
    right = torch.randn(r, n, generator=generator) / math.sqrt(r)
    b = torch.randn(n, generator=generator) if bias else None
    grad = torch.randn(batch, n, generator=generator)
    return x, left, right, b, grad


def _run(function, x, left, right, bias, grad, **kwargs):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, left, right, bias)]
    out = function(*leaves, **kwargs)
    out.backward(grad)
    grads = {name: t.grad for name, t in zip(("x", "left", "right", "bias"), leaves) if t is not None}
    return out.detach(), grads


def _fp32(x, left, right, bias):
    out = (x @ left) @ right
    return out if bias is None else out + bias


@pytest.mark.parametrize(("batch", "m", "r", "n"), [(256, 96, 12, 160), (37, 19, 5, 23)])
def test_forward_and_gradients_within_fp8_error_of_fp32(batch, m, r, n):
    operands = _operands(batch, m, r, n)
    out, grads = _run(fp8_low_rank_linear, *operands)
    ref_out, ref_grads = _run(_fp32, *operands)
    errors = {"y": _relative(out, ref_out)}
    errors.update({name: _relative(grads[name], ref_grads[name]) for name in ("x", "left", "right")})
    for name, error in errors.items():
        assert FLOOR < error < BOUNDS[name], (name, error, BOUNDS[name])
    torch.testing.assert_close(grads["bias"], ref_grads["bias"])


def test_matches_an_emulation_that_dequantises_every_operand():
    """The same chain written out with dequantised fp32 GEMMs: which operand gets which format and scale."""
    x, left, right, bias, grad = _operands(64, 24, 6, 40)

    def fake(t, dtype):
        q, scale = quantize(t, dtype)
        return q.float() * scale

    inner = fake(x, FORWARD_FORMAT) @ fake(left, FORWARD_FORMAT)
    expected_y = fake(inner, FORWARD_FORMAT) @ fake(right, FORWARD_FORMAT) + bias
    grad_fake = fake(grad, GRADIENT_FORMAT)
    projected = fake(grad_fake @ fake(right, FORWARD_FORMAT).t(), GRADIENT_FORMAT)
    expected = {
        "x": projected @ fake(left, FORWARD_FORMAT).t(),
        "left": fake(x, FORWARD_FORMAT).t() @ projected,
        "right": fake(inner, FORWARD_FORMAT).t() @ grad_fake,
        "bias": grad.sum(0),
    }
    out, grads = _run(fp8_low_rank_linear, x, left, right, bias, grad)
    torch.testing.assert_close(out, expected_y, rtol=1e-5, atol=1e-5)
    for name, value in expected.items():
        torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-5)


def test_padding_to_multiples_of_16_changes_nothing_but_rounding():
    operands = _operands(37, 19, 5, 23)
    out, grads = _run(fp8_low_rank_linear, *operands, alignment=1)
    padded_out, padded_grads = _run(fp8_low_rank_linear, *operands, alignment=16)
    assert padded_out.shape == (37, 23)
    torch.testing.assert_close(padded_out, out, rtol=1e-5, atol=1e-5)
    for name, value in grads.items():
        assert padded_grads[name].shape == value.shape
        torch.testing.assert_close(padded_grads[name], value, rtol=1e-5, atol=1e-5)


def test_zero_input_gives_zeros_not_nan():
    x, left, right, bias, grad = _operands(8, 16, 4, 16)
    out, grads = _run(fp8_low_rank_linear, torch.zeros_like(x), left, right, bias, grad)
    torch.testing.assert_close(out, bias.expand(8, 16))
    assert torch.count_nonzero(grads["right"]) == 0
    assert torch.isfinite(grads["left"]).all() and torch.count_nonzero(grads["left"]) == 0
    out, grads = _run(fp8_low_rank_linear, x, left, right, None, torch.zeros_like(grad))
    assert all(torch.count_nonzero(value) == 0 for value in grads.values())


def test_non_finite_input_reaches_the_output():
    x, left, right, bias, _ = _operands(8, 16, 4, 16)
    x[3, 2] = float("inf")
    assert not torch.isfinite(fp8_low_rank_linear(x, left, right, bias)).all()


@pytest.mark.parametrize(("dtype", "u"), [(FORWARD_FORMAT, E4M3_U), (GRADIENT_FORMAT, E5M2_U)])
def test_quantize_scale_and_entrywise_error(dtype, u):
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(50, 30, generator=generator) * 7.0
    q, scale = quantize(values, dtype)
    assert q.dtype == dtype and scale.dtype == torch.float32 and scale.dim() == 0
    torch.testing.assert_close(scale, values.abs().max() / torch.finfo(dtype).max)
    restored = q.float() * scale
    assert float(restored.abs().max()) == pytest.approx(float(values.abs().max()), rel=u)
    normal = values.abs() > torch.finfo(dtype).tiny * scale
    assert ((restored - values).abs()[normal] <= u * values.abs()[normal] * (1 + 1e-6)).all()
    zeros, zero_scale = quantize(torch.zeros(4, 4), dtype)
    assert zero_scale > 0 and torch.count_nonzero(zeros.float()) == 0


def test_scaled_matmul_accepts_any_layout():
    generator = torch.Generator().manual_seed(4)
    a, a_scale = quantize(torch.randn(20, 12, generator=generator), FORWARD_FORMAT)
    b, b_scale = quantize(torch.randn(12, 9, generator=generator), GRADIENT_FORMAT)
    expected = (a.float() * a_scale) @ (b.float() * b_scale)
    got = scaled_matmul(a.t().contiguous().t(), a_scale, b.contiguous(), b_scale, torch.float32)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.randn(4), torch.randn(4, 2), torch.randn(2, 3)), "x must be a 2-D"),
        ((torch.randn(4, 5), torch.randn(4, 2), torch.randn(2, 3)), r"left must have shape \(5, r\)"),
        ((torch.randn(4, 5), torch.randn(5, 2), torch.randn(3, 3)), r"right must have shape \(2, n\)"),
        (
            (torch.randn(4, 5), torch.randn(5, 2), torch.randn(2, 3), torch.randn(4)),
            r"bias must be .* \(3,\)",
        ),
    ],
)
def test_bad_operands_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        fp8_low_rank_linear(*args)


def test_bad_alignment_and_format_are_named():
    x, left, right, _, _ = _operands(4, 5, 2, 3)
    with pytest.raises(ValueError, match="alignment must be an int >= 1"):
        fp8_low_rank_linear(x, left, right, alignment=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize(x, torch.bfloat16)


def _train(low_rank, steps=150, seed=0):
    """Teacher-student regression: 24 -> low-rank (rank 6) -> tanh -> 1, Adam, full batch of 128."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(128, 24, generator=generator)
    teacher = torch.randn(24, 6, generator=generator) @ torch.randn(6, 32, generator=generator) / 6
    targets = torch.tanh(inputs @ teacher) @ torch.randn(32, 1, generator=generator)
    left = torch.nn.Parameter(torch.randn(24, 6, generator=generator) / math.sqrt(24))
    right = torch.nn.Parameter(torch.randn(6, 32, generator=generator) / math.sqrt(6))
    bias = torch.nn.Parameter(torch.zeros(32))
    head = torch.nn.Linear(32, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 32, generator=generator) / math.sqrt(32))
        head.bias.zero_()
    optimizer = torch.optim.Adam([left, right, bias, *head.parameters()], lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(head(torch.tanh(low_rank(inputs, left, right, bias))), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_training_with_fp8_converges_like_fp32():
    fp32 = _train(_fp32)
    fp8 = _train(fp8_low_rank_linear)
    assert fp32[-1] < 0.05 * fp32[0]
    assert fp8[-1] < 0.05 * fp8[0]
    assert fp8[-1] < 1.5 * fp32[-1]
    assert fp8 != fp32
