"""Contracts of ``comera.train.parallel`` and ``comera.train.distributed`` checked in one process.

A real one-process gloo group stands in for the run's group; where the logic depends on several ranks
(averaging, gathering, rank 0's failure reaching the others), :func:`emulate` makes this process one rank of
several and fakes the collective calls with the values the other ranks would contribute.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import comera.train.parallel as parallel
from comera.train.distributed import gather_objects, globally_averaged
from comera.train.parallel import (
    RankError,
    all_true,
    environment_world_size,
    init_from_environment,
    lost_rank,
    on_rank_zero,
    per_process_batch,
    rank_seed,
    rank_zero_first,
    shutdown,
    training_device,
)


@pytest.fixture
def group():
    """A real one-process gloo group, destroyed afterwards (if the test did not)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def emulate(monkeypatch, rank, others):
    """Make this process rank ``rank`` of ``len(others)``; rank ``i`` contributes ``others[i]`` to collective
    calls (``others[rank]`` is unused). Returns the list of the collective calls this rank makes."""
    world_size = len(others)
    calls = []
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

    def all_gather_object(object_list, obj, group=None):
        assert len(object_list) == world_size
        calls.append(("all_gather_object", obj))
        for index in range(world_size):
            object_list[index] = obj if index == rank else others[index]

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(("all_reduce", op, tensor))
        parts = [
            tensor.detach().clone() if index == rank else torch.full_like(tensor, others[index])
            for index in range(world_size)
        ]
        if op == dist.ReduceOp.SUM:
            reduced = torch.stack(parts).sum(0)
        elif op == dist.ReduceOp.MIN:
            reduced = torch.stack(parts).amin(0)
        else:
            raise ValueError(f"unexpected reduce op {op!r}")
        tensor.copy_(reduced)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def record_cuda(monkeypatch):
    """Replace ``Tensor.cuda`` by a recorder that returns a CPU copy; returns the list of copies made."""
    moved = []

    def cuda(self, *args, **kwargs):
        copy = self.clone()
        moved.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "cuda", cuda)
    return moved


# comera.train.distributed


def test_globally_averaged_has_the_mean_value_over_ranks_and_the_local_gradient(group, monkeypatch):
    """globally_averaged: value is the mean of the ranks' losses, gradient is the local loss's."""
    emulate(monkeypatch, 0, [None, 5.0])
    weight = torch.tensor(0.5, requires_grad=True)
    loss = 2 * weight  # 1.0 here, 5.0 on the other rank: mean 3.0
    averaged = globally_averaged(loss)
    assert averaged.item() == pytest.approx(3.0)
    assert loss.item() == pytest.approx(1.0)
    averaged.backward()
    assert weight.grad.item() == pytest.approx(2.0)


def test_gather_objects_returns_every_ranks_value_in_rank_order(group, monkeypatch):
    """gather_objects: the value of every rank, this rank's own at its index."""
    calls = emulate(monkeypatch, 1, ["from 0", None, ("from", 2)])
    assert gather_objects({"mine": 1}) == ["from 0", {"mine": 1}, ("from", 2)]
    assert calls == [("all_gather_object", {"mine": 1})]


def test_gather_objects_in_a_real_one_rank_group(group, monkeypatch):
    """gather_objects: with the real gloo collective (forced on) it returns [value]."""
    monkeypatch.setattr("comera.train.distributed.is_distributed", lambda: True)
    assert gather_objects([3, "x"]) == [[3, "x"]]


# comera.train.parallel: all_true


@pytest.mark.parametrize(
    ("flag", "others", "expected"),
    [(True, [None, 1.0, 1.0], True), (True, [None, 1.0, 0.0], False), (False, [None, 1.0, 1.0], False)],
)
def test_all_true_is_true_only_when_every_rank_says_true(group, monkeypatch, flag, others, expected):
    """all_true: True exactly when the flag is True on every rank (1.0/0.0 are the other ranks' flags)."""
    calls = emulate(monkeypatch, 0, others)
    moved = record_cuda(monkeypatch)
    assert all_true(flag) is expected
    assert len(calls) == 1 and calls[0][1] == dist.ReduceOp.MIN
    assert moved == [], "a gloo group's flag must stay on the CPU"


