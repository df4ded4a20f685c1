"""GEMMs by blocks of batch rows: values against float64 references, the block count rule, and the merge path
taking the blocked route (its gradients checked by gradcheck)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comera.tt import blocked
from comera.tt.blocked import blocked_batch_sum_mm, blocked_mm_into, rule_blocks, single_gemms
from comera.tt.contract import low_rank_linear, tt_merge_linear


@pytest.fixture
def small_blocks(monkeypatch, threads):
    """Blocks of at least 3 rows and 2 threads, so small batches take the blocked route."""
    monkeypatch.setattr(blocked, "MIN_ROWS_PER_BLOCK", 3)
    threads(2)


def test_block_count_follows_threads_and_minimum_rows(monkeypatch, threads):
    monkeypatch.setattr(blocked, "MIN_ROWS_PER_BLOCK", 512)
    cpu = torch.device("cpu")
    threads(2)
    monkeypatch.setattr(blocked, "MAX_WIDTH", 1024)
    assert [rule_blocks(rows, 768, cpu) for rows in (0, 511, 1023, 1024, 4096, 4097)] == [1, 1, 1, 2, 2, 2]
    assert [rule_blocks(4096, width, cpu) for width in (1, 1023, 1024, 3072)] == [2, 2, 1, 1]
    threads(1)
    assert rule_blocks(4096, 768, cpu) == 1
    threads(2)
    assert rule_blocks(4096, 768, torch.device("meta")) == 1
    with single_gemms():
        with single_gemms():
            assert rule_blocks(4096, 768, cpu) == 1
        assert rule_blocks(4096, 768, cpu) == 1
    assert rule_blocks(4096, 768, cpu) == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 40),
    inner=st.integers(1, 6),
    width=st.integers(1, 9),
    transposed=st.booleans(),
)
def test_blocked_mm_into_matches_float64(small_blocks, rows, inner, width, transposed):
    first = torch.randn(rows, inner, dtype=torch.float64)
    if transposed:
        second = torch.randn(width, inner, dtype=torch.float64).t()
    else:
        second = torch.randn(inner, width, dtype=torch.float64)
    out = torch.full((rows, width), float("nan"), dtype=torch.float64)
    returned = blocked_mm_into(first, second, out)
    assert returned.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, first @ second, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), inner=st.integers(1, 6), width=st.integers(1, 9))
def test_blocked_batch_sum_matches_float64(small_blocks, rows, inner, width):
    batch_major = torch.randn(rows, inner, dtype=torch.float64)
    second = torch.randn(rows, width, dtype=torch.float64)
    expected = batch_major.t() @ second
    result = blocked_batch_sum_mm(batch_major.t(), second)
    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-12)


def test_blocked_route_is_taken_and_float32_close(small_blocks, monkeypatch):
    """A float32 case against float64: blocked partial sums stay within float32 rounding."""
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real_bmm(*a, **k))
    first = torch.randn(301, 31)
    second = torch.randn(301, 64)
    result = blocked_batch_sum_mm(first.t(), second)
    out = blocked_mm_into(first, second[:31], torch.empty(301, 64))
    assert len(calls) == 2
    torch.testing.assert_close(result, (first.double().t() @ second.double()).float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, (first.double() @ second[:31].double()).float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [7, 9])
@pytest.mark.parametrize("with_bias", [True, False])
def test_merge_path_gradients_through_blocks(small_blocks, rows, with_bias):
    """``tt_merge_linear`` and ``low_rank_linear`` with 2-3 blocks and a remainder row: gradcheck."""
    cores = [
        torch.randn(1, 2, 3, dtype=torch.float64, requires_grad=True),
        torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True),
        torch.randn(2, 4, 1, dtype=torch.float64, requires_grad=True),
    ]
    gates = [torch.rand(3, dtype=torch.float64, requires_grad=True) + 0.5]
    x = torch.randn(rows, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_bias else None

    def merged(x, bias, *tensors):
        return tt_merge_linear(x, tensors[:3], 2, 4, bias, gates=tensors[3:])

    assert torch.autograd.gradcheck(merged, (x, bias, *cores, *gates))
    left = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    right = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(low_rank_linear, (x, left, right, bias))


def test_compiled_merge_layer_runs_one_gemm_and_matches_eager(threads):
    """Under ``torch.compile`` tracing no block count is asked of the threads (it would break the graph)."""
    from comera import TTLinear

    threads(2)
    layer = TTLinear(24, 20, rank=3, order="merge")
    x = torch.randn(1030, 24)
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
