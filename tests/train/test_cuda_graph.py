"""Whole-step CUDA Graph (:mod:`comera.train.cuda_graph`).

The bucket, padding and argument checks run everywhere. The graph tests need CUDA and are skipped without
it; they compare replayed steps with eager steps of an identical model (same batches, same capturable
AdamW), through a prune and a stage switch, and check that a non-finite batch leaves no trace.
"""

import re
from types import MappingProxyType, SimpleNamespace

import pytest
import torch
from tiny import FEATURES, loss_fn, make_model
from torch import nn

from comera import prune_
from comera.methods.comera import CoMERAObjective
from comera.train.cuda_graph import STEP_VALUES, CudaGraphStep, capturable_adam
from comera.train.padding import batch_length, check_buckets, choose_bucket, fill_static, pad_batch, pad_to

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


# pure logic (any device)
def test_check_buckets_accepts_increasing_positive_ints_only():
    assert check_buckets([8, 16, 32]) == (8, 16, 32)
    for bad in ([], [16, 8], [8, 8], [0, 4], [4.0], (True, 2), "8"):
        with pytest.raises(ValueError, match="buckets must be a strictly increasing list of ints >= 1"):
            check_buckets(bad)


def test_choose_bucket_takes_the_smallest_that_fits():
    buckets = (8, 16, 32)
    assert [choose_bucket(n, buckets) for n in (1, 8, 9, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError, match=r"batch length 33 exceeds the largest bucket 32"):
        choose_bucket(33, buckets)


def test_pad_to_appends_the_value_along_the_dim():
    tensor = torch.arange(6.0).reshape(2, 3)
    padded = pad_to(tensor, 1, 5, -1.0)
    assert torch.equal(padded, torch.tensor([[0.0, 1, 2, -1, -1], [3, 4, 5, -1, -1]]))
    assert pad_to(tensor, 0, 2, 9.0) is tensor
    with pytest.raises(ValueError, match="cannot pad dim 1 of size 3 down to 2"):
        pad_to(tensor, 1, 2, 0.0)


def test_pad_batch_pads_only_the_named_entries():
    batch = {"ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.tensor([1, 0]), "name": "x"}
    padded = pad_batch(batch, {"ids": 0}, 5)
    assert torch.equal(padded["ids"], torch.tensor([[1, 1, 1, 0, 0]] * 2))
    assert padded["labels"] is batch["labels"] and padded["name"] == "x"
    as_tuple = pad_batch((torch.ones(2, 3), torch.zeros(2, 3, 4)), {0: 0.5, 1: 7.0}, 4)
    assert (
        as_tuple[0][:, 3].eq(0.5).all() and as_tuple[1][:, 3].eq(7.0).all() and as_tuple[1].shape == (2, 4, 4)
    )
    with pytest.raises(ValueError, match=r"pad names 'mask', which the batch lacks"):
        pad_batch(batch, {"mask": 0}, 5)
    with pytest.raises(ValueError, match=r"batch\['labels'\] must be a tensor with more than 1 dims"):
        pad_batch(batch, {"labels": 0}, 5)


def test_batch_length_requires_one_common_length():
    batch = {"ids": torch.ones(2, 7), "mask": torch.ones(2, 7), "other": torch.ones(2, 3)}
    assert batch_length(batch, {"ids": 0, "mask": 0}) == 7
    with pytest.raises(ValueError, match="must share one length"):
        batch_length(batch, {"ids": 0, "other": 0})


def test_fill_static_copies_pads_and_refuses_shape_changes():
    static = {"ids": torch.full((2, 6), 5), "labels": torch.zeros(2, dtype=torch.long), "tag": "a"}
    fill_static(
        static,
        {"ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.tensor([3, 4]), "tag": "a"},
        {"ids": 0},
    )
    assert torch.equal(static["ids"], torch.tensor([[1, 1, 1, 1, 0, 0]] * 2))
    assert torch.equal(static["labels"], torch.tensor([3, 4]))
    good_ids = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(3,\)"):
        fill_static(static, {"ids": good_ids, "labels": torch.ones(3), "tag": "a"}, {"ids": 0})
    with pytest.raises(ValueError, match=r"batch\['ids'\] has shape \(2, 7\).*up to the padded length"):
        fill_static(static, {"ids": torch.ones(2, 7), "labels": torch.ones(2), "tag": "a"}, {"ids": 0})
    with pytest.raises(ValueError, match=r"batch\['tag'\] = 'b' differs"):
        fill_static(static, {"ids": good_ids, "labels": torch.ones(2), "tag": "b"}, {"ids": 0})
    with pytest.raises(ValueError, match="batch has entries"):
        fill_static(static, {"ids": good_ids}, {"ids": 0})


def test_a_batch_that_is_one_tensor_is_a_one_entry_batch():
    ids = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(pad_batch(ids, {0: 9}, 4), torch.tensor([[1, 2, 9, 9], [3, 4, 9, 9]]))
    assert batch_length(ids, {0: 0}) == 2
    static = torch.zeros(2, 3, dtype=torch.long)
    fill_static(static, ids, {0: 7})
    assert torch.equal(static, torch.tensor([[1, 2, 7], [3, 4, 7]]))
    with pytest.raises(ValueError, match=r"batch\[0\] has shape \(3, 3\)"):
        fill_static(static, torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="batch must be a tensor, or a dict, list or tuple of tensors"):
        fill_static(static, "not a batch")


def _parts(capturable=True):
    model = make_model(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=capturable)
    return model, optimizer, CoMERAObjective(model)


def _exactly(message):
    """A ``pytest.raises`` pattern that matches ``message`` as the whole text, nothing around it."""
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"model": "net"}, TypeError, "model must be an nn.Module, got str"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable as loss_fn(model, batch), got int"),
        (
            {"optimizer": "sgd"},
            TypeError,
            "optimizer must be torch.optim.AdamW or torch.optim.Adam (their fresh state is zeros, which "
            "the warm-up undo relies on), got SGD",
        ),
        (
            {"capturable": False},
            ValueError,
            "optimizer must be built with capturable=True in every param group",
        ),
        ({"objective": "rank"}, TypeError, "objective must be a comera.train.objective.Objective, got str"),
        (
            {"buckets": [8]},
            ValueError,
            "buckets and pad go together: give both (padded lengths) or neither (fixed shapes)",
        ),
        (
            {"buckets": [8, 4], "pad": {0: 0}},
            ValueError,
            "buckets must be a strictly increasing list of ints >= 1, got [8, 4]",
        ),
        (
            {"buckets": [8], "pad": {}},
            ValueError,
            "pad must be a non-empty mapping of batch key -> pad value, got {}",
        ),
        (
            {"buckets": [8], "pad": [0]},
            ValueError,
            "pad must be a non-empty mapping of batch key -> pad value, got [0]",
        ),
        ({"length_dim": -1}, ValueError, "length_dim must be an int >= 0, got -1"),
        ({"grad_clip": 0.0}, ValueError, "grad_clip must be a finite number in (0.0, inf), got 0.0"),
        ({"warmup": 0}, ValueError, "warmup must be an int >= 1, got 0"),
        (
            {"autocast_dtype": torch.float64},
            ValueError,
            "autocast_dtype must be None, torch.bfloat16 or torch.float16, got torch.float64",
        ),
        ({}, ValueError, "model parameters must all be on one CUDA device, got ['cpu']"),
    ],
    ids=[
        "model",
        "loss_fn",
        "optimizer-type",
        "capturable",
        "objective",
        "buckets-without-pad",
        "buckets-order",
        "pad-empty",
        "pad-not-mapping",
        "length_dim",
        "grad_clip",
        "warmup",
        "autocast_dtype",
        "cpu-model",
    ],
)
def test_bad_arguments_are_named(change, error, message):
    """Each bad argument is refused with the full message naming it, what it must be and what it got."""
    change = dict(change)  # the parametrized dict is shared by every run of this test in the process
    model, optimizer, rank = _parts(change.pop("capturable", True))
    if change.pop("optimizer", None) == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    leading = {"model": model, "loss_fn": loss_fn, "optimizer": optimizer, "objective": rank}
    for name in [name for name in change if name in leading]:
        leading[name] = change.pop(name)
    with pytest.raises(error, match=_exactly(message)):
        CudaGraphStep(*leading.values(), **change)