@pytest.mark.parametrize("flag", [True, False])
def test_all_true_in_a_real_one_rank_group(group, monkeypatch, flag):
    """all_true: with the real gloo all_reduce (forced on) one rank's verdict is its own flag."""
    monkeypatch.setattr(parallel, "is_distributed", lambda: True)
    assert all_true(flag) is flag


def test_all_true_moves_the_flag_to_the_gpu_under_nccl(group, monkeypatch):
    """all_true: under nccl the reduced tensor is the CUDA copy of the flag."""
    calls = emulate(monkeypatch, 0, [None, 1.0])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    moved = record_cuda(monkeypatch)
    assert all_true(True) is True
    assert len(moved) == 1 and calls[0][2] is moved[0]


# on_rank_zero, rank_zero_first


def test_on_rank_zero_skips_the_job_and_returns_none_on_other_ranks(group, monkeypatch):
    """on_rank_zero: a rank other than 0 does not run the job and returns None after rank 0 succeeded."""
    calls = emulate(monkeypatch, 1, [None, None])
    ran = []
    assert on_rank_zero(lambda: ran.append(1) or "result") is None
    assert ran == [] and calls == [("all_gather_object", None)]


def test_on_rank_zero_raises_rank_zeros_failure_on_other_ranks(group, monkeypatch):
    """on_rank_zero: rank 0's failure is raised on rank 1 as RankError with rank 0's kind and message."""
    emulate(monkeypatch, 1, [("ValueError", "bad vocabulary"), None])
    ran = []
    with pytest.raises(RankError, match="^bad vocabulary$") as raised:
        on_rank_zero(lambda: ran.append(1))
    assert raised.value.kind == "ValueError" and ran == []


def test_on_rank_zero_sends_its_failure_to_the_other_ranks_before_raising(group, monkeypatch):
    """on_rank_zero: on rank 0 a failing job's kind and message reach the gather, then the error is raised."""
    calls = emulate(monkeypatch, 0, [None, None])
    with pytest.raises(KeyError, match="missing"):
        on_rank_zero(lambda: {}["missing"])
    assert calls == [("all_gather_object", ("KeyError", "'missing'"))]


def test_on_rank_zero_returns_the_result_on_rank_zero(group, monkeypatch):
    """on_rank_zero: rank 0 runs the job once and returns its result, telling the others it succeeded."""
    calls = emulate(monkeypatch, 0, [None, None])
    ran = []
    assert on_rank_zero(lambda: ran.append(1) or 42) == 42
    assert ran == [1] and calls == [("all_gather_object", None)]


def test_rank_zero_first_runs_the_job_once_in_a_single_process():
    """rank_zero_first: outside a process group the job runs exactly once and its result is returned."""
    ran = []
    assert rank_zero_first(lambda: ran.append(1) or "vocab") == "vocab"
    assert ran == [1]


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_zero_first_runs_the_job_once_on_every_rank(group, monkeypatch, rank):
    """rank_zero_first: each rank runs the job exactly once and gets its result."""
    emulate(monkeypatch, rank, [None, None])
    ran = []
    assert rank_zero_first(lambda: ran.append(1) or f"vocab {rank}") == f"vocab {rank}"
    assert ran == [1]


# lost_rank


def test_lost_rank_without_a_checkpoint_folder_says_the_run_starts_again():
    """lost_rank: names the process, the failed call's error and, without checkpoints, a fresh start."""
    error = lost_rank(RuntimeError("boom"), None)
    assert str(error) == (
        "process 0 of 1 stopped: another process of the run stopped or stopped answering "
        "(RuntimeError: boom); the run had no checkpoint folder, so it starts again from step 0"
    )


