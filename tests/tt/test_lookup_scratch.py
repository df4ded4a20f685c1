"""Scratch memory of the split lookup's batched GEMM: chunk-sized, shared by forward and backward, none for
an empty batch; results equal to the dense table's rows whatever the chunking.

References: float64 rows and core gradients of the dense table (:func:`comera.tt.cores.ttm_full`); the sizes
of the workspace buffers derived by hand from the chunk size; a ``TorchDispatchMode`` that counts GEMMs.

Train: row modes (2, 3, 4), column modes (3, 2, 2), bond ranks (2, 3), split after the first core:
``A (M_L, N_L, r) = (2, 3, 2)`` and ``C`` by rows ``(M_R, r, N_R) = (12, 2, 4)``; a gathered row pair holds
``N_L r + r N_R = 6 + 8 = 14`` elements, so ``_CHUNK_ELEMENTS = 48`` gives chunks of ``48 // 14 = 3`` rows.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lookup_reference import assert_lookup_matches_the_table
from torch.utils._python_dispatch import TorchDispatchMode

import comera.tt.lookup as lookup_module
from comera.tt.cores import ttm_core_shapes
from comera.tt.lookup import ttm_lookup_split
from comera.tt.workspace import Workspace

_INDICES = torch.tensor([0, 7, 23, 11, 5, 7, 16])  # 7 rows: chunks of 3, 3 and 1


class _RecordingWorkspace(Workspace):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def take(self, name, shape, like):
        self.shapes.append(tuple(shape))
        return super().take(name, shape, like)


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += str(func.overloadpacket) in ("aten.bmm", "aten.mm")
        return func(*args, **(kwargs or {}))


def _cores():
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
        for shape in ttm_core_shapes((2, 3, 4), (3, 2, 2), (2, 3))
    ]


@pytest.mark.parametrize(
    "chunk_elements, rows",
    [(48, 3), (14, 1), (10, 1)],  # 48 // 14 = 3; 14 // 14 = 1; 10 // 14 = 0, at least one row
)
def test_forward_and_backward_share_chunk_sized_buffers(monkeypatch, chunk_elements, rows):
    """Forward gathers into two buffers of one chunk: ``rows x (3, 2)`` of ``A`` and ``rows x (2, 4)`` of
    ``C``; the backward reuses them and adds two of the same sizes for the slice gradients."""
    monkeypatch.setattr(lookup_module, "_CHUNK_ELEMENTS", chunk_elements)
    cores = _cores()
    workspace = _RecordingWorkspace()
    grad_out = torch.randn(7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. an ``out=`` tensor of the wrong size being resized
        out = ttm_lookup_split(cores, _INDICES, 1, workspace=workspace)
        assert workspace.shapes == [(rows, 3, 2), (rows, 2, 4)]
        assert workspace.nbytes() == rows * (6 + 8) * 8
        grads = torch.autograd.grad((out * grad_out).sum(), cores)
    assert workspace.nbytes() == 2 * rows * (6 + 8) * 8
    assert_lookup_matches_the_table(out, grads, cores, _INDICES, grad_out)


def test_empty_batch_takes_no_scratch_and_runs_no_gemm():
    cores = _cores()
    halves = tuple(half.detach().requires_grad_() for half in lookup_module.split_halves(cores, 1))
    workspace = Workspace()
    empty = torch.zeros(0, dtype=torch.long)
    with _CountGemms() as gemms:
        out = ttm_lookup_split(cores, empty, 1, halves=halves, workspace=workspace)
        out.sum().backward()
    assert out.shape == (0, 12)
    assert gemms.count == 0
    assert workspace.nbytes() == 0
    assert all(torch.equal(half.grad, torch.zeros_like(half)) for half in halves)
