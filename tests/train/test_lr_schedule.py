"""The Trainer's learning-rate schedule: the factor against a hand computation, every param group scaled
from its own peak across both CoMERA stages, an exact resume, and the settings' checks."""

import math

import pytest
import torch
from tiny import loss_fn, make_data, make_model, parameters_of, run_settings

from comera.methods.comera import CoMERAObjective
from comera.train import TrainConfig, Trainer, read_metrics
from comera.train.schedule import apply_lr_schedule, check_schedule, lr_factor, rates_as_tensors

FAST_GATES = {"gamma": 1.0, "lr_gates": 0.05, "lr_cores": 1e-3, "lr_other": 1e-3}


def test_cosine_factor_against_a_hand_computation():
    # 20 steps, warm-up 0.1 -> 2 steps at 1/2, 2/2; then 18 steps of a half cosine from 1 to 0.1
    assert lr_factor(0, 20, "cosine", 0.1, 0.1) == 0.5
    assert lr_factor(1, 20, "cosine", 0.1, 0.1) == 1.0
    assert lr_factor(2, 20, "cosine", 0.1, 0.1) == 1.0  # the cosine's start: the peak
    assert lr_factor(11, 20, "cosine", 0.1, 0.1) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    # step 5: progress 3/18, 0.1 + 0.9 * (1 + cos(pi/6)) / 2
    assert lr_factor(5, 20, "cosine", 0.1, 0.1) == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(3) / 2))
    assert lr_factor(20, 20, "cosine", 0.1, 0.1) == pytest.approx(0.1)
    assert lr_factor(0, 10, "cosine", 0.0, 0.0) == 1.0  # no warm-up: the peak at once
    assert lr_factor(7, 10, "constant", 0.5, 0.2) == 1.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr_schedule": "linear"}, r"lr_schedule must be one of \('constant', 'cosine'\)"),
        ({"warmup": 1.0}, r"warmup must be a finite number in \[0.0, 1.0\)"),
        ({"min_lr_ratio": -0.1}, r"min_lr_ratio must be a finite number in \[0.0, 1.0\]"),
    ],
)
def test_bad_schedule_settings_name_the_setting(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_a_rate_held_as_a_tensor_is_written_in_place_from_a_float_peak():
    weights = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW([{"params": weights[:1], "lr": 0.2}, {"params": weights[1:], "lr": 0.05}])
    apply_lr_schedule(optimizer, 0.5)  # the peaks are recorded from the float rates
    rates_as_tensors(optimizer, torch.device("cpu"))
    held = [group["lr"] for group in optimizer.param_groups]
    assert [(rate.dtype, rate.shape) for rate in held] == [(torch.float32, torch.Size([]))] * 2
    apply_lr_schedule(optimizer, 0.25)
    for group, rate, peak in zip(optimizer.param_groups, held, (0.2, 0.05)):
        assert group["lr"] is rate  # the same tensor: a captured graph reads the new rate
        assert type(group["initial_lr"]) is float and group["initial_lr"] == peak
        assert rate.item() == pytest.approx(peak * 0.25, rel=1e-7)
    rates_as_tensors(optimizer, torch.device("cpu"))
    assert [group["lr"] for group in optimizer.param_groups] == held  # kept, not replaced

    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=0.3)
    rates_as_tensors(fresh, torch.device("cpu"))  # a tensor before the first schedule: its peak is a float
    apply_lr_schedule(fresh, 0.5)
    assert type(fresh.param_groups[0]["initial_lr"]) is float
    assert fresh.param_groups[0]["lr"].item() == pytest.approx(0.15)


def test_training_with_tensor_rates_follows_the_float_schedule():
    def train(as_tensors: bool):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.1, foreach=False)
        if as_tensors:
            rates_as_tensors(optimizer, torch.device("cpu"))
        for step in range(6):
            apply_lr_schedule(optimizer, lr_factor(step, 6, "cosine", 0.3, 0.1))
            optimizer.zero_grad()
            (weight.sin().sum() * (step + 1)).backward()
            optimizer.step()
        return weight.detach()

    floats, tensors = train(False), train(True)
    assert not torch.equal(floats, train(False) * 0.5)  # the rates matter
    torch.testing.assert_close(tensors, floats, rtol=1e-6, atol=1e-7)


