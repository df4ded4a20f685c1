"""LoRA-the-Explorer: the merge against a direct float64 sum, N = 1 against hand-written LoRA, the batch
split, the merge schedule inside the optimizer step, and the setting checks."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from comera.methods import MethodContext
from comera.methods.lte import LTELinear, LTEMethod, lte_layers, merge_every, merge_heads
from comera.tensorize_config import TensorizeConfig
from comera.train.config import TrainConfig
from comera.train.trainer import Trainer


def _layer(heads=3, rank=2, scale=1.5, in_features=5, out_features=4):
    layer = LTELinear.from_linear(
        nn.Linear(in_features, out_features).double(), heads=heads, rank=rank, scale=scale
    )
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


def _context(**settings):
    train = TrainConfig(batch_size=settings.pop("batch_size", 8), lr_other=1e-2)
    return MethodContext(tensorize=TensorizeConfig(target_modules=["0"]), settings=settings, train=train)


def test_merge_adds_the_mean_of_the_heads_products_and_restarts_them():
    layer = _layer()
    x = torch.randn(6, 5, dtype=torch.float64)
    optimizer = torch.optim.AdamW([layer.lora_A, layer.lora_B])
    layer(x).sum().backward()
    optimizer.step()
    layer.eval()
    before = layer(x)
    weight = layer.weight.detach().numpy().copy()
    a, b = layer.lora_A.detach().numpy().copy(), layer.lora_B.detach().numpy().copy()
    expected = weight.copy()
    for n in range(3):
        for o in range(4):
            for i in range(5):
                expected[o, i] += 1.5 / 3 * sum(b[n, o, k] * a[n, k, i] for k in range(2))
    merge_heads([layer], optimizer)
    np.testing.assert_allclose(layer.weight.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    assert (
        torch.count_nonzero(layer.lora_B) == 0 and torch.count_nonzero(layer.lora_A) == layer.lora_A.numel()
    )
    assert layer.lora_A.abs().max() <= 1 / np.sqrt(5)
    for state in (optimizer.state[layer.lora_A], optimizer.state[layer.lora_B]):
        assert all(torch.count_nonzero(value) == 0 for value in state.values())
    torch.testing.assert_close(layer(x), before, rtol=1e-12, atol=1e-12, msg="eval output survives the merge")


def test_merge_formula_for_given_heads():
    layer = _layer(heads=2, rank=1, scale=4.0, in_features=2, out_features=2)
    with torch.no_grad():
        layer.weight.zero_()
        layer.lora_A.copy_(torch.tensor([[[1.0, 2.0]], [[3.0, 0.0]]]))
        layer.lora_B.copy_(torch.tensor([[[1.0], [0.0]], [[0.0], [1.0]]]))
    merge_heads([layer])
    # (4 / 2) * (outer([1, 0], [1, 2]) + outer([0, 1], [3, 0]))
    torch.testing.assert_close(layer.weight, torch.tensor([[2.0, 4.0], [6.0, 0.0]], dtype=torch.float64))


def test_each_head_sees_its_contiguous_chunk_of_the_batch():
    layer = _layer(heads=3)
    x = torch.randn(6, 2, 5, dtype=torch.float64)
    y = layer(x)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    for n in range(3):
        chunk = x[2 * n : 2 * n + 2]
        direct = chunk @ weight.T + bias + 1.5 * (chunk @ layer.lora_A[n].T) @ layer.lora_B[n].T
        torch.testing.assert_close(y[2 * n : 2 * n + 2], direct, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"needs a batch dimension before its features: got shape \(5,\)"):
        layer(torch.randn(5, dtype=torch.float64))


@pytest.mark.parametrize("batch", [1, 2, 4, 5, 7])
def test_a_batch_the_heads_do_not_divide_is_split_as_tensor_split_splits_it(batch):
    """An epoch's last, short batch (7 rows for 3 heads: 3, 2, 2; 2 rows: 1, 1, 0) trains instead of
    stopping the run: each head adds its product on its own block of rows, and the gradients of every
    head's factors match finite differences."""
    layer = _layer(heads=3)
    x = torch.randn(batch, 2, 5, dtype=torch.float64)
    y = layer(x)
    weight, bias = layer.weight.detach(), layer.bias.detach()
    start = 0
    for n, size in enumerate([batch // 3 + (n < batch % 3) for n in range(3)]):
        chunk = x[start : start + size]
        direct = chunk @ weight.T + bias + 1.5 * (chunk @ layer.lora_A[n].T) @ layer.lora_B[n].T
        torch.testing.assert_close(y[start : start + size], direct, rtol=1e-12, atol=1e-12)
        start += size
    assert start == batch
    with torch.no_grad():
        layer.lora_B.normal_()
    assert torch.autograd.gradcheck(lambda a, b: _with_heads(layer, a, b, x), (layer.lora_A, layer.lora_B))


def _with_heads(layer, lora_a, lora_b, x):
    return torch.func.functional_call(layer, {"lora_A": lora_a, "lora_B": lora_b}, (x,))


def test_one_head_without_merges_is_plain_lora():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4)).double()
    reference = copy.deepcopy(model[0])
    context = _context(heads=1, rank=2, scale=2.0, merge_every=100, lr=1e-2)
    method = LTEMethod()
    model = method.prepare(model, context)
    optimizer = method.optimizer(model, context)
    layer = lte_layers(model)[0]
    a = layer.lora_A[0].detach().clone().requires_grad_()
    b = layer.lora_B[0].detach().clone().requires_grad_()
    bias = reference.bias.detach().clone().requires_grad_()
    by_hand = torch.optim.AdamW([bias, a, b], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        x = torch.randn(8, 5, dtype=torch.float64)
        target = torch.randn(8, 4, dtype=torch.float64)
        lora = x @ reference.weight.detach().T + bias + 2.0 * (x @ a.T) @ b.T
        ((lora - target) ** 2).mean().backward()
        by_hand.step()
        by_hand.zero_grad()
        ((model(x) - target) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(layer.lora_A[0], a, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.lora_B[0], b, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.bias, bias, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.weight, reference.weight, msg="the main weight is frozen between merges")


def test_heads_merge_after_every_t_optimizer_steps():
    layer = _layer(heads=2)
    optimizer = merge_every(torch.optim.SGD([layer.lora_A, layer.lora_B], lr=0.1), [layer], every=2)
    x = torch.randn(4, 5, dtype=torch.float64)
    weight = layer.weight.detach().clone()
    layer(x).sum().backward()
    optimizer.step()
    assert int(layer.local_steps) == 1 and torch.equal(layer.weight, weight)
    layer(x).sum().backward()
    with torch.no_grad():
        a_next = layer.lora_A - 0.1 * layer.lora_A.grad
        b_next = layer.lora_B - 0.1 * layer.lora_B.grad
        # n: head, o: output feature, r: rank, i: input feature
        expected = weight + 1.5 / 2 * torch.einsum("nor,nri->oi", b_next, a_next)
    optimizer.step()
    assert int(layer.local_steps) == 0
    torch.testing.assert_close(layer.weight, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"heads": 3}, r"train.batch_size=8 must be a multiple of method.heads=3"),
        ({"heads": 0}, r"method.heads must be an int >= 1, got 0"),
        ({"scale": -1.0}, r"method.scale must be a finite number in \(0.0, inf\)"),
        ({"merge_every": 0}, r"method.merge_every must be an int >= 1"),
    ],
)
def test_bad_settings_are_refused_before_training(settings, match):
    with pytest.raises(ValueError, match=match):
        LTEMethod().prepare(nn.Sequential(nn.Linear(5, 4)), _context(**settings))