def test_lost_rank_names_this_rank_of_the_group(group, monkeypatch):
    """lost_rank: under a group of 3 the message names this rank and the world size."""
    emulate(monkeypatch, 2, [None, None, None])
    error = lost_rank(TimeoutError("timed out"), "ckpt")
    assert str(error).startswith("process 2 of 3 stopped:")
    assert "(TimeoutError: timed out)" in str(error) and "newest checkpoint in ckpt" in str(error)


# environment_world_size, init_from_environment, shutdown


def test_environment_world_size_reads_world_size(monkeypatch):
    """environment_world_size: WORLD_SIZE as an int, 1 when unset."""
    monkeypatch.delenv("world_size", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert environment_world_size() == 4
    monkeypatch.delenv("WORLD_SIZE")
    assert environment_world_size() == 1


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_environment_world_size_rejects_what_is_not_a_positive_integer(monkeypatch, value):
    """environment_world_size: a ValueError naming WORLD_SIZE and the value for a non-positive-integer."""
    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"WORLD_SIZE must be a positive integer, got '{value}'"):
        environment_world_size()


@pytest.fixture
def fake_init(monkeypatch):
    """Record init_process_group and cuda.set_device calls instead of making them; the default device is
    the CPU."""
    calls = {"init": [], "set_device": []}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls["init"].append((a, k)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls["set_device"].append(device))
    monkeypatch.setattr(parallel, "environment_device", lambda: torch.device("cpu"))
    monkeypatch.delenv("COMERA_DIST_TIMEOUT", raising=False)
    monkeypatch.delenv("comera_dist_timeout", raising=False)
    return calls


def test_init_from_environment_creates_a_gloo_group_on_the_cpu(monkeypatch, fake_init):
    """init_from_environment: WORLD_SIZE=2 on the CPU creates a gloo group with the 600 s default timeout."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert init_from_environment() is True
    assert fake_init["init"] == [(("gloo",), {"timeout": timedelta(seconds=600)})]
    assert fake_init["set_device"] == []


def test_init_from_environment_selects_the_gpu_and_nccl_with_the_timeout_setting(monkeypatch, fake_init):
    """init_from_environment: on CUDA the GPU is selected first, nccl, COMERA_DIST_TIMEOUT is the timeout."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("COMERA_DIST_TIMEOUT", "12.5")
    assert init_from_environment("cuda:1") is True
    assert fake_init["set_device"] == [torch.device("cuda", 1)]
    assert fake_init["init"] == [(("nccl",), {"timeout": timedelta(seconds=12.5)})]


@pytest.mark.parametrize("world_size", [None, "1"])
def test_init_from_environment_does_nothing_outside_torchrun(monkeypatch, fake_init, world_size):
    """init_from_environment: without WORLD_SIZE (or with 1) it creates nothing and returns False."""
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    assert init_from_environment() is False
    assert fake_init == {"init": [], "set_device": []}