def _comera_trainer(run_dir, **changes):
    config, settings = run_settings(
        early=5,
        late=5,
        unit="step",
        batch_size=8,
        lr_schedule="cosine",
        warmup=0.2,
        min_lr_ratio=0.1,
        run_dir=str(run_dir),
        log_every=1,
        plot=False,
        **{**FAST_GATES, **changes},
    )
    model = make_model()
    return Trainer(model, loss_fn, make_data(), config=config, objective=CoMERAObjective(model, settings))


def test_every_group_follows_its_own_peak_through_both_stages(tmp_path):
    """The rates each step trained with (its train record, one a step) are every group's own peak times the
    schedule's factor, across the switch to the late stage."""
    trainer = _comera_trainer(tmp_path)
    peaks = {group["name"]: group["lr"] for group in trainer.optimizer.param_groups}
    assert len(set(peaks.values())) > 1  # the groups have different peaks
    trainer.fit()
    records = [record for record in read_metrics(tmp_path) if record["kind"] == "train"]
    assert trainer.objective.stage == "late" and [record["step"] for record in records] == list(range(1, 11))
    assert {record["stage"] for record in records} == {"early", "late"}
    for index, record in enumerate(records):
        # total 10 steps, 2 of warm-up: (s + 1) / 2, then 0.1 + 0.9 * (1 + cos(pi * (s - 2) / 8)) / 2
        factor = (index + 1) / 2 if index < 2 else 0.1 + 0.45 * (1 + math.cos(math.pi * (index - 2) / 8))
        assert record["lr"] == pytest.approx({name: peak * factor for name, peak in peaks.items()}), index
    rates = {group["name"]: float(group["lr"]) for group in trainer.optimizer.param_groups}
    assert rates == pytest.approx(records[-1]["lr"])  # the record holds the rates the optimizer held


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    whole = _comera_trainer(tmp_path / "whole")
    whole.fit()
    part = _comera_trainer(tmp_path / "part", checkpoint_every=3, keep_checkpoints=10)
    part.fit()
    checkpoint = tmp_path / "part" / "checkpoints" / "step-00000006.pt"
    resumed = _comera_trainer(tmp_path / "part", checkpoint_every=3, keep_checkpoints=10)
    assert resumed.fit(resume=str(checkpoint)).step == 10
    got, want = parameters_of(resumed.module), parameters_of(whole.module)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert [group["lr"] for group in resumed.optimizer.param_groups] == [
        group["lr"] for group in whole.optimizer.param_groups
    ]


def test_constant_leaves_the_rates_and_the_groups_alone():
    config = TrainConfig(early=3, unit="step", batch_size=8, lr_other=1e-3, plot=False)
    trainer = Trainer(make_model(), loss_fn, make_data(), config=config)
    before = [group["lr"] for group in trainer.optimizer.param_groups]
    trainer.fit()
    assert [group["lr"] for group in trainer.optimizer.param_groups] == before
    assert not any("initial_lr" in group for group in trainer.optimizer.param_groups)


@pytest.mark.parametrize(
    ("total", "warmup", "min_lr_ratio", "warm"),
    [(20, 0.1, 0.1, 2), (10, 0.35, 0.0, 3), (7, 0.0, 0.25, 0), (1, 0.5, 0.1, 0), (4, 0.5, 1.0, 2)],
)
def test_cosine_factor_matches_a_float64_reference_at_every_step(total, warmup, min_lr_ratio, warm):
    """Every step ``0..total`` (the warm-up's last step, ``step == w``, the last step and ``total`` itself
    included) against the documented formula evaluated by hand, with ``w`` written out; ``total=1`` is the
    smallest run accepted."""
    for step in range(total + 1):
        if step < warm:
            want = (step + 1) / warm
        else:
            cosine = math.cos(math.pi * (step - warm) / (total - warm))
            want = min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 + cosine) / 2.0
        assert lr_factor(step, total, "cosine", warmup, min_lr_ratio) == pytest.approx(want, rel=1e-12), step
    if warm:
        assert lr_factor(warm - 1, total, "cosine", warmup, min_lr_ratio) == 1.0  # the ramp ends at the peak
    assert lr_factor(warm, total, "cosine", warmup, min_lr_ratio) == 1.0  # the cosine starts at the peak
    assert lr_factor(total, total, "cosine", warmup, min_lr_ratio) == pytest.approx(min_lr_ratio, abs=1e-15)


