"""Runs that change their number of processes, and runs that lose one: 2 CPU processes on gloo.

The reference is one process training the tiny comera model (early stage, prune at its end, late stage) on
batches of ``2 B``; two processes on batches of ``B`` each are the same optimisation up to rounding
(``tests/train/test_distributed.py`` checks that). Here a run stopped after step 8 (in the late stage, after
the prune) is resumed with the other number of processes, both ways, and must end where the reference ends;
and a run whose rank 1 dies stops on rank 0 too, with :class:`comera.train.parallel.RankLostError`, and
resumes from its last checkpoint to the same end.
"""

import multiprocessing
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tiny import loss_fn, make_data, make_model

from comera.train import TrainConfig, Trainer
from comera.train.checkpoint import list_checkpoints
from comera.train.parallel import (
    RankError,
    RankLostError,
    all_true,
    lost_rank,
    on_rank_zero,
    peer_failure,
    per_process_batch,
    rank_seed,
)

WORLD = 2
GLOBAL_BATCH = 8
STOP_AT = 8
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


class Stop(Exception):
    """Raised by a callback to end a run after a step (as a killed job would)."""


def stop_at(step):
    def callback(trainer):
        if trainer.step == step:
            raise Stop(step)

    return callback


def die_at(step, rank):
    def callback(trainer):
        if trainer.step == step and trainer.process_rank == rank:
            os._exit(3)

    return callback


def train(run_dir, world_size, resume=False, callback=None):
    """The tiny run in this process (one rank of ``world_size``); the final state, or None if stopped."""
    config = TrainConfig(
        early=1,
        late=1,
        batch_size=GLOBAL_BATCH // world_size,
        checkpoint_every=4,
        log_every=2,
        run_dir=str(run_dir),
        plot=False,
        progress=False,
    )
    trainer = Trainer(
        make_model(dropout=0.0, dead_gate=True),
        loss_fn,
        make_data(),
        config=config,
        callbacks=[] if callback is None else [callback],
    )
    try:
        trainer.fit(resume=resume)
    except Stop:
        return None
    return {name: value.clone() for name, value in trainer.module.state_dict().items()}


CALLBACKS = {"stop": stop_at, "die": die_at}


def rank_main(rank, init_file, run_dir, resume, callback, out_file):
    """One rank: join the group, train, save the final state or the error text. ``callback``: None or
    ``(name in CALLBACKS, *arguments)`` (closures do not reach a spawned process)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    try:
        made = None if callback is None else CALLBACKS[callback[0]](*callback[1:])
        state = train(run_dir, WORLD, resume, made)
        torch.save({"state": state, "error": None}, f"{out_file}.{rank}")
    except Exception as error:
        torch.save({"state": None, "error": f"{type(error).__name__}: {error}"}, f"{out_file}.{rank}")
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def two_ranks(tmp_path, name, run_dir, resume=False, callback=None):
    """Run :func:`rank_main` in 2 fresh processes; ``[(exit code, saved dict or None)]`` per rank."""
    context = multiprocessing.get_context("spawn")
    out_file = tmp_path / name
    args = (str(tmp_path / f"{name}.init"), run_dir, resume, callback, out_file)
    processes = [context.Process(target=rank_main, args=(rank, *args)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
            pytest.fail(f"{name}: a rank did not stop within 120 s")
    saved = [
        torch.load(f"{out_file}.{rank}", weights_only=True) if os.path.exists(f"{out_file}.{rank}") else None
        for rank in range(WORLD)
    ]
    return [(process.exitcode, result) for process, result in zip(processes, saved, strict=True)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("reference"), 1)


def assert_same_end(state, reference):
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        assert state[name].shape == value.shape, name
        torch.testing.assert_close(state[name], value, **TOLERANCE, msg=name)


def stopped_checkpoints(run_dir):
    return [step for step, _ in list_checkpoints(run_dir / "checkpoints")]


def test_two_processes_stopped_in_the_late_stage_resume_in_one(tmp_path, reference):
    run_dir = tmp_path / "run"
    ranks = two_ranks(tmp_path, "first", run_dir, callback=("stop", STOP_AT))
    assert [code for code, _ in ranks] == [0, 0]
    assert stopped_checkpoints(run_dir)[-1] == STOP_AT
    assert_same_end(train(run_dir, 1, resume=True), reference)


def test_one_process_stopped_in_the_late_stage_resumes_in_two(tmp_path, reference):
    run_dir = tmp_path / "run"
    assert train(run_dir, 1, callback=stop_at(STOP_AT)) is None
    assert stopped_checkpoints(run_dir)[-1] == STOP_AT
    ranks = two_ranks(tmp_path, "second", run_dir, resume=True)
    assert [code for code, _ in ranks] == [0, 0]
    assert_same_end(ranks[0][1]["state"], reference)
    assert_same_end(ranks[1][1]["state"], reference)


def test_a_rank_that_dies_stops_every_rank_and_the_run_resumes(tmp_path, reference):
    run_dir = tmp_path / "run"
    ranks = two_ranks(tmp_path, "dies", run_dir, callback=("die", 5, 1))
    (code0, saved0), (code1, saved1) = ranks
    assert code1 == 3 and saved1 is None
    assert code0 != 0
    assert saved0["error"].startswith("RankLostError: process 0 of 2 stopped: another process")
    assert f"newest checkpoint in {run_dir / 'checkpoints'}" in saved0["error"]
    assert stopped_checkpoints(run_dir)[-1] == 4
    resumed = two_ranks(tmp_path, "resumed", run_dir, resume=True)
    assert [code for code, _ in resumed] == [0, 0]
    assert_same_end(resumed[0][1]["state"], reference)


def test_helpers_outside_a_process_group():
    assert per_process_batch(32, 4) == 8 and per_process_batch(7, 1) == 7
    with pytest.raises(ValueError, match=r"train.batch_size=10 .* multiple of the number of processes \(4\)"):
        per_process_batch(10, 4)
    assert rank_seed(5, 0) == 5 and len({rank_seed(5, rank) for rank in range(8)}) == 8
    assert all_true(True) and not all_true(False)
    assert on_rank_zero(lambda: 7) == 7
    with pytest.raises(KeyError):
        on_rank_zero(lambda: {}["missing"])
    assert issubclass(RankError, RuntimeError)


def test_which_errors_mean_a_lost_rank():
    gloo = RuntimeError(
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:45702: Connection reset by peer"
    )
    assert peer_failure(gloo) and peer_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert not peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_failure(ValueError("Connection reset by peer"))
    error = lost_rank(gloo, "runs/x/checkpoints")
    assert isinstance(error, RankLostError)
    assert str(error).startswith("process 0 of 1 stopped: another process of the run stopped")
    assert str(error).endswith(
        "continue it from the newest checkpoint in runs/x/checkpoints (fit(resume=True), --resume)"
    )