class _ReportsDevices(nn.Module):
    """Stands in for a model placed on ``devices``: its parameters are placeholders that only carry a
    ``device``, the one thing the constructor reads from them, so a construction on "CUDA" runs to its end
    on a machine without CUDA (nothing touches the device before the first step)."""

    def __init__(self, *devices):
        super().__init__()
        self.devices = [torch.device(device) for device in devices]

    def parameters(self, recurse=True):
        return iter([SimpleNamespace(device=device) for device in self.devices])


def test_constructor_defaults_on_one_cuda_device():
    """One CUDA device is accepted and kept; the documented defaults (no buckets, length_dim 1, no clipping,
    warmup 3, no autocast) are what the stepper holds, and nothing is captured before the first step."""
    model = _ReportsDevices("cuda:0")
    _, optimizer, rank = _parts()
    stepper = CudaGraphStep(model, loss_fn, optimizer, rank)
    assert stepper.device == torch.device("cuda", 0)
    assert stepper.model is model and stepper.loss_fn is loss_fn
    assert stepper.optimizer is optimizer and stepper.objective is rank
    held = (stepper.buckets, stepper.pad, stepper.length_dim, stepper.grad_clip, stepper.warmup)
    assert held == (None, None, 1, None, 3)
    assert stepper.autocast_dtype is None
    assert stepper.captured_buckets == ()


