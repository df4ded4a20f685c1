"""The order choice under ``torch.compile``: traced directly, not through the eager ``lru_cache``."""

import warnings
from unittest import mock

import torch
import torch._dynamo.utils as dynamo_utils

from comera.tt import costs
from comera.tt.costs import auto_tt_order


def test_compiled_order_choice_gives_dynamo_no_cache_wrapper_to_warn_about():
    """Dynamo warns (once per process) when it meets an ``lru_cache`` wrapper; the compiled path avoids it.

    The once-per-process record is replaced by an empty set, so an earlier warning elsewhere cannot hide it.
    """

    def choose(x: torch.Tensor) -> torch.Tensor:
        order = auto_tt_order(x.shape[0], (4, 4), (4, 4), (3, 3, 3), True)
        return x * 2 if order == "sequential" else x * 3

    torch._dynamo.reset()
    for function in costs._MEMOISED.values():
        function.cache_clear()
    x = torch.ones(5)
    with (
        mock.patch.object(dynamo_utils, "warn_once_cache", set()),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        compiled = torch.compile(choose, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), choose(x))
    assert not [str(w.message) for w in seen if "lru_cache" in str(w.message)]
    torch._dynamo.reset()
