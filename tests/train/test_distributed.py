"""DDP on 2 processes: ranks agree on every parameter, gate, rank, target and evaluation, and the result
matches one process training on the combined batches; checkpoints and metrics are written once.

The CPU run (gloo) runs everywhere; the same run on 2 GPUs (nccl) is skipped with fewer than 2 CUDA devices
and has not been run yet.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import accuracy_fn, loss_fn, make_data, make_model

from comera.train import TrainConfig, Trainer, read_metrics
from comera.train.checkpoint import list_checkpoints
from comera.train.distributed import backend_for, check_backend
from comera.train.parallel import shutdown

WORLD = 2
PER_RANK_BATCH = 4


def config(run_dir, batch_size):
    return TrainConfig(
        early=1,
        late=1,
        batch_size=batch_size,
        checkpoint_every=4,
        log_every=2,
        run_dir=str(run_dir),
        plot=False,
    )


def device_loss(model, batch):
    """:func:`tiny.loss_fn` with the batch moved to the model's device."""
    device = next(model.parameters()).device
    return loss_fn(model, [tensor.to(device) for tensor in batch])


def device_accuracy(model, batch):
    """:func:`tiny.accuracy_fn` with the batch moved to the model's device."""
    device = next(model.parameters()).device
    return accuracy_fn(model, [tensor.to(device) for tensor in batch])


def make_trainer(device, run_dir, batch_size):
    return Trainer(
        make_model(dropout=0.0, dead_gate=True).to(device),
        device_loss,
        make_data(),
        eval_data=make_data(16, 3),
        eval_fn=device_accuracy,
        config=config(run_dir, batch_size),
    )


def summary(trainer, result):
    return {
        "state": {name: value.cpu() for name, value in trainer.module.state_dict().items()},
        "ranks": [layer.ranks for layer in (trainer.module[0], trainer.module[3])],
        "max_ranks": [layer.max_ranks for layer in (trainer.module[0], trainer.module[3])],
        "targets": (trainer.objective.adaptation.target_size, trainer.objective.adaptation.target_loss),
        "eval": result.eval,
    }


def worker(rank, init_file, run_dir, cuda):
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    finished = False
    try:
        train_and_save(rank, device, run_dir)
        finished = True
    finally:
        shutdown(wait=finished)


def train_and_save(rank, device, run_dir):
    trainer = make_trainer(device, run_dir / "ddp", PER_RANK_BATCH)
    result = trainer.fit()
    torch.save(summary(trainer, result), run_dir / f"rank{rank}.pt")


def two_ranks_agree_and_match_a_single_process(tmp_path, cuda, state_tol, eval_tol):
    mp.spawn(worker, args=(str(tmp_path / "init"), tmp_path, cuda), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    first, second = ranks
    assert first["ranks"] == second["ranks"] and first["max_ranks"] == second["max_ranks"]
    assert first["targets"] == second["targets"] and first["eval"] == second["eval"]
    for name, value in first["state"].items():
        assert torch.equal(value, second["state"][name]), name

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    trainer = make_trainer(device, tmp_path / "single", PER_RANK_BATCH * WORLD)
    single = summary(trainer, trainer.fit())
    assert first["max_ranks"] == single["max_ranks"] != [make_model()[0].max_ranks, make_model()[3].max_ranks]
    for name, value in single["state"].items():
        torch.testing.assert_close(
            first["state"][name], value, rtol=state_tol[0], atol=state_tol[1], msg=name
        )
    assert first["targets"][0] == single["targets"][0]
    torch.testing.assert_close(first["targets"][1], single["targets"][1], rtol=1e-5, atol=0)
    assert first["eval"].keys() == single["eval"].keys()
    for name in single["eval"]:
        torch.testing.assert_close(
            first["eval"][name], single["eval"][name], rtol=eval_tol[0], atol=eval_tol[1]
        )

    steps = [record["step"] for record in read_metrics(tmp_path / "ddp") if record["kind"] == "train"]
    assert steps == [2, 4, 6, 8, 10, 12], "metrics written by more than one rank"
    saved = [step for step, _ in list_checkpoints(tmp_path / "ddp" / "checkpoints")]
    assert saved == [8, 12]


def test_two_cpu_ranks_with_gloo_agree_and_match_a_single_process(tmp_path):
    two_ranks_agree_and_match_a_single_process(tmp_path, False, state_tol=(1e-4, 1e-6), eval_tol=(1e-5, 1e-6))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the nccl run needs 2 CUDA devices")
def test_two_gpu_ranks_with_nccl_agree_and_match_a_single_process(tmp_path):
    two_ranks_agree_and_match_a_single_process(tmp_path, True, state_tol=(1e-4, 1e-5), eval_tol=(1e-4, 1e-5))


def test_backend_follows_the_device():
    assert backend_for("cpu") == "gloo" and backend_for(torch.device("cuda", 1)) == "nccl"
    check_backend(torch.device("cpu"), "gloo")
    check_backend(torch.device("cuda", 0), "cpu:gloo,cuda:nccl")
    with pytest.raises(ValueError, match="backend 'nccl', but the model is on cpu, which needs 'gloo'"):
        check_backend(torch.device("cpu"), "nccl")
    with pytest.warns(UserWarning, match="which needs 'nccl'.*gloo works on CUDA tensors, but slowly"):
        check_backend(torch.device("cuda", 0), "gloo")
    with pytest.raises(ValueError, match="backend 'mpi', but the model is on cuda:0, which needs 'nccl'"):
        check_backend(torch.device("cuda", 0), "mpi")
