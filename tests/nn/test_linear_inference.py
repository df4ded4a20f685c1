"""TTLinear inference cache: eval-mode no-grad calls use merged factors that follow every layer change."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera import TTLinear, prune_
from comera.nn.gated import invalidate_inference_caches


def reference(layer: TTLinear, x: torch.Tensor) -> torch.Tensor:
    """``x W^T + b`` from the dense float64 weight, computed with autograd off and without the cache."""
    with torch.no_grad():
        return x @ layer.to_dense().t() + layer.bias


def make_layer(**kwargs) -> TTLinear:
    torch.manual_seed(0)
    layer = TTLinear(30, 22, rank=4, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
        layer.bias.normal_()
    return layer.eval()


def cached(layer: TTLinear) -> bool:
    return "_inference_cache" in layer.__dict__


@settings(max_examples=15, deadline=None)
@given(
    in_features=st.integers(1, 40),
    out_features=st.integers(1, 40),
    rank=st.integers(1, 5),
    batch=st.integers(0, 5),
    bias=st.booleans(),
)
def test_cached_output_matches_the_dense_weight(in_features, out_features, rank, batch, bias):
    layer = TTLinear(in_features, out_features, bias=bias, rank=rank, dtype=torch.float64).eval()
    with torch.no_grad():
        for gate in layer.gates:
            gate.uniform_(0.5, 1.5)
        layer.gates[0][0] = 0.0  # a dead entry
    x = torch.randn(batch, 2, in_features, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)
        want = x @ layer.to_dense().t() + (0 if layer.bias is None else layer.bias)
    assert cached(layer)
    torch.testing.assert_close(got, want)


def test_no_cache_while_training_or_recording_gradients():
    layer = make_layer()
    x = torch.randn(3, 30, dtype=torch.float64)
    layer.train()
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x).sum().backward()
    assert not cached(layer)
    layer.order = "sequential"
    with torch.no_grad():
        layer(x)
    assert not cached(layer)


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),
    # fused kernels update in place without bumping the parameters' version counters
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "adam-fused": lambda params: torch.optim.Adam(params, lr=0.1, fused=True),
    "sgd-fused": lambda params: torch.optim.SGD(params, lr=0.1, fused=True),
}


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_cache_follows_optimizer_steps_tau_and_in_place_updates(optimizer_name):
    layer = make_layer()
    x = torch.randn(3, 30, dtype=torch.float64)
    optimizer = OPTIMIZERS[optimizer_name](layer.parameters())
    with torch.no_grad():
        before = layer(x)
    layer.train()
    layer(x).square().sum().backward()
    optimizer.step()
    layer.eval()
    with torch.no_grad():
        after = layer(x)
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, reference(layer, x))
        layer.gates[1].mul_(-1.0)
        torch.testing.assert_close(layer(x), reference(layer, x))
        layer.tau = 0.9  # kills the gate entries below 0.9
        torch.testing.assert_close(layer(x), reference(layer, x))


def test_cache_follows_load_state_dict_prune_and_dtype_changes():
    layer, other = make_layer(), make_layer()
    with torch.no_grad():
        for core in other.cores:
            core.normal_()
    x = torch.randn(4, 30, dtype=torch.float64)
    with torch.inference_mode():
        layer(x)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(other, x))
        layer.gates[0][:2] = 0.0
        want = reference(layer, x)
    prune_(layer)
    with torch.no_grad():
        assert layer.max_ranks[0] == layer.cores[0].shape[-1] < 4
        torch.testing.assert_close(layer(x), want)
    layer.float()
    with torch.no_grad():
        got = layer(x.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def test_swapped_storage_is_seen():
    layer = make_layer()
    x = torch.randn(2, 30, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        layer.cores[1].data = torch.randn_like(layer.cores[1])  # new storage, same shape and dtype
        torch.testing.assert_close(layer(x), reference(layer, x))


def test_writes_through_data_need_clear_cache():
    layer = make_layer()
    x = torch.randn(2, 30, dtype=torch.float64)
    with torch.no_grad():
        before = layer(x)
        layer.cores[0].data.mul_(2.0)  # invisible to the version counter, as documented
        torch.testing.assert_close(layer(x), before)
        layer.clear_cache()
        torch.testing.assert_close(layer(x), reference(layer, x))


def test_invalidate_inference_caches_covers_what_no_counter_sees():
    layer = make_layer()
    x = torch.randn(2, 30, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        layer.cores[2].data.add_(1.0)  # as a step replayed from a CUDA graph: no version, no optimizer hook
        invalidate_inference_caches()
        torch.testing.assert_close(layer(x), reference(layer, x))


@pytest.mark.parametrize("order", ["auto", "merge"])
def test_compiled_eval_call_matches_eager(order):
    layer = make_layer(order=order).float()
    x = torch.randn(5, 30)
    with torch.no_grad():
        want = layer(x)
        got = torch.compile(layer, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
