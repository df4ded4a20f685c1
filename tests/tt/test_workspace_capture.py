"""Graph capture and scratch buffers: what the code does while a graph is captured, where buffers live.

References: :func:`in_graph_capture` while ``torch.compiler.is_compiling`` reports tracing (patched, so the
test does not run a real ``torch.compile``: tracing through mutmut's trampolines fails in its stats run); the
split lookup's captured-graph branch (``in_graph_capture`` patched to True in :mod:`comera.tt.lookup`)
against the rows and core gradients of the float64 dense table (:func:`comera.tt.cores.ttm_full`), with its
GEMMs counted by a ``TorchDispatchMode``; the device of a workspace buffer under another default device.
"""

from __future__ import annotations

from unittest import mock

import torch
from lookup_reference import assert_lookup_matches_the_table
from torch.utils._python_dispatch import TorchDispatchMode

import comera.tt.lookup as lookup_module
from comera.tt.cores import ttm_core_shapes
from comera.tt.lookup import ttm_lookup_split
from comera.tt.workspace import Workspace, in_graph_capture


def test_in_graph_capture_is_true_while_compiling():
    assert in_graph_capture() is False
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        capturing = in_graph_capture()
    assert capturing is True


class _GemmOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) == "aten.bmm":
            self.shapes.append(tuple(out.shape))
        return out


def test_split_lookup_in_a_captured_graph_is_one_gather_and_gemm(monkeypatch):
    """Split after core 1: ``A`` (2, 3, 2), ``C`` by rows (12, 2, 4). While capturing, the forward gathers the
    6 row pairs and multiplies them in one batched GEMM (6, 3, 2) @ (6, 2, 4) without scratch buffers (the
    workspace stays empty); rows and gradients as the dense table's."""
    monkeypatch.setattr(lookup_module, "in_graph_capture", lambda: True)
    generator = torch.Generator().manual_seed(0)
    cores = [
        torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
        for shape in ttm_core_shapes((2, 3, 4), (3, 2, 2), (2, 3))
    ]
    indices = torch.tensor([0, 7, 23, 11, 5, 7])
    grad_out = torch.randn(6, 12, dtype=torch.float64, generator=generator)
    halves = lookup_module.split_halves(cores, 1)
    workspace = Workspace()
    with _GemmOutputs() as gemms:
        out = ttm_lookup_split(cores, indices, 1, halves=halves, workspace=workspace)
    assert gemms.shapes == [(6, 3, 4)]
    assert workspace.nbytes() == 0
    grads = torch.autograd.grad((out * grad_out).sum(), cores)
    assert_lookup_matches_the_table(out, grads, cores, indices, grad_out)


def test_buffers_live_on_the_device_of_like_not_the_default_device():
    workspace = Workspace()
    like = torch.zeros(1, dtype=torch.float64)
    with torch.device("meta"):
        view = workspace.take("a", (2, 3), like)
    assert view.device == like.device and view.dtype == torch.float64 and view.shape == (2, 3)
