"""What prune_ reports: the exact PrunedLayer records and the stored core entries before and after,
counted by hand from the core shapes; a gate exactly at tau is pruned; removed parameters leave the
optimizer's state; the optimizer state keeps its dtype; the type error names the type it got."""

import pytest
import torch
from torch import nn

from comera import TTLinear, TTMEmbedding, TTMTiedHead, prune_
from comera.rank import PrunedLayer, RemovedLinear

TAU = 0.25  # a binary fraction: a gate can equal it exactly


def _tt3():
    # cores (1, 3, 3), (3, 4, 3), (3, 5, 1): 9 + 36 + 15 = 60 stored entries
    layer = TTLinear(12, 5, in_shape=(3, 4), out_shape=(5,), rank=3, dtype=torch.float64)
    layer.tau = TAU
    return layer


def _four_layers():
    """Sliced, untouched, removed (dead bond), sliced: every branch of prune_ in one pass."""
    torch.manual_seed(0)
    model = nn.Sequential(_tt3(), _tt3(), _tt3(), _tt3())
    with torch.no_grad():
        model[0].gates[0][0] = 0.0  # bond 0 rank 3 -> 2
        model[0].gates[1][2] = TAU  # exactly at tau: dead, bond 1 rank 3 -> 2
        model[2].gates[1].fill_(-0.1)  # the whole bond dead
        model[3].gates[1][0] = 0.0  # bond 1 rank 3 -> 2
    return model


def test_records_and_stored_counts_of_a_prune_over_every_kind_of_layer():
    model = _four_layers()
    assert [tuple(core.shape) for core in model[1].cores] == [(1, 3, 3), (3, 4, 3), (3, 5, 1)]
    result = prune_(model)
    assert result.layers == (
        PrunedLayer("0", (3, 3), (2, 2), False),
        PrunedLayer("2", (3, 3), (), True),
        PrunedLayer("3", (3, 3), (3, 2), False),
    )
    assert result.removed == ("2",)
    assert result.stored_before == 4 * 60
    # layer 0 at ranks (2, 2): 3*2 + 2*4*2 + 2*5 = 32; layer 1 untouched: 60; layer 2 removed: 0;
    # layer 3 at ranks (3, 2): 3*3 + 3*4*2 + 2*5 = 43
    assert result.stored_after == 32 + 60 + 43
    assert [tuple(core.shape) for core in model[0].cores] == [(1, 3, 2), (2, 4, 2), (2, 5, 1)]
    assert [tuple(core.shape) for core in model[3].cores] == [(1, 3, 3), (3, 4, 2), (2, 5, 1)]
    assert isinstance(model[2], RemovedLinear)


def test_a_gate_exactly_at_tau_is_cut():
    layer = _tt3()
    with torch.no_grad():
        layer.gates[1][1] = TAU
        layer.gates[1][2] = -TAU
    before = layer.to_dense().detach()
    result = prune_(nn.Sequential(layer))
    assert result.layers == (PrunedLayer("0", (3, 3), (3, 1), False),)
    assert result.stored_after == 3 * 3 + 3 * 4 * 1 + 1 * 5
    torch.testing.assert_close(layer.to_dense().detach(), before, rtol=1e-12, atol=1e-12)


def test_a_removed_table_and_its_tied_head_are_both_recorded():
    table = TTMEmbedding(40, 12, row_shape=(5, 8), col_shape=(3, 4), rank=4, dtype=torch.float64)
    head = TTMTiedHead(table, bias=True)
    model = nn.ModuleDict({"table": table, "head": head})
    with torch.no_grad():
        table.gates[0].zero_()
    result = prune_(model)
    assert result.layers == (
        PrunedLayer("table", (4,), (), True),
        PrunedLayer("head", (), (), True),
    )
    # cores (1, 5, 3, 4) and (4, 8, 4, 1): 60 + 128 stored before, nothing after
    assert (result.stored_before, result.stored_after) == (60 + 128, 0)


def test_parameters_of_a_removed_layer_leave_the_optimizer_state():
    model = _four_layers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(param.square().sum() for param in model.parameters()).backward()
    optimizer.step()
    dead = [*model[2].cores, *model[2].gates]
    assert all(param in optimizer.state for param in dead)
    prune_(model, optimizer)
    assert not any(param in optimizer.state for param in dead)
    assert all(param in optimizer.state for param in model[0].parameters())


def test_folding_keeps_the_dtype_of_a_low_precision_optimizer_state():
    torch.manual_seed(0)
    layer = TTLinear(12, 5, in_shape=(3, 4), out_shape=(5,), rank=3)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    sum(param.square().sum() for param in layer.parameters()).backward()
    optimizer.step()
    with torch.no_grad():
        layer.gates[0].copy_(torch.tensor([2.0, 0.0, 0.5]))
    core = layer.cores[0]
    for param in (core, layer.gates[0]):  # an optimizer that keeps its state in bfloat16
        optimizer.state[param]["momentum_buffer"] = optimizer.state[param]["momentum_buffer"].bfloat16()
    old_core = optimizer.state[core]["momentum_buffer"].float()
    old_gate = optimizer.state[layer.gates[0]]["momentum_buffer"].float()
    prune_(nn.Sequential(layer), optimizer)
    core_state = optimizer.state[core]["momentum_buffer"]
    gate_state = optimizer.state[layer.gates[0]]["momentum_buffer"]
    assert core_state.dtype == gate_state.dtype == torch.bfloat16
    kept = torch.tensor([2.0, 0.5])
    torch.testing.assert_close(core_state.float(), old_core[..., [0, 2]] / kept, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(gate_state.float(), old_gate[[0, 2]] * kept, rtol=1e-2, atol=1e-3)


def test_a_wrong_optimizer_type_is_named_in_the_error():
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer or None, got str$"):
        prune_(_four_layers(), optimizer="adam")
