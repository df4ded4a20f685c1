"""prune_: outputs unchanged (float64), shapes at the active ranks, optimizer state sliced and rescaled."""

import pytest
import torch
from torch import nn

from comera import TTLinear, TTMEmbedding, TTMLinear, TTMTiedHead, prune_
from comera.rank import RemovedEmbedding, RemovedLinear


def _model():
    torch.manual_seed(1)
    model = nn.Sequential(
        TTLinear(24, 20, in_shape=(2, 3, 4), out_shape=(4, 5), rank=5, dtype=torch.float64),
        nn.Tanh(),
        TTMLinear(20, 12, in_shape=(4, 5), out_shape=(3, 4), rank=6, dtype=torch.float64),
        nn.Tanh(),
        TTLinear(12, 6, in_shape=(3, 4), out_shape=(6,), rank=3, dtype=torch.float64),
    )
    with torch.no_grad():
        for module in (model[0], model[2], model[4]):
            for gate in module.gates:
                gate.uniform_(0.3, 1.7)
        model[0].gates[1][[0, 3]] = 0.005  # below tau: dead
        model[0].gates[3][1] = -0.002
        model[2].gates[0][[1, 2, 4]] = 0.0
        model[4].gates[1].fill_(0.0)  # a whole bond dead: the layer is exactly zero
    return model


def test_prune_keeps_outputs_and_shrinks_to_active_ranks():
    model = _model()
    x = torch.randn(7, 24, dtype=torch.float64)
    before = model(x)
    active = (model[0].ranks, model[2].ranks)
    dense = model[0].to_dense(), model[2].to_dense()
    result = prune_(model)
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[0].to_dense(), dense[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[2].to_dense(), dense[1], rtol=1e-12, atol=1e-12)
    assert (model[0].max_ranks, model[2].max_ranks) == active
    assert all(bool((gate == 1).all()) for layer in (model[0], model[2]) for gate in layer.gates)
    assert isinstance(model[4], RemovedLinear)
    assert result.removed == ("4",)
    assert {layer.name for layer in result.layers} == {"0", "2", "4"}
    assert result.stored_after < result.stored_before


def test_prune_without_folding_keeps_the_live_gate_values():
    model = _model()
    x = torch.randn(5, 24, dtype=torch.float64)
    before = model(x)
    gate = model[0].gates[1].detach().clone()
    live = [i for i in range(gate.numel()) if i not in (0, 3)]  # entries 0 and 3 are below tau in _model
    prune_(model, fold_gates=False)
    assert torch.equal(model[0].gates[1].detach(), gate[live])
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)


def test_prune_of_an_unpruned_layer_changes_nothing():
    layer = nn.Sequential(TTLinear(16, 16, rank=3))
    cores = [core.detach().clone() for core in layer[0].cores]
    result = prune_(layer)
    assert not result.changed
    assert all(torch.equal(a, b) for a, b in zip(cores, layer[0].cores))


def _train(model, optimizer, x, y, steps):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_adamw_continues_exactly_when_gates_are_not_folded():
    x, y = torch.randn(32, 24, dtype=torch.float64), torch.randn(32, 6, dtype=torch.float64)
    runs = []
    for prune in (False, True):
        model = _model()
        with torch.no_grad():
            model[4].gates[1].fill_(1.0)  # keep every layer alive for this comparison
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        _train(model, optimizer, x, y, 3)
        if prune:
            prune_(model, optimizer, fold_gates=False)
        runs.append(_train(model, optimizer, x, y, 5))
    assert runs[0] == pytest.approx(runs[1], rel=1e-10)


def test_folded_state_follows_the_change_of_variables():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 24, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    _train(model, optimizer, x, y, 2)
    layer = model[2]
    keep = (layer.gates[0].detach().abs() > layer.tau).nonzero().flatten()
    g = layer.gates[0].detach()[keep]
    gate_state = {k: v.clone() for k, v in optimizer.state[layer.gates[0]].items()}
    core_state = {k: v.clone() for k, v in optimizer.state[layer.cores[0]].items()}
    prune_(model, optimizer)
    new_gate = optimizer.state[layer.gates[0]]
    torch.testing.assert_close(new_gate["exp_avg"], gate_state["exp_avg"][keep] * g)
    torch.testing.assert_close(new_gate["exp_avg_sq"], gate_state["exp_avg_sq"][keep] * g**2)
    torch.testing.assert_close(new_gate["step"], gate_state["step"])
    new_core = optimizer.state[layer.cores[0]]
    torch.testing.assert_close(new_core["exp_avg"], core_state["exp_avg"][..., keep] / g)
    torch.testing.assert_close(new_core["exp_avg_sq"], core_state["exp_avg_sq"][..., keep] / g**2)
    removed = {id(p) for p in model[4].parameters()}
    assert all(id(p) in removed or p.shape == optimizer.state[p]["exp_avg"].shape for p in model.parameters())


def test_training_continues_after_folding_without_a_jump():
    torch.manual_seed(3)
    model = _model()
    with torch.no_grad():
        model[4].gates[1].fill_(1.0)
    x = torch.randn(64, 24, dtype=torch.float64)
    y = torch.tanh(x[:, :6]) * 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = _train(model, optimizer, x, y, 40)
    prune_(model, optimizer)
    after = _train(model, optimizer, x, y, 40)
    assert all(torch.isfinite(torch.tensor(after)))
    assert max(after[:10]) <= 1.2 * before[-1]
    assert after[-1] < before[-1]


def test_removed_layer_returns_its_bias_and_leaves_the_optimizer():
    model = _model()
    bias = model[4].bias
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dead = [id(p) for p in (*model[4].cores, *model[4].gates)]
    prune_(model, optimizer)
    x = torch.randn(5, 12, dtype=torch.float64)
    torch.testing.assert_close(model[4](x), bias.detach().expand(5, 6))
    assert model[4].bias is bias
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert not set(dead) & set(params) and id(bias) in params


def test_dead_embedding_takes_its_tied_head_with_it():
    table = TTMEmbedding(40, 12, row_shape=(5, 8), col_shape=(3, 4), rank=4, dtype=torch.float64)
    head = TTMTiedHead(table, bias=True)
    model = nn.ModuleDict({"table": table, "head": head})
    with torch.no_grad():
        head.bias.normal_()
        table.gates[0].zero_()
    result = prune_(model)
    assert isinstance(model["table"], RemovedEmbedding) and isinstance(model["head"], RemovedLinear)
    assert set(result.removed) == {"table", "head"}
    ids = torch.tensor([[1, 5, 39]])
    torch.testing.assert_close(model["table"](ids), torch.zeros(1, 3, 12, dtype=torch.float64))
    hidden = torch.randn(2, 12, dtype=torch.float64)
    torch.testing.assert_close(model["head"](hidden), head.bias.detach().expand(2, 40))


def test_tied_head_follows_a_shrunk_embedding():
    table = TTMEmbedding(40, 12, row_shape=(5, 8), col_shape=(3, 4), rank=4, dtype=torch.float64)
    head = TTMTiedHead(table, bias=False)
    with torch.no_grad():
        table.gates[0][[0, 2]] = 0.0
    model = nn.ModuleDict({"table": table, "head": head})
    hidden = torch.randn(3, 12, dtype=torch.float64)
    before = head(hidden)
    prune_(model)
    assert table.max_ranks == (2,)
    torch.testing.assert_close(head(hidden), before, rtol=1e-12, atol=1e-12)


def test_bad_optimizer_raises():
    with pytest.raises(TypeError, match="optimizer"):
        prune_(_model(), optimizer="adam")