def test_init_from_environment_leaves_an_existing_group(group, monkeypatch, fake_init):
    """init_from_environment: with a process group already there it creates none and returns False."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert init_from_environment() is False
    assert fake_init == {"init": [], "set_device": []}


@pytest.mark.parametrize(("kwargs", "barriers"), [({}, 1), ({"wait": True}, 1), ({"wait": False}, 0)])
def test_shutdown_meets_at_a_barrier_by_default_and_destroys_the_group(group, monkeypatch, kwargs, barriers):
    """shutdown: a barrier first unless wait=False (the default waits), then no process group is left."""
    met = []
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: met.append(1))
    shutdown(**kwargs)
    assert len(met) == barriers
    assert not dist.is_initialized()


# per_process_batch, rank_seed


@pytest.mark.parametrize(
    ("batch_size", "world_size", "lower", "upper"), [(10, 4, 8, 12), (7, 2, 6, 8), (3, 4, 0, 4)]
)
def test_per_process_batch_error_suggests_the_nearest_multiples(batch_size, world_size, lower, upper):
    """per_process_batch: the error names train.batch_size and the multiples just below and above it."""
    with pytest.raises(ValueError, match=rf"choose e\.g\. train\.batch_size={lower} or {upper}$"):
        per_process_batch(batch_size, world_size)


def test_rank_seed_values_are_pinned_and_fit_a_signed_64_bit_seed():
    """rank_seed: rank r's seed is seed + r * 1_000_033, wrapped below 2**63 - 1 (a non-negative int64)."""
    assert rank_seed(5, 0) == 5
    assert rank_seed(5, 1) == 1_000_038
    assert rank_seed(7, 3) == 3_000_106
    assert rank_seed(2**63 - 2, 1) == 1_000_032
    assert rank_seed(2**63 - 1_000_035, 1) == 2**63 - 2
    assert rank_seed(2**63 - 1_000_034, 1) == 0
    big = [rank_seed(2**63 - 2 - offset, rank) for offset in range(3) for rank in range(4)]
    assert all(0 <= seed < 2**63 - 1 for seed in big)


# training_device (CUDA faked: 2 GPUs, the current one is GPU 1)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("local_rank", raising=False)


@pytest.mark.parametrize(
    ("name", "local_rank", "expected"),
    [("cuda:1", "0", 1), ("cuda:0", None, 0), ("cuda:0", "1", 0), ("cuda", "0", 0), ("cuda", None, 1)],
)
def test_training_device_picks_the_named_gpu_else_local_rank_else_the_current(
    two_gpus, monkeypatch, name, local_rank, expected
):
    """training_device: cuda:N is GPU N; plain cuda is GPU LOCAL_RANK, else the current GPU."""
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    device = training_device(name)
    assert device == torch.device("cuda", expected) and device.index == expected


@pytest.mark.parametrize(("name", "local_rank", "index"), [("cuda:2", None, 2), ("cuda", "5", 5)])
def test_training_device_rejects_a_gpu_the_machine_lacks(two_gpus, monkeypatch, name, local_rank, index):
    """training_device: a GPU index not below the count raises ValueError naming the setting and the range."""
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    message = rf"train\.device='{name}': GPU {index} does not exist; this machine has 2 \(indices 0 to 1\)"
    with pytest.raises(ValueError, match=f"^{message}$"):
        training_device(name)


@pytest.mark.parametrize("seed, rank", [(2**32, 0), (2**32 - 1, 1), (2**40 + 5, 4300)])
def test_every_seed_the_config_accepts_seeds_numpy_on_every_rank(seed, rank):
    """``TrainConfig`` takes any seed >= 0 and ranks add to it; NumPy's legacy seed takes ``[0, 2**32)``:
    seed_process seeds NumPy with the rank's seed modulo ``2**32`` instead of failing (rank 1 of a run whose
    rank 0 works included)."""
    import numpy as np

    parallel.seed_process(seed, rank)
    drawn = np.random.random_sample(3)
    np.random.seed(parallel.rank_seed(seed, rank) % 2**32)
    assert np.array_equal(drawn, np.random.random_sample(3))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_process_that_asked_to_stop_with_its_parent_stops_when_the_parent_is_killed():
    """A grandchild in a session of its own (as torchrun starts its processes) that called stop_with_parent
    stops when its parent is killed with SIGKILL; one that did not call it keeps running."""
    import signal
    import subprocess
    import time

    def running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state != "Z"

    pids = {}
    for asks in (True, False):
        child = (
            "from comera.process import stop_with_parent; stop_with_parent(); " if asks else ""
        ) + "import time; print('ready', flush=True); time.sleep(60)"
        parent = (
            "import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(60)"
        )
        launcher = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
        pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "ready"  # the grandchild writes to the same pipe
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        pids[asks] = pid
    deadline = time.monotonic() + 10
    while running(pids[True]) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not running(pids[True])
        assert running(pids[False])
    finally:
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)