@pytest.mark.parametrize(
    ("step", "total", "message"),
    [
        (-1, 20, r"^step must be an int in \[0, 20\], got -1$"),
        (21, 20, r"^step must be an int in \[0, 20\], got 21$"),
        (0, 0, r"^total must be an int >= 1, got 0$"),
    ],
)
def test_lr_factor_names_a_step_or_total_out_of_range(step, total, message):
    """``total >= 1`` and ``0 <= step <= total``: a value just outside is refused naming the argument and its
    range."""
    with pytest.raises(ValueError, match=message):
        lr_factor(step, total, "cosine", 0.1, 0.1)


def test_check_schedule_accepts_the_closed_ends_and_refuses_just_outside():
    """``warmup`` in ``[0, 1)`` and ``min_lr_ratio`` in ``[0, 1]``: both ends of ``min_lr_ratio`` and the low
    end of ``warmup`` pass; a value beyond them is refused naming the setting and its interval, an unknown
    schedule naming the choices."""
    for warmup, ratio in [(0.0, 0.0), (0.99, 1.0)]:
        assert check_schedule("cosine", warmup, ratio) is None
    unknown = r"^lr_schedule must be one of \('constant', 'cosine'\), got 'linear'$"
    with pytest.raises(ValueError, match=unknown):
        check_schedule("linear", 0.1, 0.1)
    with pytest.raises(ValueError, match=r"^warmup must be a finite number in \[0.0, 1.0\), got -0.1$"):
        check_schedule("cosine", -0.1, 0.1)
    with pytest.raises(ValueError, match=r"^min_lr_ratio must be a finite number in \[0.0, 1.0\], got 1.5$"):
        check_schedule("cosine", 0.1, 1.5)


def test_a_float32_rate_tensor_on_the_device_is_kept_itself():
    """A group already holding a 0-dim float32 tensor on ``device`` keeps that very tensor (a captured graph
    reads it); equality of values is not enough."""
    rate = torch.tensor(0.25, dtype=torch.float32)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=rate)
    rates_as_tensors(optimizer, torch.device("cpu"))
    assert optimizer.param_groups[0]["lr"] is rate


def test_a_rate_tensor_of_another_dtype_is_replaced_by_a_float32_one():
    """A float64 rate tensor on the right device is replaced by a float32 tensor of the same rate."""
    rate = torch.tensor(0.2, dtype=torch.float64)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=rate)
    rates_as_tensors(optimizer, torch.device("cpu"))
    held = optimizer.param_groups[0]["lr"]
    assert held is not rate and held.dtype == torch.float32 and held.shape == ()
    assert held.item() == torch.tensor(0.2, dtype=torch.float32).item()


def test_rate_tensors_are_float32_whatever_the_default_dtype():
    """The rate tensor is float32 even when torch's default dtype is float64 (the dtype is explicit)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        rates_as_tensors(optimizer, torch.device("cpu"))
    finally:
        torch.set_default_dtype(previous)
    assert optimizer.param_groups[0]["lr"].dtype == torch.float32


def test_rate_tensors_are_placed_on_the_given_device():
    """The rate tensor lives on the ``device`` argument (here ``meta``, not the default CPU), and a second
    call keeps it there as the same tensor."""
    meta = torch.device("meta")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.3)
    rates_as_tensors(optimizer, meta)
    held = optimizer.param_groups[0]["lr"]
    assert held.device == meta and held.dtype == torch.float32 and held.shape == ()
    rates_as_tensors(optimizer, meta)
    assert optimizer.param_groups[0]["lr"] is held
