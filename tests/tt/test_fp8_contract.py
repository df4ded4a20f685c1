"""Contract of :mod:`comera.tt.fp8` beyond accuracy: scales, operand layouts and padding handed to
``torch._scaled_mm``, default alignment, dtypes, argument errors and :func:`fp8_supported`.

References are independent of the implementation: scales from a float64 ``amax / torch.finfo(dtype).max``,
products from dense float64 matmuls of the dequantised operands, padded sizes from ``math.ceil``.
"""

import math
import re

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

FORMATS = [FORWARD_FORMAT, GRADIENT_FORMAT]


def _cpu_scaled_mm_works() -> bool:
    """Independent probe: one E5M2 x E4M3 product through ``torch._scaled_mm`` on CPU."""
    try:
        a = torch.full((4, 4), 2.0).to(GRADIENT_FORMAT)
        b = torch.full((4, 4), 0.5).to(FORWARD_FORMAT).t().contiguous().t()
        unit = torch.ones(())
        out = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=torch.float32)
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return False
    return bool((out == 4.0).all())


CPU_FP8 = _cpu_scaled_mm_works()
needs_cpu_fp8 = pytest.mark.skipif(not CPU_FP8, reason="torch._scaled_mm with FP8 is unavailable on this CPU")
pytestmark = pytest.mark.usefixtures("one_thread")


class _Spy:
    """Wraps ``torch._scaled_mm``, recording each call's operands (shape, strides, dtype, data pointer)."""

    def __init__(self, real):
        self.real = real
        self.calls = []

    def __call__(self, a, b, **kwargs):
        self.calls.append(
            {
                "a_shape": tuple(a.shape),
                "b_shape": tuple(b.shape),
                "a_stride": a.stride(),
                "b_stride": b.stride(),
                "a_ptr": a.data_ptr(),
                "b_ptr": b.data_ptr(),
                "dtypes": (a.dtype, b.dtype),
            }
        )
        return self.real(a, b, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    recorder = _Spy(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", recorder)
    return recorder


def _dequantised(q, scale):
    return q.double() * scale.double()


# ---------------------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("values", [[-3.0], [1000.0], [[0.25, -7.5], [3.0, 1e-3]]])
def test_quantize_scale_is_amax_over_the_format_max(dtype, values):
    tensor = torch.tensor(values, dtype=torch.float32)
    q, scale = quantize(tensor, dtype)
    largest = torch.finfo(dtype).max
    expected_scale = tensor.double().abs().max().item() / largest
    assert q.dtype == dtype and q.shape == tensor.shape
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == pytest.approx(expected_scale, rel=1e-6)
    # the largest entry lands on the format's largest value, with its sign
    peak = int(tensor.abs().argmax())
    assert q.flatten()[peak].float().item() == math.copysign(largest, tensor.flatten()[peak].item())


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (5, 0)])
def test_quantize_empty_tensor_keeps_shape_format_and_an_fp32_scale(dtype, shape):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the scale must stay fp32 whatever the global default is
    try:
        q, scale = quantize(torch.empty(shape, dtype=torch.float32), dtype)
    finally:
        torch.set_default_dtype(default)
    assert q.dtype == dtype and q.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == () and scale.device.type == "cpu"
    assert math.isfinite(scale.item()) and scale.item() >= torch.finfo(torch.float32).tiny


def test_quantize_scale_is_fp32_under_a_float64_default_dtype():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, scale = quantize(torch.tensor([[2.0, -5.0]], dtype=torch.float64), FORWARD_FORMAT)
    finally:
        torch.set_default_dtype(default)
    assert scale.dtype == torch.float32
    assert scale.item() == pytest.approx(5.0 / torch.finfo(FORWARD_FORMAT).max, rel=1e-6)


def test_quantize_empty_tensor_scale_lives_on_the_tensor_device():
    shape = (0, 3)
    q, scale = quantize(torch.empty(shape, device="meta"), FORWARD_FORMAT)
    assert q.device.type == "meta" and scale.device.type == "meta"
    assert q.shape == shape and q.dtype == FORWARD_FORMAT and scale.shape == ()