def test_constructor_keeps_the_given_settings():
    """Buckets become a tuple, any non-empty mapping ``pad`` a dict, ``grad_clip`` a float; the other
    settings are kept as given."""
    _, optimizer, rank = _parts()
    pad = MappingProxyType({"ids": 0, "labels": -100})
    stepper = CudaGraphStep(
        _ReportsDevices("cuda:1"),
        loss_fn,
        optimizer,
        rank,
        buckets=[8, 16],
        pad=pad,
        length_dim=2,
        grad_clip=2,
        warmup=1,
        autocast_dtype=torch.bfloat16,
    )
    assert stepper.device == torch.device("cuda", 1)
    assert stepper.buckets == (8, 16)
    assert type(stepper.pad) is dict and stepper.pad == {"ids": 0, "labels": -100}
    assert type(stepper.grad_clip) is float and stepper.grad_clip == 2.0
    assert (stepper.length_dim, stepper.warmup, stepper.autocast_dtype) == (2, 1, torch.bfloat16)
    assert stepper.captured_buckets == ()


@pytest.mark.parametrize(
    "devices",
    [("cuda:0", "cuda:1"), ("cpu", "cuda:0"), ("meta",), ()],
    ids=["two-gpus", "cpu-and-gpu", "meta", "no-parameters"],
)
def test_model_must_sit_on_exactly_one_cuda_device(devices):
    """Two CUDA devices, a CPU/CUDA mix, a non-CUDA device and a model without parameters are all refused
    with the devices found, sorted."""
    _, optimizer, rank = _parts()
    found = sorted(str(torch.device(device)) for device in devices)
    with pytest.raises(
        ValueError, match=_exactly(f"model parameters must all be on one CUDA device, got {found}")
    ):
        CudaGraphStep(_ReportsDevices(*devices), loss_fn, optimizer, rank)


