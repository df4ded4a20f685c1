"""The batch-sized autograd functions under autocast and with a workspace: what their GEMMs run in and where.

References: a ``TorchDispatchMode`` records each GEMM the backward dispatches (after autocast has cast its
inputs) with its input dtypes and its output's address; the workspace is a recording subclass of
:class:`~comera.tt.workspace.Workspace` that remembers the views it hands out. Values are compared with the
float64 product ``x @ W + b``, ``W[(il, ir), (jl, jr)] = sum_a A[il, jl, a] C[a, ir, jr]``.

Index legend (einsum): i/k left / right input mode, j/l left / right output mode, a the bond rank.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera.tt.contract import low_rank_linear, tt_merge_linear, ttm_split_linear
from comera.tt.workspace import Workspace

_GEMMS = {"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"}


class _RecordGemms(TorchDispatchMode):
    """``(input dtypes, output data_ptr, output shape)`` of every GEMM dispatched inside the mode."""

    def __init__(self):
        super().__init__()
        self.gemms: list[tuple[tuple[torch.dtype, ...], int, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) in _GEMMS:
            dtypes = tuple(arg.dtype for arg in args if isinstance(arg, torch.Tensor))
            self.gemms.append((dtypes, out.data_ptr(), tuple(out.shape)))
        return out


class _RecordingWorkspace(Workspace):
    def __init__(self):
        super().__init__()
        self.views: list[torch.Tensor] = []

    def take(self, name, shape, like):
        view = super().take(name, shape, like)
        self.views.append(view)
        return view


def _low_rank_inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=generator, requires_grad=True)
    left = torch.randn(6, 3, generator=generator, requires_grad=True)
    right = torch.randn(3, 4, generator=generator, requires_grad=True)
    return x, left, right


def _backward_gemm_dtypes(out):
    loss = out.float().sum()
    with _RecordGemms() as record:
        loss.backward()
    return {dtypes for dtypes, _, _ in record.gemms}


def test_backward_replays_the_forward_autocast_dtype_not_the_default_one():
    """Forward under float16 autocast, backward outside any autocast: the backward GEMMs take float16 (the
    forward's dtype), not bfloat16 (CPU autocast's default dtype)."""
    x, left, right = _low_rank_inputs()
    with torch.autocast("cpu", dtype=torch.float16):
        out = low_rank_linear(x, left, right)
    assert _backward_gemm_dtypes(out) == {(torch.float16, torch.float16)}
    assert left.grad.dtype == right.grad.dtype == x.grad.dtype == torch.float32


def test_backward_of_a_forward_without_autocast_stays_fp32_under_an_enclosing_autocast():
    """Forward without autocast, ``backward()`` called inside a bfloat16 autocast: the backward replays the
    forward's (disabled) state, so its GEMMs run in float32 and the gradients are float32-accurate."""
    x, left, right = _low_rank_inputs()
    out = low_rank_linear(x, left, right)
    loss = out.sum()
    with torch.autocast("cpu", dtype=torch.bfloat16), _RecordGemms() as record:
        loss.backward()
    assert {dtypes for dtypes, _, _ in record.gemms} == {(torch.float32, torch.float32)}
    # d sum(x L R) / dL = x^T 1 R^T (float64 reference; bfloat16 GEMMs would be off by about 1e-2)
    expected = x.detach().double().t() @ torch.ones(5, 4, dtype=torch.float64) @ right.detach().double().t()
    torch.testing.assert_close(left.grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_low_rank_backward_computes_dy_rt_into_the_workspace():
    """``U = dY R^T`` (B, r) = (5, 3) goes into the one view the workspace hands out."""
    x, left, right = _low_rank_inputs()
    workspace = _RecordingWorkspace()
    loss = (low_rank_linear(x, left, right, None, workspace) * torch.linspace(-1, 1, 4)).sum()
    with _RecordGemms() as record:
        loss.backward()
    assert [tuple(view.shape) for view in workspace.views] == [(5, 3)]
    assert [ptr for _, ptr, shape in record.gemms if shape == (5, 3)] == [workspace.views[0].data_ptr()]
    # d loss / dL = x^T (w R^T), w the (5, 4) output weights; float64 reference
    weights = torch.linspace(-1, 1, 4, dtype=torch.float64).expand(5, 4)
    expected = x.detach().double().t() @ (weights @ right.detach().double().t())
    torch.testing.assert_close(left.grad.double(), expected, rtol=1e-5, atol=1e-5)


def test_low_rank_backward_under_autocast_bypasses_the_workspace_even_with_matching_dtypes():
    """bfloat16 inputs and factors under bfloat16 autocast: ``dY`` and ``R`` share a dtype, yet the GEMMs are
    left to autocast and the workspace stays empty."""
    x, left, right = (tensor.detach().bfloat16().requires_grad_() for tensor in _low_rank_inputs())
    workspace = _RecordingWorkspace()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = low_rank_linear(x, left, right, None, workspace)
    assert _backward_gemm_dtypes(out) == {(torch.bfloat16, torch.bfloat16)}
    assert workspace.views == [] and workspace.allocations == 0


def test_tt_merge_backward_computes_dy_rt_into_the_workspace():
    """``U = dY R^T`` (B, r) = (5, 3) is written into the one view the workspace hands out; the results
    equal those without a workspace. Train: cores (1, 2, 3), (3, 3, 3) | (3, 4, 1); m = 6, n = 4, r = 3."""
    generator = torch.Generator().manual_seed(2)
    shapes = [(1, 2, 3), (3, 3, 3), (3, 4, 1)]
    cores = [torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes]
    x = torch.randn(5, 6, generator=generator, requires_grad=True)

    def grads(workspace):
        for tensor in (x, *cores):
            tensor.grad = None
        loss = (tt_merge_linear(x, cores, 2, 4, workspace=workspace) * torch.linspace(-1, 1, 4)).sum()
        with _RecordGemms() as record:
            loss.backward()
        return record, [tensor.grad.clone() for tensor in (x, *cores)]

    workspace = _RecordingWorkspace()
    record, with_workspace = grads(workspace)
    assert [tuple(view.shape) for view in workspace.views] == [(5, 3)]
    assert workspace.nbytes() == 5 * 3 * 4
    assert [ptr for _, ptr, shape in record.gemms if shape == (5, 3)] == [workspace.views[0].data_ptr()]
    for grad, reference in zip(with_workspace, grads(None)[1]):
        assert torch.equal(grad, reference)


def _ttm_inputs(batch=5, bias_dtype=torch.float32):
    """``A (M_L, N_L, r) = (2, 3, 4)``, ``C (r, M_R, N_R) = (4, 2, 2)``: 4 inputs, 6 outputs; batch != N_L so
    a scratch of the wrong leading size shows."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, generator=generator, requires_grad=True)
    left = torch.randn(2, 3, 4, generator=generator, requires_grad=True)
    right = torch.randn(4, 2, 2, generator=generator, requires_grad=True)
    bias = torch.randn(6, generator=generator).to(bias_dtype).requires_grad_()
    return x, left, right, bias


def _ttm_reference(x, left, right, bias):
    # W[(i, k), (j, l)] = sum_a A[i, j, a] C[a, k, l]
    weight = torch.einsum("ija,akl->ikjl", left.double(), right.double()).reshape(4, 6)
    return x.double() @ weight + bias.double()


def test_ttm_backward_computes_the_gradient_of_t_into_the_workspace():
    """The batched GEMM ``dT[b] = A'^T dY[b]`` writes into the one view the workspace hands out, of exactly
    ``(B, M_L r, N_R) = (5, 8, 2)`` elements, and the results equal those without a workspace."""
    x, left, right, bias = _ttm_inputs()
    workspace = _RecordingWorkspace()
    out = ttm_split_linear(x, left, right, bias, workspace)
    loss = (out * torch.linspace(-1, 1, 6)).sum()
    with _RecordGemms() as record:
        loss.backward()
    assert [tuple(view.shape) for view in workspace.views] == [(5, 8, 2)]
    assert workspace.nbytes() == 5 * 8 * 2 * 4
    written = [ptr for _, ptr, shape in record.gemms if shape == (5, 8, 2)]
    assert written == [workspace.views[0].data_ptr()]
    grads = [tensor.grad.clone() for tensor in (x, left, right, bias)]
    for tensor in (x, left, right, bias):
        tensor.grad = None
    (ttm_split_linear(x, left, right, bias) * torch.linspace(-1, 1, 6)).sum().backward()
    for grad, tensor in zip(grads, (x, left, right, bias)):
        assert torch.equal(grad, tensor.grad)


def test_ttm_backward_under_autocast_bypasses_the_workspace():
    """Under autocast the GEMMs pick their own (bfloat16) dtype, so the workspace is left alone even when the
    float32 bias makes the output, and so the incoming gradient, float32 like the saved ``A'``."""
    x, left, right, bias = _ttm_inputs()
    workspace = _RecordingWorkspace()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ttm_split_linear(x, left, right, bias, workspace)
    assert out.dtype == torch.float32
    assert _backward_gemm_dtypes(out) == {(torch.bfloat16, torch.bfloat16)}
    assert workspace.views == [] and workspace.allocations == 0


def test_ttm_bias_of_another_dtype_is_added_with_type_promotion():
    """bfloat16 GEMM output plus a float32 bias: a float32 result (as ``out + bias``), the bias added
    without rounding to bfloat16."""
    x, left, right, bias = _ttm_inputs()
    with torch.no_grad():
        bias.add_(1000.0)  # bfloat16 spacing at 1000 is 8: a sum rounded to bfloat16 is off by up to 4
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttm_split_linear(x, left, right, bias)
    assert out.dtype == torch.float32
    # |product| is a few units, so bfloat16 GEMM rounding (relative 2^-8) stays far below 0.25
    torch.testing.assert_close(out.double(), _ttm_reference(x, left, right, bias), rtol=0, atol=0.25)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float64])
def test_ttm_forward_adds_a_same_dtype_bias_in_place(bias_dtype):
    """With matching dtypes the bias goes into the GEMM's result: the forward makes one output-sized
    tensor (all ops whose result has ``B * N_L * N_R`` elements share one address); values as float64."""

    class _Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.addresses: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == 5 * 6:
                self.addresses.add(out.data_ptr())
            return out

    x, left, right, bias = _ttm_inputs(bias_dtype=bias_dtype)
    if bias_dtype == torch.float64:
        x, left, right = (tensor.double() for tensor in (x, left, right))
    with _Outputs() as outputs:
        out = ttm_split_linear(x, left, right, bias)
    assert outputs.addresses == {out.data_ptr()}
    torch.testing.assert_close(out.double(), _ttm_reference(x, left, right, bias), rtol=1e-5, atol=1e-5)
