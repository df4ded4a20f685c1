"""Teacher-student regression: a 64x64 weight with TT ranks (2, 4, 2), fitted from max ranks (8, 8, 8).

The early stage (weighted sum) must lower the ranks; the late stage (the controller: achievement
scalarisation with a dual size weight, the exact trim, recovery) must reach ``target_ratio`` of the size at
its start within 10% (this layer's sizes are ``8 (r_1 + r_3)(1 + r_2)``: coarse steps, and the nearest
sizes to the target need a middle rank below the teacher's), while the held-out loss stays within a small
factor of the best dense fit (least squares). Seeded, CPU, one thread (tests/rank/conftest.py).
"""

import pytest
import torch

from comera import RankAdaptation, TTLinear, param_groups

SEED = 2
EARLY_STEPS = 1500
LATE_STEPS = 1500
TARGET_RATIO = 0.5
NOISE = 0.1
BATCH = 256


def _regression():
    teacher = TTLinear(64, 64, bias=False, in_shape=(8, 8), out_shape=(8, 8), rank=(2, 4, 2))
    weight = teacher.to_dense().detach()
    weight = weight / weight.std()
    x_train = torch.randn(4096, 64)
    y_train = x_train @ weight.t() + NOISE * torch.randn(4096, 64)
    x_test = torch.randn(1024, 64)
    y_test = x_test @ weight.t() + NOISE * torch.randn(1024, 64)
    return x_train, y_train, x_test, y_test


def test_ranks_shrink_then_reach_the_target_ratio():
    torch.manual_seed(SEED)
    x_train, y_train, x_test, y_test = _regression()
    dense = torch.linalg.lstsq(x_train, y_train).solution
    dense_loss = (x_test @ dense - y_test).square().mean().item()

    student = TTLinear(64, 64, bias=False, in_shape=(8, 8), out_shape=(8, 8), rank=8, order="merge")
    adaptation = RankAdaptation(student, gamma=0.3)
    groups = param_groups(student, lr_cores=1e-3, lr_gates=1e-2, lr_other=1e-3)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.99))
    batches = torch.Generator().manual_seed(SEED)

    def train(steps):
        for step in range(steps):
            index = torch.randint(0, x_train.shape[0], (BATCH,), generator=batches)
            task = (student(x_train[index]) - y_train[index]).square().mean()
            optimizer.zero_grad()
            adaptation.loss(task).backward()
            optimizer.step()
            adaptation.after_step(step + 1)

    initial = (student.ranks, adaptation.size())
    train(EARLY_STEPS)
    early = (student.ranks, adaptation.size())
    adaptation.begin_late_stage(TARGET_RATIO, ema=0.9, late_steps=LATE_STEPS)
    optimizer.param_groups[1]["lr"] = 2e-3  # gentler gate steps while the switch balances the objectives
    train(LATE_STEPS)
    final = (student.ranks, adaptation.size())
    with torch.no_grad():
        test_loss = (student(x_test) - y_test).square().mean().item()

    print(
        f"ranks {initial[0]} -> {early[0]} (early) -> {final[0]} (late); size {initial[1]} -> {early[1]} -> "
        f"{final[1]}; reached {final[1] / early[1]:.3f} of the early size (target {TARGET_RATIO}); "
        f"test loss {test_loss:.4g} vs dense {dense_loss:.4g} ({test_loss / dense_loss:.2f}x)"
    )
    assert early[1] < initial[1] and all(e <= i for e, i in zip(early[0], initial[0]))
    assert final[1] / early[1] == pytest.approx(TARGET_RATIO, rel=0.1)
    assert adaptation.target_reached
    assert test_loss <= 2.0 * dense_loss
