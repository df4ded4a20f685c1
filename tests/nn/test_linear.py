"""TTLinear / TTMLinear against the dense reference ``x @ to_dense().T + b`` in float64."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from comera import TTLinear, TTMLinear
from comera.tt.cores import tt_full, ttm_full
from comera.tt.costs import ORDERS, ttm_merge_split
from comera.tt.merge import fold_gates
from comera.tt.paths import tt_linear, ttm_linear
from comera.tt.shapes import auto_modes

LAYERS = (TTLinear, TTMLinear)


def _randomize_gates(layer, dead_fraction=0.3):
    with torch.no_grad():
        for gate in layer.gates:
            gate.copy_(torch.empty_like(gate).uniform_(0.2, 1.5) * torch.sign(torch.randn_like(gate)))
            dead = torch.rand_like(gate) < dead_fraction
            dead[0] = False
            gate[dead] = 0.5 * layer.tau * torch.sign(torch.randn(int(dead.sum()), dtype=gate.dtype))


def _independent_dense(layer):
    """The weight (out, in) rebuilt from raw cores and gates without the layer's own helpers."""
    cores = [core.clone() for core in layer.cores]
    for k, gate in enumerate(layer.gates):
        alive = (gate.abs() > layer.tau).to(gate.dtype)
        cores[k] = cores[k] * (gate * alive)
    if isinstance(layer, TTLinear):
        full = tt_full(cores).reshape(math.prod(layer.in_shape), math.prod(layer.out_shape))
    else:
        full = ttm_full(cores)
    return full[: layer.in_features, : layer.out_features].t()


def _grads(outputs, params):
    return torch.autograd.grad(outputs, params, allow_unused=True)


layer_cases = st.fixed_dictionaries(
    {
        "cls": st.sampled_from(LAYERS),
        "in_features": st.integers(1, 40),
        "out_features": st.integers(1, 40),
        "rank": st.integers(1, 6),
        "bias": st.booleans(),
        "order": st.sampled_from(("auto", *ORDERS)),
        "lead": st.lists(st.integers(0, 3), min_size=0, max_size=3),
        "cores_per_side": st.integers(1, 3),
    }
)


@given(layer_cases)
def test_outputs_and_gradients_match_dense_reference(case):
    cls, n_in, n_out = case["cls"], case["in_features"], case["out_features"]
    order_count = case["cores_per_side"]

    kwargs = {}
    if order_count > 1:
        kwargs = {
            "in_shape": auto_modes(n_in, order_count),
            "out_shape": auto_modes(n_out, order_count, descending=True),
        }
        if math.prod(kwargs["in_shape"]) != n_in or math.prod(kwargs["out_shape"]) != n_out:
            kwargs = {}
    layer = cls(
        n_in, n_out, bias=case["bias"], rank=case["rank"], order=case["order"], dtype=torch.float64, **kwargs
    )
    _randomize_gates(layer)
    x = torch.randn(*case["lead"], n_in, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    weight = _independent_dense(layer)
    reference = x @ weight.t() + (layer.bias if layer.bias is not None else 0)
    assert y.shape == (*case["lead"], n_out)
    torch.testing.assert_close(y, reference, rtol=1e-10, atol=1e-10)

    upstream = torch.randn_like(y)
    params = [x, *layer.cores, *layer.gates] + ([layer.bias] if layer.bias is not None else [])
    got = _grads((y * upstream).sum(), params)
    want = _grads((reference * upstream).sum(), params)
    for g, w in zip(got, want):
        g = torch.zeros_like(w) if g is None and w is not None else g
        w = torch.zeros_like(g) if w is None and g is not None else w
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("order", ORDERS)
def test_gradcheck(cls, order):
    layer = cls(12, 10, rank=3, order=order, dtype=torch.float64, in_shape=(3, 4), out_shape=(5, 2))
    _randomize_gates(layer, dead_fraction=0.0)
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    names = [name for name, _ in layer.named_parameters()]
    params = (x, *(param.detach().clone().requires_grad_() for param in layer.parameters()))

    def fn(inp, *flat):
        return torch.func.functional_call(layer, dict(zip(names, flat)), (inp,))

    assert torch.autograd.gradcheck(fn, params, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", LAYERS)
def test_all_orders_agree_on_uneven_splits(cls):
    if cls is TTLinear:
        layer = cls(60, 24, rank=4, in_shape=(3, 4, 5), out_shape=(24,), dtype=torch.float64)
    else:
        layer = cls(60, 24, rank=4, in_shape=(3, 4, 5), out_shape=(2, 3, 4), dtype=torch.float64)
    _randomize_gates(layer)
    x = torch.randn(7, 60, dtype=torch.float64)
    outputs = []
    for order in ORDERS:
        layer.order = order
        outputs.append(layer(x))
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], rtol=1e-12, atol=1e-12)


