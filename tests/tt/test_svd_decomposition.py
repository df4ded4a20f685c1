"""TT-SVD and TTM-SVD (:mod:`comera.tt.svd`): argument checks, working precision, dtype and SVD sizes.

References: the exact error text (type and message) derived by hand from the arguments; the float64 dense
reconstruction of the returned cores (:func:`comera.tt.cores.tt_full`); the shapes of the factors that the
SVD kernel returns, recorded with a ``TorchDispatchMode``.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera.tt.cores import tt_full
from comera.tt.svd import tt_svd, ttm_svd


def test_ttm_svd_refuses_a_matrix_of_the_wrong_shape_naming_modes_and_shape():
    # rows 2 * 3 = 6, columns 2 * 2 = 4; the (5, 6) matrix fits neither
    message = "matrix must have shape (6, 4) for row_modes (2, 3) and col_modes (2, 2), got (5, 6)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ttm_svd(torch.zeros(5, 6), [2, 3], [2, 2], 2)


def test_tt_svd_of_a_bfloat16_tensor_works_in_float64_and_returns_bfloat16():
    """Full ranks (2 * 3 = 6 <= 4 * 5): exact up to the final rounding of each core to bfloat16."""
    tensor = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)).bfloat16()
    cores = tt_svd(tensor, 100)
    assert [core.dtype for core in cores] == [torch.bfloat16] * 4
    assert [tuple(core.shape) for core in cores] == [(1, 2, 2), (2, 3, 6), (6, 4, 5), (5, 5, 1)]
    rebuilt = tt_full([core.double() for core in cores])
    torch.testing.assert_close(rebuilt, tensor.double(), rtol=0.05, atol=0.05)


def test_tt_svd_keeps_the_input_dtype_and_is_exact_at_full_rank():
    tensor = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    cores = tt_svd(tensor, 100)
    assert [core.dtype for core in cores] == [torch.float32] * 3
    torch.testing.assert_close(
        tt_full([core.double() for core in cores]), tensor.double(), rtol=1e-5, atol=1e-5
    )


class _SvdShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "svd" in str(func.overloadpacket):
            self.shapes.append(tuple(tuple(factor.shape) for factor in out))
        return out


def test_tt_svd_computes_thin_factors_only():
    """Unfoldings (64, 6) and (12, 3) (ranks 6 and 3 after clipping): U is (64, 6), not the (64, 64) of a
    full SVD."""
    tensor = torch.randn(64, 2, 3, generator=torch.Generator().manual_seed(2))
    with _SvdShapes() as record:
        tt_svd(tensor, 100)
    assert record.shapes == [((64, 6), (6,), (6, 6)), ((12, 3), (3,), (3, 3))]
