"""TT-SVD and TTM-SVD (:mod:`comera.tt.svd`): argument checks.

References: the exact error text (type and message) derived by hand from the arguments.
"""

from __future__ import annotations

import re

import pytest
import torch

from comera.tt.svd import ttm_svd


def test_ttm_svd_refuses_a_matrix_of_the_wrong_shape_naming_modes_and_shape():
    # rows 2 * 3 = 6, columns 2 * 2 = 4; the (5, 6) matrix fits neither
    message = "matrix must have shape (6, 4) for row_modes (2, 3) and col_modes (2, 2), got (5, 6)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ttm_svd(torch.zeros(5, 6), [2, 3], [2, 2], 2)
