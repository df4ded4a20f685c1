"""Contract of ``peak_memory_mib`` (the readers of ``/proc/self/status``, ``getrusage`` and CUDA faked, so
the values are hand-computed), ``reset_peak_memory``'s device dispatch and every entry of ``train_record``."""

import math
import types

import pytest
import torch
from torch import nn

from comera.train import metrics, records
from comera.train.metrics import peak_memory_mib, reset_peak_memory
from comera.train.objective import Objective
from comera.train.records import StepWindow, train_record

_SELF, _CHILDREN = object(), object()


def _fake_host(monkeypatch, status: dict[str, int], *, maxrss: int, platform: str = "linux") -> None:
    """``/proc/self/status`` holds ``status`` (KiB), ``getrusage(RUSAGE_SELF).ru_maxrss`` is ``maxrss``
    (a child's is another value) and ``sys.platform`` is ``platform``."""
    usage = {_SELF: maxrss, _CHILDREN: 7 * maxrss + 1}
    monkeypatch.setattr(metrics, "status_kib", lambda field: status.get(field))
    monkeypatch.setattr(
        metrics,
        "resource",
        types.SimpleNamespace(
            RUSAGE_SELF=_SELF,
            RUSAGE_CHILDREN=_CHILDREN,
            getrusage=lambda who: types.SimpleNamespace(ru_maxrss=usage[who]),
        ),
    )
    monkeypatch.setattr(metrics, "sys", types.SimpleNamespace(platform=platform))


def test_cpu_peak_is_the_vmhwm_line_in_mib(monkeypatch):
    """On a CPU device the peak is ``VmHWM`` (KiB) / 1024, not ``VmRSS`` nor ``ru_maxrss``."""
    _fake_host(monkeypatch, {"VmRSS": 1024, "VmHWM": 524_288}, maxrss=999_424)
    assert peak_memory_mib(torch.device("cpu")) == 512.0


def test_cpu_peak_without_vmhwm_is_the_process_maxrss_in_kib_on_linux(monkeypatch):
    """Without ``VmHWM``, Linux's ``ru_maxrss`` of the process itself (KiB) / 1024 is the peak."""
    _fake_host(monkeypatch, {"VmRSS": 1024}, maxrss=786_432, platform="linux")
    assert peak_memory_mib(torch.device("cpu")) == 768.0


def test_cpu_peak_without_vmhwm_is_the_process_maxrss_in_bytes_on_macos(monkeypatch):
    """Without ``VmHWM`` on macOS, ``ru_maxrss`` is in bytes: the peak is it / 2**20."""
    _fake_host(monkeypatch, {}, maxrss=768 * 2**20, platform="darwin")
    assert peak_memory_mib(torch.device("cpu")) == 768.0


def test_cuda_peak_is_the_allocator_peak_of_that_device_in_mib(monkeypatch):
    """On ``cuda:1`` the peak is ``torch.cuda.max_memory_allocated(cuda:1)`` bytes / 2**20."""
    device = torch.device("cuda", 1)
    asked = []

    def max_memory_allocated(which=None):
        asked.append(which)
        return {device: 5 * 2**30}[which]

    _fake_host(monkeypatch, {"VmHWM": 1024}, maxrss=1024)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)
    assert peak_memory_mib(device) == 5120.0
    assert asked == [device]


@pytest.mark.parametrize("device", [torch.device("cuda", 1), torch.device("cpu")])
def test_reset_peak_memory_resets_the_cuda_allocator_of_that_device_else_the_resident_mark(
    monkeypatch, device
):
    """A CUDA device resets its own allocator peak (and not ``VmHWM``); a CPU device resets ``VmHWM`` only."""
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda which=None: reset.append(which))
    monkeypatch.setattr(metrics, "reset_peak_resident", lambda: reset.append("VmHWM") or True)
    reset_peak_memory(device)
    assert reset == ([device] if device.type == "cuda" else ["VmHWM"])


class _Staged(Objective):
    """A late-stage objective named ``"toy"`` with ranks in its records."""

    name = "toy"

    @property
    def stage(self) -> str:
        return "late"

    def record(self):
        return {"ranks": {"0": [2, 1]}}


def _optimizer() -> torch.optim.Optimizer:
    """Groups: ``"cores"`` at 0.1, then two unnamed groups at 0.2 and 0.3 (named by their index)."""
    layers = [nn.Linear(2, 2) for _ in range(3)]
    return torch.optim.SGD(
        [
            {"name": "cores", "params": layers[0].parameters(), "lr": 0.1},
            {"params": layers[1].parameters(), "lr": 0.2},
            {"params": layers[2].parameters(), "lr": 0.3},
        ]
    )


def _record(monkeypatch, window: StepWindow) -> dict:
    monkeypatch.setattr(records, "peak_memory_mib", lambda device: 42.5)
    objective = _Staged(nn.Linear(3, 2))  # 3 * 2 + 2 = 8 entries
    objective.initial_size = 16
    return train_record(
        window,
        step=7,
        epoch=1,
        objective=objective,
        optimizer=_optimizer(),
        device=torch.device("cpu"),
        nonfinite=3,
    )


def test_train_record_holds_the_window_means_rates_names_and_lrs(monkeypatch):
    """Means over applied steps, 1 / mean step time, the objective's name and record, lr per group (an
    unnamed group under its index), the peak memory and the non-finite count, as documented."""
    window = StepWindow()
    window.loss, window.objective, window.applied, window.steps, window.seconds = 3.0, 5.0, 2, 4, 2.0
    assert _record(monkeypatch, window) == {
        "kind": "train",
        "step": 7,
        "epoch": 1,
        "stage": "late",
        "objective_name": "toy",
        "loss": 1.5,
        "objective": 2.5,
        "size": 8,
        "ratio": 0.5,
        "ranks": {"0": [2, 1]},
        "lr": {"cores": 0.1, "1": 0.2, "2": 0.3},
        "step_time": 0.5,
        "steps_per_second": 2.0,
        "peak_memory_mib": 42.5,
        "nonfinite": 3,
    }


def test_train_record_of_an_empty_window_has_nan_means_and_rate(monkeypatch):
    """No step at all (step time 0) and none applied: loss, objective and steps per second are NaN."""
    record = _record(monkeypatch, StepWindow())
    assert record["step_time"] == 0.0
    assert all(math.isnan(record[key]) for key in ("loss", "objective", "steps_per_second"))


def test_train_record_of_a_window_of_slow_skipped_steps(monkeypatch):
    """Steps of 2 s each, none applied: NaN means, 0.5 steps per second."""
    window = StepWindow()
    window.steps, window.seconds = 3, 6.0
    record = _record(monkeypatch, window)
    assert math.isnan(record["loss"]) and math.isnan(record["objective"])
    assert (record["step_time"], record["steps_per_second"]) == (2.0, 0.5)