# ------------------------------------------------------------------------------------ scaled_matmul layout


def _fp8_pair(generator, rows, inner, cols):
    a, a_scale = quantize(torch.randn(rows, inner, generator=generator), FORWARD_FORMAT)
    b, b_scale = quantize(torch.randn(inner, cols, generator=generator), GRADIENT_FORMAT)
    return a, a_scale, b, b_scale


def _layouts(generator):
    """(name, a, b, a_already_row_major, b_already_column_major), every a (6, 5) and every b (5, 7)."""
    a, _, b, _ = _fp8_pair(generator, 6, 10, 14)
    b_cm = b.t().contiguous().t()  # (10, 14) column-major
    row_a = a[:, :5].contiguous()
    col_b = b_cm[:5, :7].t().contiguous().t()
    return [
        ("row-major a, column-major b", row_a, col_b, True, True),
        ("column-major a, row-major b", row_a.t().contiguous().t(), col_b.contiguous(), False, False),
        ("a with column stride 2, b with row stride 2", a[:, ::2], b_cm[::2, :7], False, False),
        # views already in the layout but not contiguous: a row-major slice of a, a column-major slice of b
        ("sliced row-major a, sliced column-major b", a[:, :5], b_cm[:5, :7], True, True),
    ]


@needs_cpu_fp8
def test_scaled_matmul_hands_row_major_a_and_column_major_b_to_scaled_mm(spy):
    generator = torch.Generator().manual_seed(11)
    a_scale, b_scale = torch.tensor(0.5), torch.tensor(0.25)
    for name, a, b, a_ready, b_ready in _layouts(generator):
        assert a.shape == (6, 5) and b.shape == (5, 7), name
        spy.calls.clear()
        got = scaled_matmul(a, a_scale, b, b_scale, torch.float32)
        expected = _dequantised(a, a_scale) @ _dequantised(b, b_scale)
        assert got.dtype == torch.float32 and got.shape == (6, 7), name
        assert float((got.double() - expected).abs().max()) <= 1e-6 * float(expected.abs().max()), name
        (call,) = spy.calls
        assert call["a_stride"][1] == 1, (name, call["a_stride"])
        assert call["b_stride"][0] == 1, (name, call["b_stride"])
        if a_ready:  # already row-major: passed through without a copy
            assert call["a_ptr"] == a.data_ptr(), name
        if b_ready:
            assert call["b_ptr"] == b.data_ptr(), name


# ------------------------------------------------------------------------- fp8_low_rank_linear GEMM sizes


def _operands(batch, m, r, n, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, m, generator=generator).to(dtype)
    left = torch.randn(m, r, generator=generator) / math.sqrt(m)
    right = torch.randn(r, n, generator=generator) / math.sqrt(r)
    bias = torch.randn(n, generator=generator)
    return x, left, right, bias


def _gemm_shapes(batch, m, r, n):
    """Operand shapes of the six GEMMs of the module docstring: forward T = X L, Y = T R; backward
    U = dY R^T, dX = U L^T, dL^T = U^T X, dR = T^T dY."""
    return sorted(
        [
            ((batch, m), (m, r)),
            ((batch, r), (r, n)),
            ((batch, n), (n, r)),
            ((batch, r), (r, m)),
            ((r, batch), (batch, m)),
            ((r, batch), (batch, n)),
        ]
    )


def _forward_backward(x, left, right, bias, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (x, left, right, bias)]
    out = fp8_low_rank_linear(*leaves, **kwargs)
    out.backward(torch.ones_like(out))
    return out


@needs_cpu_fp8
@pytest.mark.parametrize("alignment", [None, 1, 3, 16])
def test_gemm_dimensions_are_padded_to_the_alignment(spy, alignment):
    sizes = (37, 19, 5, 23)  # B, m, r, n: none a multiple of 2, 3 or 16
    out = _forward_backward(*_operands(*sizes), alignment=alignment)
    assert out.shape == (37, 23)
    multiple = 1 if alignment is None else alignment  # default on CPU: no padding
    padded = [math.ceil(size / multiple) * multiple for size in sizes]
    assert sorted((call["a_shape"], call["b_shape"]) for call in spy.calls) == _gemm_shapes(*padded)
    for call in spy.calls:
        assert all(isinstance(d, int) for d in call["a_shape"] + call["b_shape"])
        assert call["a_stride"][1] == 1 and call["b_stride"][0] == 1
        assert call["dtypes"] != (GRADIENT_FORMAT, GRADIENT_FORMAT)


