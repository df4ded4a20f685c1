"""Size surrogates against values computed by hand from the gates: dead bonds, norms below 1, the gates'
dtype, a single live entry, and the messages of the input checks."""

import pytest
import torch

from comera import TTLinear
from comera.rank import mean_gate_surrogate, size_surrogate


def _tt3(dtype=torch.float64):
    # cores (1, 3, 2), (2, 4, 2), (2, 5, 1): bond sizes c = (3, 4, 5)
    return TTLinear(12, 5, in_shape=(3, 4), out_shape=(5,), rank=2, dtype=dtype)


def _set_gates(layer, *values):
    with torch.no_grad():
        for gate, value in zip(layer.gates, values):
            gate.copy_(torch.tensor(value, dtype=gate.dtype))


@pytest.mark.parametrize("bond", [0, 1])
def test_three_core_train_with_a_dead_bond_has_surrogate_zero(bond):
    layer = _tt3()
    assert [tuple(core.shape) for core in layer.cores] == [(1, 3, 2), (2, 4, 2), (2, 5, 1)]
    _set_gates(layer, [1.0, 1.0], [1.0, 1.0])
    with torch.no_grad():
        layer.gates[bond].zero_()
    # without the dead-bond factor the far core would still count: 5 * 2 (bond 0) or 3 * 2 (bond 1)
    value = size_surrogate([layer], 32.0)
    assert float(value.detach()) == 0.0


def test_surrogate_of_a_bond_whose_l1_norm_is_below_one():
    layer = _tt3()
    _set_gates(layer, [0.5, 0.0], [1.0, 1.0])  # norms 0.5 and 2: the train is alive
    # 3 * 1 * 0.5 + 4 * 0.5 * 2 + 5 * 2 * 1 = 15.5
    assert float(size_surrogate([layer], 31.0).detach()) == pytest.approx(15.5 / 31.0, rel=1e-15)


def test_surrogate_is_in_the_dtype_of_the_gates():
    layer = _tt3(torch.bfloat16)
    _set_gates(layer, [0.5, 1.0], [1.0, 0.25])  # norms 1.5 and 1.25, exact in bfloat16
    value = size_surrogate([layer], 1.0)
    # 3 * 1.5 + 4 * 1.5 * 1.25 + 5 * 1.25 = 4.5 + 7.5 + 6.25
    assert value.dtype == torch.bfloat16
    assert float(value.detach()) == 18.25


def test_mean_gate_surrogate_of_one_bond_with_a_single_live_entry():
    layer = TTLinear(4, 4, in_shape=(4,), out_shape=(4,), rank=3)
    assert len(layer.gates) == 1
    _set_gates(layer, [0.0, 0.7, 0.005])  # only 0.7 is above tau = 0.01
    assert float(mean_gate_surrogate([layer]).detach()) == pytest.approx(0.7)


def test_mean_gate_surrogate_of_dead_gates_is_zero():
    layer = TTLinear(4, 4, in_shape=(4,), out_shape=(4,), rank=3)
    _set_gates(layer, [0.0, 0.01, -0.005])  # |g| <= tau everywhere
    assert float(mean_gate_surrogate([layer]).detach()) == 0.0


@pytest.mark.parametrize("surrogate", [lambda: size_surrogate([], 1.0), lambda: mean_gate_surrogate([])])
def test_surrogates_without_trains_name_what_is_missing(surrogate):
    with pytest.raises(ValueError, match=r"^trains must contain at least one gated layer with a bond$"):
        surrogate()