def test_six_cores_per_side_and_one_core_per_side():
    big = TTLinear(64, 729, rank=3, in_shape=(2,) * 6, out_shape=(3,) * 6, dtype=torch.float64)
    small = TTLinear(5, 7, rank=2, dtype=torch.float64)
    for layer in (big, small):
        x = torch.randn(4, layer.in_features, dtype=torch.float64)
        torch.testing.assert_close(layer(x), x @ _independent_dense(layer).t() + layer.bias)


@pytest.mark.parametrize("cls", LAYERS)
def test_awkward_feature_sizes_are_padded_and_sliced(cls):
    layer = cls(97, 53, rank=8, dtype=torch.float64)
    assert math.prod(layer.in_shape) >= 97 and math.prod(layer.out_shape) >= 53
    assert layer.to_dense().shape == (53, 97)
    x = torch.randn(3, 97, dtype=torch.float64)
    for order in ORDERS:
        layer.order = order
        torch.testing.assert_close(layer(x), x @ _independent_dense(layer).t() + layer.bias)


@pytest.mark.parametrize("cls", LAYERS)
def test_dead_gates_get_no_gradient_and_dead_bond_gives_bias(cls):
    layer = cls(16, 12, rank=4, in_shape=(4, 4), out_shape=(3, 4), dtype=torch.float64)
    with torch.no_grad():
        layer.gates[0][1] = layer.tau / 2
    x = torch.randn(3, 16, dtype=torch.float64)
    layer(x).sum().backward()
    assert layer.gates[0].grad[1] == 0
    assert layer.ranks[0] == layer.max_ranks[0] - 1
    with torch.no_grad():
        layer.gates[0].fill_(0.0)
    assert layer.ranks[0] == 0 and layer.num_parameters() == 0 and layer.compression == math.inf
    torch.testing.assert_close(layer(x), layer.bias.expand(3, 12))


def test_gate_fold_equals_scaled_core():
    layer = TTLinear(16, 16, rank=4, in_shape=(4, 4), out_shape=(4, 4), dtype=torch.float64)
    scale = torch.tensor([0.5, 2.0, 0.0, -1.0], dtype=torch.float64)
    with torch.no_grad():
        layer.gates[1].copy_(scale)
    twin = TTLinear(16, 16, rank=4, in_shape=(4, 4), out_shape=(4, 4), dtype=torch.float64)
    twin.load_state_dict(layer.state_dict())
    with torch.no_grad():
        twin.gates[1].fill_(1.0)
        twin.cores[1].mul_(scale)
    x = torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), twin(x))


@pytest.mark.parametrize("cls", LAYERS)
def test_parameter_counts_and_compression(cls):
    layer = cls(768, 768, rank=30)
    expected = sum(core.numel() for core in layer.cores)
    assert layer.num_parameters() == expected
    assert layer.compression == pytest.approx(768 * 768 / expected)
    text = repr(layer)
    assert "in_shape=" in text and "ranks=" in text and "compression=" in text


def test_paper_shapes_parameter_count():
    layer = TTLinear(768, 3072, rank=(12, 30, 30, 30, 16), in_shape=(12, 8, 8), out_shape=(12, 16, 16))
    assert layer.num_parameters() == 28_960


