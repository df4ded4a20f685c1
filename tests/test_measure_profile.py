"""comera.measure.profile_steps: operator categories and per-step totals on steps of known operators."""

import pytest
import torch

from comera.measure import category_of, profile_steps


@pytest.mark.parametrize(
    ("operator", "category"),
    [
        ("aten::mm", "matrix products"),
        ("aten::bmm", "matrix products"),
        ("aten::copy_", "copies and reshapes"),
        ("aten::permute", "copies and reshapes"),
        ("aten::mul", "elementwise"),
        ("aten::_foreach_mul_", "optimizer"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::embedding_dense_backward", "embedding and loss"),
        ("aten::nll_loss_forward", "embedding and loss"),
        ("autograd::engine::evaluate_function: MmBackward0", "other"),
    ],
)
def test_each_operator_falls_in_its_category(operator, category):
    assert category_of(operator) == category


def test_calls_and_categories_are_counted_per_step():
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def step():
        product = a @ b
        (product * 2.0).permute(1, 0).contiguous()
        torch.mm(product, b)

    profile = profile_steps(step, steps=4)
    categories = profile["categories"]
    assert categories["matrix products"]["calls"] >= 2.0
    mm_calls = sum(entry["calls"] for entry in profile["top"] if entry["op"] == "aten::mm")
    assert mm_calls == 2.0
    assert categories["elementwise"]["calls"] >= 1.0
    assert profile["ms"] == pytest.approx(sum(entry["ms"] for entry in categories.values()))
    assert profile["operators"] >= 5.0


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_a_bad_number_of_steps_is_refused_by_name(steps):
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        profile_steps(lambda: None, steps)
