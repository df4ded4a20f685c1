"""The late-stage controller runs after every optimizer step without a call the loop can forget.

Counting controller steps: on a layer whose gates no optimizer moves (learning rate 0), the size stays at
160 against a target of 100, so every controller step multiplies the dual weight by exactly
``exp(DUAL_RATE * 0.6)`` (tests/rank/test_late_stage_controller.py checks that rule): after ``n`` controller
steps the weight is ``exp(n * DUAL_RATE * 0.6)``.

Landing on the target: the teacher-student problem of tests/rank/test_late_stage_target.py (seed 0, target
0.5, 100 late steps), trained by a loop that never calls ``after_step``, against the same loop run with
``step_hook=False`` and ``after_step`` after every step (the controller as it ran before the hook existed).
"""

import copy
import dataclasses
import functools
import gc
import math
import weakref

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

from comera import RankAdaptation, TTLinear, param_groups
from comera.rank.adaptation import DUAL_RATE

GAP = 0.6  # size 160 over target 100, minus 1


def _frozen_gates():
    """A 160-entry layer in the late stage toward 100 entries, and an optimizer whose steps leave it as is."""
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64))
    adaptation = RankAdaptation(model)
    adaptation.begin_late_stage(0.625, target_loss=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    assert adaptation.size() == 160 and adaptation.target_size == 100.0
    return model, adaptation, optimizer


def _controller_steps(adaptation) -> float:
    return math.log(float(adaptation.size_weight)) / (DUAL_RATE * GAP)


def _train_step(model, optimizer, adaptation):
    optimizer.zero_grad()
    adaptation.loss(model(torch.ones(2, 16, dtype=torch.float64)).square().mean()).backward()
    optimizer.step()


def test_every_optimizer_step_runs_the_controller_once():
    model, adaptation, optimizer = _frozen_gates()
    for _ in range(5):
        _train_step(model, optimizer, adaptation)
    assert _controller_steps(adaptation) == pytest.approx(5, abs=1e-9)
    assert adaptation.late_optimizer_steps == 5


def test_after_step_after_an_optimizer_step_does_not_run_the_controller_again():
    model, adaptation, optimizer = _frozen_gates()
    for step in range(1, 6):
        _train_step(model, optimizer, adaptation)
        assert adaptation.after_step(step) is None
    assert _controller_steps(adaptation) == pytest.approx(5, abs=1e-9)
    adaptation.after_step(6)  # no optimizer step since the last call: the call itself runs the controller
    assert _controller_steps(adaptation) == pytest.approx(6, abs=1e-9)


def test_a_skipped_optimizer_step_or_another_optimizer_does_not_count():
    model, adaptation, optimizer = _frozen_gates()
    other = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)  # holds none of the model's gates
    scaler = torch.amp.GradScaler("cpu")
    _train_step(model, optimizer, adaptation)
    other.step()
    for bad in (False, True):  # GradScaler skips the optimizer step whose gradients are not finite
        optimizer.zero_grad()
        task = model(torch.ones(2, 16, dtype=torch.float64)).square().mean()
        scaler.scale(adaptation.loss(task * (math.inf if bad else 1.0))).backward()
        scaler.step(optimizer)
        scaler.update()
    assert _controller_steps(adaptation) == pytest.approx(2, abs=1e-9)
    assert adaptation.late_optimizer_steps == 2


def test_the_early_stage_and_step_hook_false_leave_the_hook_out():
    gc.collect()  # controllers of earlier tests go with their hooks
    hooks = len(_global_optimizer_post_hooks)
    torch.manual_seed(0)
    model = nn.Sequential(TTLinear(16, 16, in_shape=(4, 4), out_shape=(4, 4), rank=4, dtype=torch.float64))
    adaptation = RankAdaptation(model)
    assert len(_global_optimizer_post_hooks) == hooks, "the early stage needs no hook"
    adaptation.begin_late_stage(0.625, target_loss=1.0)
    assert len(_global_optimizer_post_hooks) == hooks + 1
    adaptation.step_hook = False
    assert len(_global_optimizer_post_hooks) == hooks
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), adaptation)
    assert float(adaptation.size_weight) == 1.0
    with pytest.raises(ValueError, match="step_hook must be True or False, got 1"):
        adaptation.step_hook = 1


def test_the_hook_does_not_keep_the_controller_alive():
    gc.collect()  # controllers of earlier tests go with their hooks
    hooks = len(_global_optimizer_post_hooks)
    model, adaptation, optimizer = _frozen_gates()
    reference = weakref.ref(adaptation)
    del adaptation
    gc.collect()
    assert reference() is None and len(_global_optimizer_post_hooks) == hooks
    optimizer.step()


