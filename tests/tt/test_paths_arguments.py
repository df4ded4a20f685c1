"""``tt_linear`` / ``ttm_linear`` (:mod:`comera.tt.paths`): defaults, argument checks, single-core trains and
padding passes.

References: ``x @ W + b`` with the float64 dense weight of the train (:func:`comera.tt.cores.tt_full`,
:func:`comera.tt.cores.ttm_full`); exact error texts derived from the arguments; the ops dispatched (a
``TorchDispatchMode``) to tell whether a padding pass (``aten.constant_pad_nd``) ran.
"""

from __future__ import annotations

import re

import pytest
import torch
from tt_dispatch import OpNames

from comera.tt.cores import tt_full, ttm_core_shapes, ttm_full
from comera.tt.paths import tt_linear, ttm_linear


def _random(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


def _tt_cores():
    """Input modes (2, 3), output modes (4, 2), ranks (2, 3, 2): W is 6 x 8."""
    return _random([(1, 2, 2), (2, 3, 3), (3, 4, 2), (2, 2, 1)])


def _ttm_cores(rows, cols, ranks, seed=0):
    return _random(ttm_core_shapes(rows, cols, ranks), seed)


def test_tt_linear_default_order_matches_the_dense_weight():
    cores = _tt_cores()
    x, bias = _random([(5, 6), (7,)], seed=1)
    weight = tt_full(cores).reshape(6, 8)[:, :7]
    torch.testing.assert_close(tt_linear(x, cores, 2, 7, bias), x @ weight + bias, rtol=1e-12, atol=1e-12)


def test_ttm_linear_default_order_and_split_match_the_dense_weight():
    """Two cores: the default split is the middle bond (1); bias padded to the 6 columns, 5 kept."""
    cores = _ttm_cores((2, 3), (3, 2), (2,))
    x, bias = _random([(4, 6), (5,)], seed=1)
    weight = ttm_full(cores)[:, :5]
    torch.testing.assert_close(ttm_linear(x, cores, 5, bias), x @ weight + bias, rtol=1e-12, atol=1e-12)
    # no bias and fewer columns than the train has: nothing to pad
    torch.testing.assert_close(ttm_linear(x, cores, 5, None), x @ weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", ["merge", "sequential", "dense"])
def test_ttm_linear_of_a_single_core_is_its_matrix(order):
    """A one-core train is the matrix ``F[0, :, :, 0]`` whatever the order (merge falls back to dense)."""
    (core,) = _ttm_cores((6,), (4,), ())
    x, bias = _random([(3, 6), (4,)], seed=2)
    expected = x @ core[0, :, :, 0] + bias
    torch.testing.assert_close(ttm_linear(x, [core], 4, bias, order), expected, rtol=1e-12, atol=1e-12)


def test_ttm_linear_refuses_a_split_outside_the_bonds():
    cores = _ttm_cores((2, 2, 2), (2, 2, 2), (2, 2))
    x = torch.zeros(1, 8, dtype=torch.float64)
    for split in (0, 3):
        message = f"split must be in [1, 2], got {split}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            ttm_linear(x, cores, 8, None, "merge", split=split)


def test_unknown_order_and_gemm_are_refused_by_name():
    cores = _tt_cores()
    x = torch.zeros(1, 6, dtype=torch.float64)
    message = "order must be one of ('merge', 'sequential', 'dense', 'factors'), got 'fast'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tt_linear(x, cores, 2, 8, None, order="fast")
    message = "order must be one of ('merge', 'sequential', 'dense'), got 'fast'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ttm_linear(x, _ttm_cores((2, 3), (3, 2), (2,)), 6, None, order="fast")
    message = "gemm must be one of ('fp32', 'fp8'), got 'int8'"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        tt_linear(x, cores, 2, 8, None, gemm="int8")


def test_no_padding_pass_when_nothing_is_missing():
    """Full-width input to the sequential TT order, and a bias as wide as the TTM train's columns: no pad op;
    a narrower input is padded (one pad op), both equal to the dense product."""
    cores = _tt_cores()
    weight = tt_full(cores).reshape(6, 8)
    (x,) = _random([(5, 6)], seed=3)
    with OpNames() as ops:
        full = tt_linear(x, cores, 2, 8, None, order="sequential")
    assert "aten.constant_pad_nd" not in ops.names
    torch.testing.assert_close(full, x @ weight, rtol=1e-12, atol=1e-12)
    with OpNames() as ops:
        narrow = tt_linear(x[:, :4], cores, 2, 8, None, order="sequential")
    assert ops.names.count("aten.constant_pad_nd") == 1
    torch.testing.assert_close(narrow, x[:, :4] @ weight[:4], rtol=1e-12, atol=1e-12)

    ttm_cores = _ttm_cores((2, 3), (3, 2), (2,))
    bias = torch.ones(6, dtype=torch.float64)  # 6 = 3 * 2 columns; x has the train's 2 * 3 rows
    with OpNames() as ops:
        out = ttm_linear(x, ttm_cores, 6, bias, "merge")
    assert "aten.constant_pad_nd" not in ops.names
    torch.testing.assert_close(out, x @ ttm_full(ttm_cores) + bias, rtol=1e-12, atol=1e-12)