def test_rank_is_capped_by_the_layer():
    layer = LTELinear.from_linear(nn.Linear(3, 7), heads=2, rank=32, scale=1.0)
    assert layer.lora_A.shape == (2, 3, 3) and layer.lora_B.shape == (2, 7, 3)
    assert not layer.weight.requires_grad and layer.bias.requires_grad
    built = LTELinear(5, 4, heads=2, rank=2, scale=1.0, bias=False)
    assert built.bias is None and not built.weight.requires_grad
    assert 0 < built.weight.abs().max() <= 1 / 5**0.5, "nn.Linear's initialization"


def _trained(run_dir, steps, resume):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    train = TrainConfig(
        early=steps, unit="step", batch_size=4, lr_other=1e-2, checkpoint_every=4, run_dir=str(run_dir)
    )
    context = MethodContext(
        tensorize=TensorizeConfig(target_modules=["0"]),
        settings={"heads": 2, "rank": 2, "merge_every": 4, "lr": 1e-2, "scale": 2.0},
        train=train,
    )
    method = LTEMethod()
    model = method.prepare(model, context)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 6, generator=generator), torch.randint(0, 2, (24,)))
    trainer = Trainer(
        model,
        lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
        data,
        config=train,
        objective=method.objective(model, context),
        optimizer=method.optimizer(model, context),
    )
    trainer.fit(resume=resume)
    return model


def test_a_run_resumed_at_a_merge_step_matches_an_uninterrupted_one(tmp_path):
    straight = _trained(tmp_path / "straight", 12, resume=False)
    _trained(tmp_path / "resumed", 8, resume=False)
    resumed = _trained(tmp_path / "resumed", 12, resume=True)
    assert int(lte_layers(straight)[0].local_steps) == 0
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0, msg=name)
