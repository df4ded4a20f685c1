"""The TTM lookup's backward for every layout of the upstream gradient: contiguous, column-major (a
transposed ``(D, N)`` tensor), expanded along the rows (``out.sum()``'s gradient, stride 0) and expanded
from one row. Every layout gives the core gradients the float64 dense table gives for the same values, and
the backward takes no layout's slow path: ``torch.bmm`` sees only row- or column-major operands (a strided
one is multiplied matrix by matrix), and no step allocates a gradient-sized tensor for an expanded gradient.

References: :func:`comera.tt.cores.ttm_full` (float64) and autograd through it; a ``TorchDispatchMode`` that
records what the backward's operators receive and allocate.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lookup_reference import assert_lookup_matches_the_table
from torch.utils._python_dispatch import TorchDispatchMode

import comera.tt.lookup as lookup_module
from comera.tt.cores import ttm_core_shapes
from comera.tt.lookup import rows_at, ttm_lookup

LAYOUTS = ("contiguous", "column-major", "expanded", "expanded row")


def _gradient(layout: str, rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    """A ``(rows, cols)`` float64 upstream gradient in ``layout``."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.randn(rows, cols, dtype=torch.float64, generator=generator)
    if layout == "column-major":
        return torch.randn(cols, rows, dtype=torch.float64, generator=generator).t()
    if layout == "expanded":
        return torch.randn((), dtype=torch.float64, generator=generator).expand(rows, cols)
    return torch.randn(cols, dtype=torch.float64, generator=generator).expand(rows, cols)


def _cores(row_modes, col_modes, ranks, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, dtype=torch.float64, generator=generator, requires_grad=True)
        for shape in ttm_core_shapes(row_modes, col_modes, ranks)
    ]


@given(
    modes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=2, max_size=3),
    rank=st.integers(1, 3),
    count=st.integers(1, 12),
    layout=st.sampled_from(LAYOUTS),
    dedup=st.booleans(),
    chunk_elements=st.sampled_from([1, 40, 1 << 20]),
    seed=st.integers(0, 1000),
)
def test_every_gradient_layout_gives_the_dense_tables_gradients(
    modes, rank, count, layout, dedup, chunk_elements, seed
):
    """Small chunks make the backward copy a gradient chunk by chunk (the last chunk shorter)."""
    row_modes, col_modes = [m for m, _ in modes], [n for _, n in modes]
    cores = _cores(row_modes, col_modes, [rank] * (len(modes) - 1), seed)
    indices = torch.randint(0, math.prod(row_modes), (count,), generator=torch.Generator().manual_seed(seed))
    grad_out = _gradient(layout, count, math.prod(col_modes), seed + 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lookup_module, "_CHUNK_ELEMENTS", chunk_elements)
        out = ttm_lookup(cores, indices, dedup=dedup)
        grads = torch.autograd.grad(out, cores, grad_outputs=grad_out)
    assert_lookup_matches_the_table(out, grads, cores, indices, grad_out.contiguous())


class _RecordBackward(TorchDispatchMode):
    """The operand layouts of every ``bmm``, the largest storage any operator returns, and the operators
    that receive an expanded tensor of ``expanded_numel`` elements (the whole expanded gradient)."""

    def __init__(self, expanded_numel: int = -1):
        super().__init__()
        self.expanded_numel = expanded_numel
        self.bmm_operands: list[torch.Tensor] = []
        self.largest_storage = 0
        self.given_the_expanded_gradient: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [arg for arg in (*args, *(kwargs or {}).values()) if isinstance(arg, torch.Tensor)]
        if any(t.numel() == self.expanded_numel and 0 in t.stride() for t in tensors):
            self.given_the_expanded_gradient.append(func)
        result = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.bmm:
            self.bmm_operands += tensors
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor):
                self.largest_storage = max(self.largest_storage, tensor.untyped_storage().nbytes())
        return result