def test_invalidate_sets_the_gradients_to_none():
    """``invalidate`` drops the gradients (set to None, not zeroed: they live in the dropped graphs' pools)
    and leaves nothing captured."""
    model, optimizer, rank = _parts()
    stepper = CudaGraphStep(_ReportsDevices("cuda:0"), loss_fn, optimizer, rank)
    inputs, labels = _batches(1, batch=4)[0]
    loss_fn(model, (inputs, labels)).backward()
    assert all(param.grad is not None for param in model.parameters())
    stepper.invalidate()
    assert [param.grad for param in model.parameters()] == [None] * len(list(model.parameters()))
    assert stepper.captured_buckets == ()


def test_capturable_adam_needs_capturable_true_in_every_group():
    """Only AdamW/Adam qualify, and only when every param group has ``capturable`` set true; a group
    without the key at all counts as not capturable."""
    params = list(make_model(dropout=0.0).parameters())
    assert capturable_adam(torch.optim.AdamW(params, capturable=True))
    assert capturable_adam(torch.optim.Adam(params, capturable=True))
    assert not capturable_adam(torch.optim.AdamW(params))
    assert not capturable_adam(torch.optim.SGD(params, lr=0.1))
    mixed = [{"params": params[:1], "capturable": False}, {"params": params[1:]}]
    assert not capturable_adam(torch.optim.AdamW(mixed, capturable=True))
    without_key = torch.optim.AdamW(params, capturable=True)
    del without_key.param_groups[0]["capturable"]
    assert not capturable_adam(without_key)


# CUDA graphs
def _cuda_parts(seed=0, dead_gate=False):
    model = make_model(seed=seed, dropout=0.0, dead_gate=dead_gate).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    return model, optimizer, CoMERAObjective(model, target_ratio=0.5, target_loss=0.5)


def _eager_step(model, optimizer, rank, batch, loss, grad_clip=None):
    saved = rank.adaptation.loss_average_state()
    task = loss(model, batch)
    objective = rank.loss(task)
    objective.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    applied = bool(torch.isfinite(objective.detach() + norm))
    if applied:
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    else:
        rank.adaptation.restore_loss_average(saved)
    optimizer.zero_grad(set_to_none=True)
    return [float(task), float(objective), float(norm), float(applied)]


def _batches(count, batch=8, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, FEATURES, generator=generator),
            torch.randint(0, 3, (batch,), generator=generator),
        )
        for _ in range(count)
    ]


def _cuda_loss(model, batch):
    inputs, labels = batch
    return nn.functional.cross_entropy(model(inputs.cuda()), labels.cuda())


