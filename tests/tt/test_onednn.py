"""oneDNN's kernel for the merge path's batch-sized GEMMs (comera.tt.onednn, comera.tt.blocked): the product
against float64, when it may run, that autotuning offers it and runs it where it was measured fastest, and
that the switches (autotuning off, ``mkl_only``, ``single_gemms``) keep ``torch.mm``. Timings are faked where
the choice itself is checked, so no assertion depends on which CPU runs the tests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera import TTLinear
from comera.tt import autotune as autotune_module
from comera.tt import blocked, onednn
from comera.tt.autotune import autotune, autotune_cache, clear_autotune_cache
from comera.tt.contract import low_rank_linear
from comera.tt.cores import tt_full

needs_onednn = pytest.mark.skipif(
    not onednn.onednn_available(), reason="this PyTorch has no oneDNN linear op"
)


@pytest.fixture
def tuning():
    clear_autotune_cache()
    with autotune(True):
        yield
    clear_autotune_cache()


def _operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
    """A float32 ``(rows, cols)`` matrix, contiguous or a transposed view of a contiguous one."""
    return torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    inner=st.integers(1, 9),
    width=st.integers(1, 12),
    first_t=st.booleans(),
    second_t=st.booleans(),
)
def test_onednn_product_matches_float64(rows, inner, width, first_t, second_t):
    first, second = _operand(rows, inner, first_t), _operand(inner, width, second_t)
    got = onednn.onednn_mm(first, second)
    want = first.double() @ second.double()
    assert got.shape == (rows, width) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_onednn_is_offered_only_for_plain_float32_cpu_operands():
    usable = onednn.onednn_available()
    assert onednn.onednn_usable(torch.randn(3, 4), torch.randn(4, 2)) == usable
    for dtype in (torch.float64, torch.bfloat16):
        assert not onednn.onednn_usable(torch.randn(3, 4, dtype=dtype), torch.randn(4, 2, dtype=dtype))
    assert not onednn.onednn_usable(torch.randn(0, 4), torch.randn(4, 2))
    assert not onednn.onednn_usable(torch.randn(3, 0), torch.randn(0, 2))
    assert not onednn.onednn_usable(torch.empty(3, 4, device="meta"), torch.empty(4, 2, device="meta"))


def _fastest(choice):
    """Fake timings in which ``choice`` beats every other candidate in every run; records the candidates."""
    offered = []

    def timed(candidates, run, device):
        offered.append(tuple(candidates))
        for candidate in candidates:
            run(candidate)
        return {candidate: [0.001 if candidate == choice else 1.0] * 3 for candidate in candidates}

    timed.offered = offered
    return timed


def _count_onednn(monkeypatch):
    calls = []
    real = onednn.onednn_mm

    def counted(first, second):
        calls.append((tuple(first.shape), tuple(second.shape)))
        return real(first, second)

    monkeypatch.setattr(blocked, "onednn_mm", counted)
    return calls


@needs_onednn
def test_measured_onednn_runs_every_product_kind(tuning, monkeypatch):
    timed = _fastest(blocked.ONEDNN)
    monkeypatch.setattr(autotune_module, "_timed_seconds", timed)
    calls = _count_onednn(monkeypatch)
    batch_rows, thin, wide = torch.randn(2048, 31), torch.randn(2048, 24), torch.randn(2048, 40)
    rows = blocked.blocked_mm_into(batch_rows, torch.randn(31, 40), torch.empty(2048, 40))
    summed = blocked.blocked_batch_sum_mm(batch_rows.t(), wide)
    out = torch.empty(2048, 5)
    right = torch.randn(24, 5)
    narrow = blocked.thin_mm(thin, right, out)
    assert all(blocked.ONEDNN in offered for offered in timed.offered) and len(timed.offered) == 3
    calls.clear()  # the measurement ran every candidate once or more; now one call each, from the cache
    blocked.blocked_mm_into(batch_rows, torch.randn(31, 40), torch.empty(2048, 40))
    blocked.blocked_batch_sum_mm(batch_rows.t(), wide)
    blocked.thin_mm(thin, right, out)
    assert len(calls) == 3
    assert sum(value == blocked.ONEDNN for value in autotune_cache().values()) == 3
    assert rows.shape == (2048, 40) and summed.shape == (31, 40) and narrow.shape == (2048, 5)
    torch.testing.assert_close(narrow.double(), thin.double() @ right.double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(summed.double(), batch_rows.double().t() @ wide.double(), rtol=1e-4, atol=1e-3)


@needs_onednn
def test_layouts_are_measured_apart(tuning, monkeypatch):
    monkeypatch.setattr(autotune_module, "_timed_seconds", _fastest(blocked.ONEDNN))
    first = torch.randn(300, 20)
    blocked.thin_mm(first, torch.randn(20, 6))
    blocked.thin_mm(first, torch.randn(6, 20).t())
    keys = [key for key in autotune_cache() if key[:2] == ("gemm", "thin")]
    assert sorted(key[6] for key in keys) == ["c", "t"]


def test_switches_keep_torch_mm(tuning, monkeypatch):
    timed = _fastest(blocked.ONEDNN)
    monkeypatch.setattr(autotune_module, "_timed_seconds", timed)
    calls = _count_onednn(monkeypatch)
    first, second = torch.randn(2048, 30), torch.randn(30, 50)
    with blocked.mkl_only():
        blocked.blocked_mm_into(first, second, torch.empty(2048, 50))
    assert all(blocked.ONEDNN not in offered for offered in timed.offered)
    clear_autotune_cache()
    with blocked.single_gemms():
        blocked.blocked_mm_into(first, second, torch.empty(2048, 50))
    with autotune(False):
        blocked.thin_mm(torch.randn(2048, 50), torch.randn(50, 30))
        blocked.blocked_batch_sum_mm(first.t(), torch.randn(2048, 50))
    double = torch.randn(2048, 30, dtype=torch.float64)
    blocked.thin_mm(double, torch.randn(30, 4, dtype=torch.float64))
    assert not calls


def _layer_grads(layer, x, upstream):
    x = x.detach().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(upstream)
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


@needs_onednn
@pytest.mark.parametrize("with_bias", [True, False])
def test_tt_layer_with_onednn_matches_torch_mm(tuning, monkeypatch, with_bias):
    """The merge order run with every batch-sized GEMM on oneDNN: output and all gradients as with
    ``torch.mm`` (float32 rounding), and the output as the float64 dense reconstruction gives."""
    torch.manual_seed(0)
    layer = TTLinear(48, 40, bias=with_bias, rank=5, order="merge")
    x, upstream = torch.randn(1100, 48), torch.randn(1100, 40)
    with autotune(False):
        want = _layer_grads(layer, x, upstream)
    monkeypatch.setattr(autotune_module, "_timed_seconds", _fastest(blocked.ONEDNN))
    calls = _count_onednn(monkeypatch)
    _layer_grads(layer, x, upstream)  # measures
    calls.clear()
    got = _layer_grads(layer, x, upstream)
    assert len(calls) == 6  # X L, [X L, 1] [R; b], dY R^T, U L^T, U^T X, [X L, 1]^T dY
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    weight = tt_full([core.double() for core in layer.gated_cores()]).reshape(48, 40)
    dense = x.double() @ weight + (layer.bias.double() if with_bias else 0)
    torch.testing.assert_close(got[0].double(), dense, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_low_rank_linear_gradcheck_style_against_autograd(tuning, monkeypatch):
    monkeypatch.setattr(autotune_module, "_timed_seconds", _fastest(blocked.ONEDNN))
    torch.manual_seed(1)
    x = torch.randn(700, 33, requires_grad=True)
    left = torch.randn(33, 4, requires_grad=True)
    right = torch.randn(4, 29, requires_grad=True)
    bias = torch.randn(29, requires_grad=True)
    upstream = torch.randn(700, 29)
    low_rank_linear(x, left, right, bias).backward(upstream)
    got = [t.grad.clone() for t in (x, left, right, bias)]
    leaves = [t.detach().double().requires_grad_(True) for t in (x, left, right, bias)]
    ((leaves[0] @ leaves[1]) @ leaves[2] + leaves[3]).backward(upstream.double())
    for a, b in zip(got, leaves):
        torch.testing.assert_close(a.double(), b.grad, rtol=1e-4, atol=1e-3)


@needs_onednn
def test_a_choice_measured_with_onednn_is_not_replayed_inside_mkl_only(tuning, monkeypatch):
    monkeypatch.setattr(autotune_module, "_timed_seconds", _fastest(blocked.ONEDNN))
    calls = _count_onednn(monkeypatch)
    first, second = torch.randn(2048, 30), torch.randn(30, 50)
    blocked.blocked_mm_into(first, second, torch.empty(2048, 50))
    blocked.thin_mm(torch.randn(2048, 50), torch.randn(50, 30))
    assert calls  # measured and cached: oneDNN
    calls.clear()
    with blocked.mkl_only():
        rows = blocked.blocked_mm_into(first, second, torch.empty(2048, 50))
        blocked.thin_mm(torch.randn(2048, 50), torch.randn(50, 30))
    assert not calls
    torch.testing.assert_close(rows.double(), first.double() @ second.double(), rtol=1e-4, atol=1e-4)