@pytest.mark.parametrize("cls", LAYERS)
def test_initialisation_variance(cls):
    values = []
    for seed in range(6):
        torch.manual_seed(seed)
        values.append(cls(96, 160, rank=8).to_dense().detach().flatten())
    variance = torch.cat(values).var().item()
    assert variance == pytest.approx(1.0 / (96 + 160), rel=0.15)


@pytest.mark.parametrize("cls", LAYERS)
def test_from_linear_is_exact_at_full_rank(cls):
    linear = torch.nn.Linear(24, 18, dtype=torch.float64)
    layer = cls.from_linear(linear, rank=1000)
    torch.testing.assert_close(layer.to_dense(), linear.weight, rtol=1e-10, atol=1e-10)
    x = torch.randn(4, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x), linear(x))


def test_from_linear_truncation_is_the_best_low_rank_fit_for_two_cores():
    linear = torch.nn.Linear(30, 20, bias=False, dtype=torch.float64)
    layer = TTLinear.from_linear(linear, rank=5, in_shape=(30,), out_shape=(20,))
    singular = torch.linalg.svdvals(linear.weight)
    error = torch.linalg.matrix_norm(layer.to_dense() - linear.weight)
    assert error.item() == pytest.approx(singular[5:].square().sum().sqrt().item(), rel=1e-8)


def test_from_linear_padded_layer():
    linear = torch.nn.Linear(97, 31, dtype=torch.float64)
    layer = TTMLinear.from_linear(linear, rank=10_000)
    torch.testing.assert_close(layer.to_dense(), linear.weight, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cls", LAYERS)
def test_device_and_dtype_factory_kwargs(cls):
    layer = cls(8, 8, device="cpu", dtype=torch.float64)
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in layer.parameters())


