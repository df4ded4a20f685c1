"""Runs that change their number of processes, and runs that lose one: 2 CPU processes on gloo (DDP).

The reference is one process training the tiny comera model on batches of ``2 B``; two processes on ``B``
each are the same optimisation up to rounding (``tests/train/test_distributed.py``). A run stopped after
step 8 (late stage, after the prune at the end of the early stage) resumes with the other number of processes,
both ways, and ends where the reference ends; a run whose rank 1 dies stops on rank 0 too, with
:class:`comera.train.parallel.RankLostError`, and resumes from its last checkpoint to the same end.
"""

import pytest
import torch.distributed as dist
from ranks import assert_same_end, checkpoint_steps, train, two_ranks

from comera.train.metrics import read_metrics
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

STOP_AT = 8


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("reference"))


def test_two_processes_stopped_in_the_late_stage_resume_in_one(tmp_path, reference):
    run_dir = tmp_path / "run"
    ranks = two_ranks(tmp_path, "first", run_dir=run_dir, callback=("stop", STOP_AT))
    assert [code for code, _ in ranks] == [0, 0]
    assert checkpoint_steps(run_dir)[-1] == STOP_AT
    assert_same_end(train(run_dir, resume=True), reference)


def test_one_process_stopped_in_the_late_stage_resumes_in_two(tmp_path, reference):
    run_dir = tmp_path / "run"
    assert train(run_dir, callback=("stop", STOP_AT)) is None
    assert checkpoint_steps(run_dir)[-1] == STOP_AT
    ranks = two_ranks(tmp_path, "second", run_dir=run_dir, resume=True)
    assert [code for code, _ in ranks] == [0, 0]
    assert_same_end(ranks[0][1]["result"], reference)
    assert_same_end(ranks[1][1]["result"], reference)
    resumes = [record for record in read_metrics(run_dir) if record.get("event") == "resume"]
    assert [record["processes"] for record in resumes] == [2], "the resume says it changed the process count"


def test_a_rank_that_dies_stops_every_rank_and_the_run_resumes(tmp_path, reference):
    run_dir = tmp_path / "run"
    ranks = two_ranks(tmp_path, "dies", run_dir=run_dir, callback=("die", 5, 1))
    (code0, saved0), (code1, saved1) = ranks
    assert code1 == 3 and saved1 is None
    assert code0 != 0
    assert saved0["error"].startswith("RankLostError: process 0 of 2 stopped: another process")
    assert f"newest checkpoint in {run_dir / 'checkpoints'}" in saved0["error"]
    assert checkpoint_steps(run_dir)[-1] == 4
    resumed = two_ranks(tmp_path, "resumed", run_dir=run_dir, resume=True)
    assert [code for code, _ in resumed] == [0, 0]
    assert_same_end(resumed[0][1]["result"], reference)


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
