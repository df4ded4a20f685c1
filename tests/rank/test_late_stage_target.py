"""The late-stage controller lands on its size target: seeds 0-9 x target ratios 0.3, 0.5, 0.8.

Teacher: a TTLinear 64 -> 64 over modes (4, 4, 4 | 4, 4, 4) with every TT rank 2 (80 core entries, about a
tenth of the student), outputs of unit variance plus noise 0.1. Student: rank 8 (800 core entries), started
as the TT-SVD of the least-squares (dense) fit, i.e. where an early stage at full rank ends. The late stage
runs ``LATE_STEPS`` steps with ``late_steps=LATE_STEPS``: dual ascent on the size, the exact trim at the
latest after 70 % of them, recovery for the rest. Checks: the final exact size is within 5 % of
``target_ratio`` times the size at the start of the late stage, ``target_reached`` and ``reached_at_step``
report it, and the held-out loss is at most ``FIT_FACTOR`` times that of the dense least-squares fit.
Seeded, CPU, one thread (tests/rank/conftest.py).
"""

import pytest
import torch
from torch import nn

from comera import RankAdaptation, TTLinear, param_groups

MODES = (4, 4, 4)
NOISE = 0.1
LATE_STEPS = 100
BATCH = 64
FIT_FACTOR = 2.0
SIZE_TOLERANCE = 0.05


def _problem(seed: int):
    torch.manual_seed(seed)
    teacher = TTLinear(64, 64, bias=False, in_shape=MODES, out_shape=MODES, rank=2)
    weight = teacher.to_dense().detach()
    weight = weight / (weight.std() * 8.0)  # unit-variance outputs for unit-variance inputs
    x_train, x_test = torch.randn(2048, 64), torch.randn(512, 64)
    y_train = x_train @ weight.t() + NOISE * torch.randn(2048, 64)
    y_test = x_test @ weight.t() + NOISE * torch.randn(512, 64)
    return x_train, y_train, x_test, y_test


@pytest.mark.parametrize("target_ratio", [0.3, 0.5, 0.8])
@pytest.mark.parametrize("seed", range(10))
def test_late_stage_lands_on_the_target_and_keeps_the_fit(seed, target_ratio):
    x_train, y_train, x_test, y_test = _problem(seed)
    dense = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.linalg.lstsq(x_train, y_train).solution.t())
        dense_loss = (dense(x_test) - y_test).square().mean().item()
    student = TTLinear.from_linear(dense, rank=8, in_shape=MODES, out_shape=MODES)
    student.order = "merge"
    adaptation = RankAdaptation(student, gamma=0.0)
    optimizer = torch.optim.AdamW(
        param_groups(student, lr_cores=1e-3, lr_gates=1e-2, lr_other=1e-3), betas=(0.9, 0.99)
    )
    with torch.no_grad():
        adaptation.loss((student(x_train) - y_train).square().mean())
    adaptation.begin_late_stage(target_ratio, ema=0.9, late_steps=LATE_STEPS)
    start_size = adaptation.size()
    batches = torch.Generator().manual_seed(seed)
    events = []
    for step in range(1, LATE_STEPS + 1):
        index = torch.randint(0, x_train.shape[0], (BATCH,), generator=batches)
        task = (student(x_train[index]) - y_train[index]).square().mean()
        optimizer.zero_grad()
        adaptation.loss(task).backward()
        optimizer.step()
        event = adaptation.after_step(step)
        if event is not None:
            events.append(event)
    with torch.no_grad():
        test_loss = (student(x_test) - y_test).square().mean().item()
    final = adaptation.size()
    print(
        f"seed {seed} target {target_ratio}: size {start_size} -> {final} "
        f"({final / start_size / target_ratio:.3f} of the target), ranks {student.ranks}, "
        f"reached at step {adaptation.reached_at_step}, fit {test_loss / dense_loss:.3f} x dense"
    )
    assert final == pytest.approx(target_ratio * start_size, rel=SIZE_TOLERANCE)
    assert adaptation.target_reached and 1 <= adaptation.reached_at_step <= LATE_STEPS
    *partial, last = events
    assert last.action == "trim" and last.size_after == final
    assert all(event.action == "partial_trim" for event in partial)
    assert all(event.size_after <= event.target_size < event.size_before for event in partial)
    assert adaptation.phase == "recover"
    assert test_loss <= FIT_FACTOR * dense_loss


def test_a_layer_whose_bond_died_before_the_trim_is_left_out_of_it():
    torch.manual_seed(0)
    model = nn.Sequential(
        TTLinear(16, 16, rank=4, in_shape=(4, 4), out_shape=(4, 4)), TTLinear(16, 16, rank=4)
    )
    adaptation = RankAdaptation(model)
    adaptation.loss(torch.tensor(1.0))
    adaptation.begin_late_stage(0.5, target_loss=0.5, late_steps=1)
    with torch.no_grad():
        model[1].gates[0].zero_()
    event = adaptation.after_step(1)
    assert event is not None and event.action == "trim"
    assert adaptation.size() <= 1.05 * adaptation.target_size
    assert float(model[1].gates[0].detach().abs().max()) == 0.0, "the dead bond stays dead"