class _NewShapes(TorchDispatchMode):
    """The shapes of the tensors every non-view operator returns."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(tensor, torch.Tensor):
                    self.shapes.add(tuple(tensor.shape))
        return result


def _row_or_column_major(tensor: torch.Tensor) -> bool:
    """Whether each matrix of a batched operand is row- or column-major (one BLAS call multiplies them)."""
    return tensor.stride(-1) == 1 or tensor.stride(-2) == 1


# Rows 8 * 10 * 6, columns 4 * 4 * 6 (96 wide), ranks 8, split after core 1: a gathered row pair holds
# 4 * 8 + 8 * 24 elements, so chunks of 80 rows; 600 ids.
_SHAPE = ((8, 10, 6), (4, 4, 6), (8, 8))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dedup", [False, True])
def test_backward_hands_bmm_only_blas_layouts(monkeypatch, layout, dedup):
    monkeypatch.setattr(lookup_module, "_CHUNK_ELEMENTS", 80 * (4 * 8 + 8 * 24))
    cores = _cores(*_SHAPE)
    indices = torch.randint(0, 480, (600,), generator=torch.Generator().manual_seed(0))
    out = ttm_lookup(cores, indices, dedup=dedup, split=1)
    with _RecordBackward() as record:
        out.backward(_gradient(layout, 600, 96))
    assert record.bmm_operands
    assert all(_row_or_column_major(operand) for operand in record.bmm_operands)


@pytest.mark.parametrize("layout", ["expanded", "expanded row"])
@pytest.mark.parametrize("dedup", [False, True])
def test_an_expanded_gradient_is_never_materialised(monkeypatch, layout, dedup):
    """Only view operators (slices, reshapes) and ``new_empty`` receive the whole expanded gradient
    (600 x 96), and no operator returns a tensor over a storage that large: the split path copies one chunk
    of 80 rows, the deduplicated gather counts ids instead of summing copies of one row."""
    monkeypatch.setattr(lookup_module, "_CHUNK_ELEMENTS", 80 * (4 * 8 + 8 * 24))
    cores = _cores(*_SHAPE)
    indices = torch.randint(0, 480, (600,), generator=torch.Generator().manual_seed(0))
    out = ttm_lookup(cores, indices, dedup=dedup, split=1)
    with _RecordBackward(expanded_numel=600 * 96) as record:
        out.backward(_gradient(layout, 600, 96))
    assert record.given_the_expanded_gradient
    reading = [func for func in record.given_the_expanded_gradient if not func.is_view]
    assert set(reading) <= {torch.ops.aten.new_empty.default}  # takes dtype and device only
    assert 0 < record.largest_storage < 600 * 96 * 8


@pytest.mark.parametrize("layout", ["column-major", "sliced"])
def test_a_strided_gradient_is_summed_block_by_block_without_a_whole_copy(monkeypatch, layout):
    """The deduplicated gather's backward reads a strided gradient 7 rows at a time (600 rows: 85 blocks and
    a remainder), never copying it whole, and the core gradients equal those of the same values laid out
    contiguously; the per-row sums equal a float64 reference built with one-hot rows."""
    monkeypatch.setattr(lookup_module, "SUM_ROWS", 7)
    values = _gradient("contiguous", 600, 96)
    strided = (
        values.t().contiguous().t() if layout == "column-major" else torch.cat([values, values], 1)[:, ::2]
    )
    if layout == "sliced":
        values = strided.contiguous()
    assert not strided.is_contiguous() and torch.equal(strided, values)
    indices = torch.randint(0, 480, (600,), generator=torch.Generator().manual_seed(0))
    grads = []
    for gradient in (values, strided):
        cores = _cores(*_SHAPE)
        out = ttm_lookup(cores, indices, dedup=True, split=1)
        with _NewShapes() as made:
            out.backward(gradient)
        grads.append([core.grad for core in cores])
    assert (600, 96) not in made.shapes  # no whole copy of the gradient
    assert (7, 96) in made.shapes  # the block it is read through
    for want, got in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    distinct, position = torch.unique(indices, return_inverse=True)
    one_hot = torch.nn.functional.one_hot(position, len(distinct)).double()
    rows = torch.zeros(len(distinct), 96, dtype=torch.float64, requires_grad=True)
    rows_at(rows, position).backward(strided)
    torch.testing.assert_close(rows.grad, one_hot.t() @ values, rtol=1e-12, atol=1e-12)