def test_a_copy_runs_its_own_controller_from_its_own_hook():
    gc.collect()  # controllers of earlier tests go with their hooks
    hooks = len(_global_optimizer_post_hooks)
    model, adaptation, optimizer = _frozen_gates()
    twin = copy.deepcopy(adaptation)
    assert len(_global_optimizer_post_hooks) == hooks + 2
    _train_step(model, optimizer, adaptation)
    twin_optimizer = torch.optim.SGD(twin.model.parameters(), lr=0.0)
    for _ in range(2):
        _train_step(twin.model, twin_optimizer, twin)
    assert _controller_steps(adaptation) == pytest.approx(1, abs=1e-9)
    assert _controller_steps(twin) == pytest.approx(2, abs=1e-9)
    del twin
    gc.collect()
    assert len(_global_optimizer_post_hooks) == hooks + 1


def test_a_compiled_training_step_runs_the_controller_after_each_optimizer_step():
    model, adaptation, optimizer = _frozen_gates()
    step = torch.compile(_train_step, backend="eager")
    for _ in range(3):
        step(model, optimizer, adaptation)
    assert _controller_steps(adaptation) == pytest.approx(3, abs=1e-9)


def test_an_optimizer_step_captured_in_a_cuda_graph_warns_once_and_is_not_counted(monkeypatch):
    model, adaptation, optimizer = _frozen_gates()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.warns(UserWarning, match=r"call adaptation\.after_step\(step\) after every replay") as caught:
        optimizer.step()
        optimizer.step()
    assert len(caught) == 1
    assert float(adaptation.size_weight) == 1.0 and adaptation.late_optimizer_steps == 0


MODES = (4, 4, 4)
LATE_STEPS = 100


@functools.cache
def _problem():
    """Data and the student at the start of the late stage, made once (``torch.linalg.lstsq`` on the CPU
    may differ in the last bits from call to call)."""
    torch.manual_seed(0)
    teacher = TTLinear(64, 64, bias=False, in_shape=MODES, out_shape=MODES, rank=2)
    weight = teacher.to_dense().detach()
    weight = weight / (weight.std() * 8.0)
    x_train = torch.randn(2048, 64)
    y_train = x_train @ weight.t() + 0.1 * torch.randn(2048, 64)
    dense = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.linalg.lstsq(x_train, y_train).solution.t())
    student = TTLinear.from_linear(dense, rank=8, in_shape=MODES, out_shape=MODES)
    student.order = "merge"
    return x_train, y_train, student


def _teacher_student(step_hook: bool, call_after_step: bool):
    x_train, y_train, start = _problem()
    student = copy.deepcopy(start)
    adaptation = RankAdaptation(student, gamma=0.0, step_hook=step_hook)
    optimizer = torch.optim.AdamW(
        param_groups(student, lr_cores=1e-3, lr_gates=1e-2, lr_other=1e-3), betas=(0.9, 0.99)
    )
    with torch.no_grad():
        adaptation.loss((student(x_train) - y_train).square().mean())
    adaptation.begin_late_stage(0.5, ema=0.9, late_steps=LATE_STEPS)
    batches = torch.Generator().manual_seed(0)
    returned = []
    for step in range(1, LATE_STEPS + 1):
        index = torch.randint(0, x_train.shape[0], (64,), generator=batches)
        task = (student(x_train[index]) - y_train[index]).square().mean()
        optimizer.zero_grad()
        adaptation.loss(task).backward()
        optimizer.step()
        if call_after_step:
            returned += [event for event in [adaptation.after_step(1000 + step)] if event is not None]
    return student, adaptation, returned


@pytest.mark.parametrize("call_after_step", [False, True], ids=["loop_without_after_step", "with_after_step"])
def test_a_hand_written_loop_lands_where_the_explicit_controller_lands(call_after_step):
    want_model, want, want_returned = _teacher_student(step_hook=False, call_after_step=True)
    got_model, got, got_returned = _teacher_student(step_hook=True, call_after_step=call_after_step)
    assert want.size() == pytest.approx(want.target_size, rel=0.05) and want.phase == "recover"
    assert got.size() == want.size() and got.phase == "recover"
    for got_tensor, want_tensor in zip(got_model.parameters(), want_model.parameters(), strict=True):
        assert torch.equal(got_tensor, want_tensor)
    assert want.events[-1].action == "trim" and want_returned == want.events
    assert all(1000 < event.step <= 1000 + LATE_STEPS for event in want.events)
    if call_after_step:  # the caller's step numbers, as without the hook
        assert got.events == got_returned == want.events and got.reached_at_step == want.reached_at_step
    else:  # the late optimizer step count
        assert got.events == [dataclasses.replace(event, step=event.step - 1000) for event in want.events]
        assert got.reached_at_step == want.reached_at_step - 1000