def _assert_same_state(graph_parts, eager_parts):
    (g_model, g_opt, g_rank), (e_model, e_opt, e_rank) = graph_parts, eager_parts
    for (name, got), expected in zip(g_model.state_dict().items(), e_model.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    for got, expected in zip(g_opt.state.values(), e_opt.state.values()):
        assert float(got["step"]) == float(expected["step"])
        torch.testing.assert_close(got["exp_avg"], expected["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_rank.adaptation.loss_average_state(), e_rank.adaptation.loss_average_state())


@needs_cuda
def test_replayed_steps_match_eager_steps_and_warmup_leaves_no_trace():
    graph_parts, eager_parts = _cuda_parts(), _cuda_parts()
    model, optimizer, rank = graph_parts
    stepper = CudaGraphStep(model, _cuda_loss, optimizer, rank, warmup=3, grad_clip=1.0)
    for batch in _batches(6):
        values = stepper.step(batch).tolist()
        expected = _eager_step(*eager_parts, batch, _cuda_loss, grad_clip=1.0)
        assert len(values) == len(STEP_VALUES)
        assert values == pytest.approx(expected, rel=1e-5, abs=1e-6)
        _assert_same_state(graph_parts, eager_parts)
    assert stepper.captured_buckets == (None,)
    assert all(float(state["step"]) == 6 for state in graph_parts[1].state.values())


@needs_cuda
def test_a_batch_that_is_one_tensor_is_replayed_like_eager_steps():
    def loss(model, batch):  # features then the label in the last column, one tensor
        batch = batch.cuda()
        return nn.functional.cross_entropy(model(batch[:, :-1]), batch[:, -1].long())

    graph_parts, eager_parts = _cuda_parts(), _cuda_parts()
    stepper = CudaGraphStep(*graph_parts[:1], loss, *graph_parts[1:])
    for inputs, labels in _batches(4):
        batch = torch.cat([inputs, labels[:, None].float()], dim=1)
        values = stepper.step(batch).tolist()
        assert values == pytest.approx(_eager_step(*eager_parts, batch, loss), rel=1e-5, abs=1e-6)
        _assert_same_state(graph_parts, eager_parts)


@needs_cuda
def test_nonfinite_batch_is_skipped_inside_the_graph():
    graph_parts, eager_parts = _cuda_parts(), _cuda_parts()
    stepper = CudaGraphStep(graph_parts[0], _cuda_loss, graph_parts[1], graph_parts[2])
    batches = _batches(4)
    batches[2][0][1, 3] = float("nan")
    for batch in batches:
        values = stepper.step(batch).tolist()
        expected = _eager_step(*eager_parts, batch, _cuda_loss)
        assert values[3] == expected[3]
        _assert_same_state(graph_parts, eager_parts)
    assert all(float(state["step"]) == 3 for state in graph_parts[1].state.values())


@needs_cuda
def test_recapture_after_prune_and_stage_switch_matches_eager():
    graph_parts = _cuda_parts(dead_gate=True)
    eager_parts = _cuda_parts(dead_gate=True)
    stepper = CudaGraphStep(graph_parts[0], _cuda_loss, graph_parts[1], graph_parts[2])
    batches = _batches(9)
    for index, batch in enumerate(batches):
        if index == 3:
            for model, optimizer, _ in (graph_parts, eager_parts):
                assert prune_(model, optimizer).changed
            stepper.invalidate()
        if index == 6:
            for _, _, rank in (graph_parts, eager_parts):
                rank.begin_late_stage()
            stepper.invalidate()
        stepper.step(batch)
        _eager_step(*eager_parts, batch, _cuda_loss)
        _assert_same_state(graph_parts, eager_parts)


class _Tokens(nn.Module):
    """Per-token comera model: ``(B, L, FEATURES) -> (B, L, 3)`` scores."""

    def __init__(self):
        super().__init__()
        self.body = make_model(dropout=0.0)

    def forward(self, tokens):
        return self.body(tokens)


def _masked_loss(model, batch):
    scores = model(batch["tokens"])
    per_token = nn.functional.cross_entropy(scores.transpose(1, 2), batch["labels"], reduction="none")
    mask = batch["mask"]
    return (per_token * mask).sum() / mask.sum()


@needs_cuda
def test_length_buckets_pad_without_changing_the_loss_and_match_eager_steps():
    def parts():
        model = _Tokens().cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True), CoMERAObjective(model)

    graph_parts, eager_parts = parts(), parts()
    pad = {"tokens": 0.0, "labels": 0, "mask": 0.0}
    stepper = CudaGraphStep(
        graph_parts[0], _masked_loss, graph_parts[1], graph_parts[2], buckets=[8, 16], pad=pad
    )
    generator = torch.Generator().manual_seed(2)
    for length in (5, 12, 8, 3, 16):
        batch = {
            "tokens": torch.randn(4, length, FEATURES, generator=generator).cuda(),
            "labels": torch.randint(0, 3, (4, length), generator=generator).cuda(),
            "mask": torch.ones(4, length).cuda(),
        }
        padded = pad_batch(batch, pad, choose_bucket(length, (8, 16)))
        with torch.no_grad():
            unpadded_loss = float(_masked_loss(eager_parts[0], batch))
        values = stepper.step(batch).tolist()
        assert values[0] == pytest.approx(unpadded_loss, rel=1e-5)
        _eager_step(*eager_parts, padded, _masked_loss)
        _assert_same_state(graph_parts, eager_parts)
    assert sorted(stepper.captured_buckets) == [8, 16]
