"""``tt_merge_linear`` when only some of its inputs train: right gradients, and no work for the frozen ones.

References: ``torch.autograd.gradcheck`` (finite differences in float64) for the gradients of exactly the
inputs that require grad, and hand-counted work of the backward: the GEMM FLOPs it runs (a
``TorchDispatchMode`` sums ``2 m k n`` over the GEMMs dispatched) against the sum of the products the
method needs (derived in ``_backward_flops``), and the gate reductions (``aten.sum``), counted likewise.

The train: cores ``G_1 (1, 2, 2)``, ``G_2 (2, 3, 3)`` carry the input modes (``m = 6``), ``G_3 (3, 4, 2)``,
``G_4 (2, 5, 1)`` the output modes (``n = 20``); the middle rank ``r = 3``; three gates, on the right-rank
axes of ``G_1``, ``G_2`` (left half) and ``G_3`` (right half); batch ``B = 4``.
"""

from __future__ import annotations

import pytest
import torch
from tt_dispatch import GemmFlops, OpNames

from comera.tt.contract import tt_merge_linear

_MODES, _RANKS, _NUM_IN = (2, 3, 4, 5), (2, 3, 2), 2
_BATCH, _IN, _OUT, _RANK = 4, 6, 20, 3

# which inputs train: "x", "bias", "cores" (indices), "gates" (indices)
_SCENARIOS = {
    "left_half": {"cores": (0, 1), "gates": (0, 1)},
    "right_half": {"cores": (2, 3)},
    "gates_only": {"gates": (0, 1, 2)},
    "x_and_bias": {"x": True, "bias": True},
    "everything": {"x": True, "bias": True, "cores": (0, 1, 2, 3), "gates": (0, 1, 2)},
}


def _inputs(scenario):
    trains = _SCENARIOS[scenario]
    generator = torch.Generator().manual_seed(3)
    full = (1, *_RANKS, 1)

    def tensor(*shape, trains_flag):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_(trains_flag)

    cores = [
        tensor(full[k], size, full[k + 1], trains_flag=k in trains.get("cores", ()))
        for k, size in enumerate(_MODES)
    ]
    gates = [tensor(rank, trains_flag=k in trains.get("gates", ())) for k, rank in enumerate(_RANKS)]
    x = tensor(_BATCH, _IN, trains_flag=trains.get("x", False))
    bias = tensor(_OUT, trains_flag=trains.get("bias", False))
    return x, bias, cores, gates


def _function(x, bias, *tensors):
    return tt_merge_linear(x, tensors[:4], _NUM_IN, _OUT, bias, gates=tensors[4:])


def _backward_flops(scenario) -> int:
    """FLOPs (2 per multiply-add) of the backward's GEMMs that ``scenario`` needs.

    B = 4, m = 6, n = 20, r = 3, bond ranks r_1 = 2, r_2 = 3, r_3 = 2.
    """
    trains = _SCENARIOS[scenario]
    needs_x, needs_bias = trains.get("x", False), trains.get("bias", False)
    needs_left = bool(set(trains.get("cores", ())) & {0, 1} or set(trains.get("gates", ())) & {0, 1})
    needs_right = bool(set(trains.get("cores", ())) & {2, 3} or set(trains.get("gates", ())) & {2})
    flops = 2 * 2 * 2 * 9  # re-merge L: G_1 (2, r_1) @ G_2 (r_1, 3 r_2) = 72
    flops += 2 * 12 * 2 * 5  # re-merge R: G_3 (r_2 4, r_3) @ G_4 (r_3, 5) = 240
    if needs_x or needs_left:
        flops += 2 * 4 * 20 * 3  # U = dY (B, n) @ R^T (n, r) = 480
    if needs_x:
        flops += 2 * 4 * 3 * 6  # dX = U (B, r) @ L^T (r, m) = 144
    if needs_left:
        flops += 2 * 3 * 4 * 6  # dL^T = U^T (r, B) @ X (B, m) = 144
        flops += 2 * 2 * 2 * 9  # dG_2 = P_1^T (r_1, 2) @ dL (2, 3 r_2) = 72
        flops += 2 * 2 * 9 * 2  # dP_1 = dL (2, 3 r_2) @ G_2^T (3 r_2, r_1) = 72
    if needs_right or needs_bias:
        flops += 2 * 4 * 4 * 20  # dR_aug = T_aug^T (r + 1, B) @ dY (B, n) = 640 (biased: r + 1 rows)
    if needs_right:
        flops += 2 * 12 * 5 * 2  # dG_3 = dR (r_2 4, 5) @ G_4^T (5, r_3) = 240
        flops += 2 * 2 * 12 * 5  # dG_4 = G_3^T (r_3, r_2 4) @ dR (r_2 4, 5) = 240
    return flops


@pytest.mark.parametrize("scenario", list(_SCENARIOS))
def test_gradients_of_exactly_the_training_inputs_match_finite_differences(scenario):
    x, bias, cores, gates = _inputs(scenario)
    assert torch.autograd.gradcheck(_function, (x, bias, *cores, *gates))


@pytest.mark.parametrize("scenario", list(_SCENARIOS))
def test_backward_runs_only_the_gemms_the_training_inputs_need(scenario):
    x, bias, cores, gates = _inputs(scenario)
    out = _function(x, bias, *cores, *gates)
    grad_out = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(4))
    with GemmFlops() as counter:
        out.backward(grad_out)
    assert counter.flops == _backward_flops(scenario)


@pytest.mark.parametrize("scenario", list(_SCENARIOS))
def test_backward_reduces_only_the_gates_that_train(scenario):
    """d gate_k = sum_{a, i} d gated_k * core_k: one reduction per training gate, none for frozen ones."""
    x, bias, cores, gates = _inputs(scenario)
    loss = _function(x, bias, *cores, *gates).sum()
    with OpNames() as ops:
        loss.backward()
    assert ops.names.count("aten.sum") == len(_SCENARIOS[scenario].get("gates", ()))
    for k, gate in enumerate(gates):
        assert (gate.grad is not None) == gate.requires_grad, k