@pytest.mark.parametrize("cls", LAYERS)
def test_bad_arguments_raise_value_error_naming_them(cls):
    with pytest.raises(ValueError, match=r"prod\(in_shape\)"):
        cls(768, 768, in_shape=(8, 8, 8))
    with pytest.raises(ValueError, match=r"prod\(out_shape\)"):
        cls(768, 768, out_shape=(8, 8, 8))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        cls(16, 16, rank=0)
    with pytest.raises(ValueError, match="rank entries"):
        bonds = 3 if cls is TTLinear else 1
        cls(16, 16, rank=(-1,) + (2,) * (bonds - 1), in_shape=(4, 4), out_shape=(4, 4))
    with pytest.raises(ValueError, match="in_features must be an int >= 1"):
        cls(0, 16)
    with pytest.raises(ValueError, match="out_features must be an int >= 1"):
        cls(16, -2)
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        cls(16, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="order must be one of"):
        cls(16, 16, order="fastest")
    with pytest.raises(ValueError, match="tau must be"):
        cls(16, 16, tau=-1.0)
    layer = cls(16, 8)
    with pytest.raises(ValueError, match=r"input must have shape \(\*, 16\)"):
        layer(torch.randn(3, 15))
    with pytest.raises(ValueError, match=r"input must have shape \(\*, 16\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating-point dtype"):
        layer(torch.ones(3, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not match"):
        layer(torch.ones(3, 16, dtype=torch.float64))


@pytest.mark.parametrize(
    ("in_features", "out_features", "in_shape", "out_shape"),
    [(64, 10, (4, 4, 4), (10,)), (10, 64, (10,), (4, 4, 4)), (24, 20, (2, 3, 4), (4, 5))],
)
def test_ttm_shapes_of_different_lengths_are_padded_with_size_1_modes(
    in_features, out_features, in_shape, out_shape
):
    torch.manual_seed(0)
    layer = TTMLinear(
        in_features, out_features, in_shape=in_shape, out_shape=out_shape, rank=64, dtype=torch.float64
    )
    length = max(len(in_shape), len(out_shape))
    assert len(layer.in_shape) == len(layer.out_shape) == length
    assert layer.in_shape[: len(in_shape)] == in_shape and set(layer.in_shape[len(in_shape) :]) <= {1}
    weight = _independent_dense(layer)
    x = torch.randn(5, in_features, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ weight.T + layer.bias, rtol=1e-10, atol=1e-10)
    dense = torch.nn.Linear(in_features, out_features, dtype=torch.float64)
    exact = TTMLinear.from_linear(dense, in_shape=in_shape, out_shape=out_shape, rank=10_000)
    torch.testing.assert_close(exact(x), dense(x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cls", LAYERS)
def test_empty_batch(cls):
    layer = cls(12, 6)
    x = torch.randn(0, 12, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 6)
    y.sum().backward()
    assert x.grad.shape == (0, 12)


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("order", ORDERS)
def test_bf16_autocast_keeps_fp32_masters_and_bf16_accuracy(cls, order):
    layer = cls(48, 40, rank=4, in_shape=(4, 12), out_shape=(8, 5), order=order)
    x = torch.randn(6, 48)
    reference = layer(x)
    (reference_grad,) = torch.autograd.grad(reference.square().sum(), [layer.cores[0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    (grad,) = torch.autograd.grad(y.float().square().sum(), [layer.cores[0]])
    assert grad.dtype == torch.float32 and layer.cores[0].dtype == torch.float32
    scale = reference.abs().max()
    assert (y.float() - reference).abs().max() <= 0.03 * scale
    assert (grad - reference_grad).norm() <= 0.05 * reference_grad.norm()


def test_fp8_gemms_follow_the_fp32_layer_within_fp8_error():
    from comera.tt.fp8 import fp8_supported

    if not fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm with FP8 is unavailable on this CPU build")
    layer = TTLinear(64, 48, rank=6, order="merge")
    twin = TTLinear(64, 48, rank=6, order="merge", gemm="fp8")
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(32, 64)
    reference, got = layer(x), twin(x)
    relative = (got - reference).norm() / reference.norm()
    assert 2.0**-7 < relative < 2.0**-3
    got.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in twin.parameters())
    with pytest.raises(ValueError, match="gemm must be one of"):
        layer.gemm = "fp16"


def _graph_nodes(output):
    """Names of every autograd node reachable from ``output``."""
    seen, stack, names = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _contraction_alone(layer, x, order):
    """``layer``'s product with the 2-D ``x`` by ``order``, called on the public path function of its kind
    (:func:`comera.tt.paths.tt_linear` or :func:`comera.tt.paths.ttm_linear`) with its cores, gates and
    bias."""
    cores, gates = layer.core_list(), layer.masked_gates()
    if isinstance(layer, TTMLinear):
        split = None
        if order == "merge":
            split = ttm_merge_split(x.shape[0], layer.in_shape, layer.out_shape, layer.max_ranks, True)
        folded = fold_gates(cores, gates)
        return ttm_linear(x, folded, layer.out_features, layer.bias, order, split, layer.workspace)
    num_in = len(layer.in_shape)
    return tt_linear(
        x, cores, num_in, layer.out_features, layer.bias, order, layer.gemm, layer.workspace, gates
    )


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize("order", ORDERS)
def test_a_2d_input_runs_the_contraction_alone_and_3d_input_is_flattened_and_restored(cls, order):
    """A 2-D call adds no node to the contraction's autograd graph (at small batches every node's cost
    counts); a 3-D call flattens the leading dims and restores them, with the same values."""
    layer = cls(12, 10, rank=3, in_shape=(3, 4), out_shape=(5, 2), order=order, dtype=torch.float64)
    x = torch.randn(6, 12, dtype=torch.float64, requires_grad=True)
    assert sorted(_graph_nodes(layer(x))) == sorted(_graph_nodes(_contraction_alone(layer, x, order)))
    batched = layer(x.reshape(2, 3, 12))
    assert batched.shape == (2, 3, 10)
    torch.testing.assert_close(batched.reshape(6, 10), layer(x), rtol=0, atol=0)
