"""Adam's moments through prune_ with folded gates, against the change of variables computed by hand.

Folding bond ``k``'s kept gate values ``g`` into core ``k`` (``G' = G diag(g)``, ``g' = 1``) changes the
gradients to ``dL/dG' = dL/dG / g`` (right-rank axis of core ``k``) and ``dL/dg' = g dL/dg``. The reference:

1. the pruned model's own autograd gradients at the prune point equal the old gradients mapped this way
   (the change of variables itself, checked on the reparametrised model);
2. the optimizer state after ``prune_`` equals Adam's moments recomputed by a direct loop over the recorded
   gradient history, mapped the same way: first moments scale by ``1/g`` on cores and ``g`` on gates, second
   moments by the squares.

Every layer is alive (no fully dead bond), so gradients reach every pruned layer and no moment is zero.
"""

import pytest
import torch
from torch import nn

from comera import TTLinear, TTMLinear, prune_

_BETAS = (0.9, 0.999)
_STEPS = 3


def _model():
    torch.manual_seed(5)
    model = nn.Sequential(
        TTLinear(24, 20, in_shape=(2, 3, 4), out_shape=(4, 5), rank=5, dtype=torch.float64),
        nn.Tanh(),
        TTMLinear(20, 12, in_shape=(4, 5), out_shape=(3, 4), rank=6, dtype=torch.float64),
        nn.Tanh(),
        TTLinear(12, 6, in_shape=(3, 4), out_shape=(6,), rank=3, dtype=torch.float64),
    )
    with torch.no_grad():
        for layer in _layers(model):
            for gate in layer.gates:
                gate.uniform_(0.3, 1.7)
        model[0].gates[1][[0, 3]] = 0.004  # below tau: dead
        model[0].gates[2][4] = -0.002
        model[2].gates[0][[1, 2, 4]] = 0.0
        model[4].gates[0][1] = 0.0
        model[4].gates[1][2] = 0.0
    return model


def _layers(model):
    return [model[0], model[2], model[4]]


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _kept(layer):
    """Per bond: the live entries and their gate values at the prune point."""
    keep = [(gate.detach().abs() > layer.tau).nonzero().flatten() for gate in layer.gates]
    return keep, [gate.detach()[index].clone() for gate, index in zip(layer.gates, keep)]


def _map_core(tensor, k, keep, values):
    """A gradient of core ``k`` in the new coordinates: sliced to the live ranks, right-rank axis / ``g``."""
    if k > 0:
        tensor = tensor.index_select(0, keep[k - 1])
    if k < len(keep):
        tensor = tensor.index_select(tensor.dim() - 1, keep[k]) / values[k]
    return tensor


def _map_gate(tensor, k, keep, values):
    """A gradient of gate ``k`` in the new coordinates: the live entries times ``g``."""
    return tensor[keep[k]] * values[k]


def _adam_moments(history):
    first = second = torch.zeros_like(history[0])
    for grad in history:
        first = _BETAS[0] * first + (1 - _BETAS[0]) * grad
        second = _BETAS[1] * second + (1 - _BETAS[1]) * grad.square()
    return first, second


def _train_recording(model, optimizer, x, y):
    history = {param: [] for param in model.parameters()}
    for _ in range(_STEPS):
        optimizer.zero_grad()
        _loss(model, x, y).backward()
        for param in model.parameters():
            history[param].append(param.grad.detach().clone())
        optimizer.step()
    return history


def test_folded_gradients_and_adam_moments_follow_the_change_of_variables():
    model = _model()
    x, y = torch.randn(32, 24, dtype=torch.float64), torch.randn(32, 6, dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=_BETAS)
    history = _train_recording(model, optimizer, x, y)
    kept = {id(layer): _kept(layer) for layer in _layers(model)}
    assert all(len(index) > 0 for keep, _ in kept.values() for index in keep)

    probe = torch.randn(16, 24, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    model.zero_grad()
    _loss(model, *probe).backward()
    old_grads = {param: param.grad.detach().clone() for param in model.parameters()}
    old_cores = {id(layer): list(layer.cores) for layer in _layers(model)}
    old_gates = {id(layer): list(layer.gates) for layer in _layers(model)}

    result = prune_(model, optimizer)
    assert {layer.name for layer in result.layers} == {"0", "2", "4"} and not result.removed

    model.zero_grad()
    _loss(model, *probe).backward()
    checked = 0
    for layer in _layers(model):
        keep, values = kept[id(layer)]
        params = [(param, k, _map_core) for k, param in enumerate(old_cores[id(layer)])]
        params += [(param, k, _map_gate) for k, param in enumerate(old_gates[id(layer)])]
        for param, k, mapping in params:
            # 1. the change of variables: the reparametrised model's gradient
            torch.testing.assert_close(
                param.grad, mapping(old_grads[param], k, keep, values), rtol=1e-9, atol=1e-12
            )
            # 2. Adam's moments of the mapped gradient history
            mapped = [mapping(grad, k, keep, values) for grad in history[param]]
            first, second = _adam_moments(mapped)
            state = optimizer.state[param]
            assert float(second.abs().min()) > 0 or mapping is _map_core  # gates: every moment non-zero
            assert float(first.abs().max()) > 0 and float(second.max()) > 0
            torch.testing.assert_close(state["exp_avg"], first, rtol=1e-9, atol=1e-15)
            torch.testing.assert_close(state["exp_avg_sq"], second, rtol=1e-9, atol=1e-18)
            assert int(state["step"]) == _STEPS
            checked += 1
    assert checked == sum(len(layer.cores) + len(layer.gates) for layer in _layers(model))


def test_gate_moments_scale_by_g_and_g_squared_entry_by_entry():
    """The gate's moments, read before and after, on one bond with distinct gate values far from 1."""
    model = _model()
    x, y = torch.randn(32, 24, dtype=torch.float64), torch.randn(32, 6, dtype=torch.float64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, betas=_BETAS)
    history = _train_recording(model, optimizer, x, y)
    gate = model[2].gates[0]
    keep = (gate.detach().abs() > model[2].tau).nonzero().flatten()
    g = gate.detach()[keep].clone()
    assert float((g - 1).abs().min()) > 0.05
    first, second = _adam_moments([grad[keep] for grad in history[gate]])
    prune_(model, optimizer)
    for entry, value in enumerate(g.tolist()):
        assert float(optimizer.state[gate]["exp_avg"][entry]) == pytest.approx(value * float(first[entry]))
        assert float(optimizer.state[gate]["exp_avg_sq"][entry]) == pytest.approx(
            value**2 * float(second[entry])
        )


def test_prune_without_folding_slices_a_gate_with_dead_entries_and_keeps_its_values():
    model = _model()
    layer = model[2]
    gate = layer.gates[0].detach().clone()
    keep = (gate.abs() > layer.tau).nonzero().flatten()
    assert 0 < len(keep) < len(gate)  # dead entries 1, 2, 4 of 6
    cores = [core.detach().clone() for core in layer.cores]
    x = torch.randn(5, 24, dtype=torch.float64)
    before = model(x)
    prune_(model, fold_gates=False)
    assert torch.equal(layer.gates[0].detach(), gate[keep])
    assert torch.equal(layer.cores[0].detach(), cores[0][..., keep])
    assert torch.equal(layer.cores[1].detach(), cores[1][keep])
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