@needs_cpu_fp8
def test_output_keeps_the_input_dtype_with_an_fp32_bias():
    x, left, right, bias = _operands(8, 6, 3, 5, seed=2, dtype=torch.bfloat16)
    out = fp8_low_rank_linear(x, left, right, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 5)
    reference = (x.double() @ left.double()) @ right.double() + bias.double()
    relative = float((out.double() - reference).norm() / reference.norm())
    assert relative < 0.15  # a few percent of FP8 (+ bf16 output) error, see tests/tt/test_fp8.py


# ------------------------------------------------------------------------------------------ argument errors


def _small():
    return torch.ones(4, 5), torch.ones(5, 2), torch.ones(2, 3)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_non_tensor_operand_is_a_named_type_error(position):
    names = ("x", "left", "right")
    args = list(_small())
    args[position] = args[position].tolist()
    with pytest.raises(TypeError, match=rf"^{names[position]} must be a torch\.Tensor, got list$"):
        fp8_low_rank_linear(*args)


@pytest.mark.parametrize(
    ("position", "bad"),
    [
        (1, torch.ones(5)),
        (1, torch.ones(5, 2, dtype=torch.int64)),
        (2, torch.ones(2, 3, 1)),
        (2, torch.ones(2, 3, dtype=torch.int32)),
    ],
)
def test_non_matrix_operand_is_named(position, bad):
    names = ("x", "left", "right")
    args = list(_small())
    args[position] = bad
    shape = re.escape(str(tuple(bad.shape)))
    match = rf"^{names[position]} must be a 2-D floating-point tensor, got shape {shape} dtype {bad.dtype}$"
    with pytest.raises(ValueError, match=match):
        fp8_low_rank_linear(*args)


@pytest.mark.parametrize(
    ("bias", "got"), [(torch.ones(4), "(4,)"), (torch.ones(3, 1), "(3, 1)"), ([0.0, 1.0, 2.0], "list")]
)
def test_bad_bias_message_names_what_was_given(bias, got):
    with pytest.raises(
        ValueError, match=rf"^bias must be None or a tensor of shape \(3,\), got {re.escape(got)}$"
    ):
        fp8_low_rank_linear(*_small(), bias)


@pytest.mark.parametrize("alignment", [True, False, 2.0, 0, -16, "16"])
def test_bad_alignment_is_named(alignment):
    with pytest.raises(
        ValueError, match=rf"^alignment must be an int >= 1 or None, got {re.escape(repr(alignment))}$"
    ):
        fp8_low_rank_linear(*_small(), alignment=alignment)


# ------------------------------------------------------------------------------------------- fp8_supported


def test_fp8_supported_on_cpu_matches_a_direct_probe():
    assert fp8_supported() is CPU_FP8
    assert fp8_supported("cpu") is CPU_FP8
    assert fp8_supported(torch.device("cpu")) is CPU_FP8


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
def test_fp8_supported_is_false_on_a_backend_this_build_cannot_run():
    with pytest.raises(NotImplementedError):  # the premise: no tensor can even be made there
        torch.ones(1, device="mps")
    assert fp8_supported("mps") is False


@pytest.mark.parametrize(
    ("device", "available"), [("cuda", torch.cuda.is_available), ("xpu", lambda: torch.xpu.is_available())]
)
def test_fp8_supported_is_false_on_a_backend_this_build_lacks(device, available):
    """A CPU-only build raises AssertionError ("Torch not compiled with CUDA enabled") on any CUDA/XPU
    tensor; the probe must answer False rather than raise."""
    if available():
        pytest.skip(f"{device} is available here")
    assert fp8_supported(device) is False
