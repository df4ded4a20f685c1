"""DDP on 2 CPU processes (gloo): ranks agree on every parameter, gate, rank, target and evaluation, and the
result matches one process training on the combined batches; checkpoints and metrics are written once."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import accuracy_fn, loss_fn, make_data, make_model

from comera.train import TrainConfig, Trainer, read_metrics
from comera.train.checkpoint import list_checkpoints

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


def summary(trainer, result):
    return {
        "state": trainer.module.state_dict(),
        "ranks": [layer.ranks for layer in (trainer.module[0], trainer.module[3])],
        "max_ranks": [layer.max_ranks for layer in (trainer.module[0], trainer.module[3])],
        "targets": (trainer.rank.target_size, trainer.rank.target_loss),
        "eval": result.eval,
    }


def worker(rank, init_file, run_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        trainer = Trainer(
            make_model(dropout=0.0, dead_gate=True),
            loss_fn,
            make_data(),
            eval_data=make_data(16, 3),
            eval_fn=accuracy_fn,
            config=config(run_dir / "ddp", PER_RANK_BATCH),
        )
        result = trainer.fit()
        torch.save(summary(trainer, result), run_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_and_match_a_single_process(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "init"), tmp_path), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    first, second = ranks
    assert first["ranks"] == second["ranks"] and first["max_ranks"] == second["max_ranks"]
    assert first["targets"] == second["targets"] and first["eval"] == second["eval"]
    for name, value in first["state"].items():
        assert torch.equal(value, second["state"][name]), name

    trainer = Trainer(
        make_model(dropout=0.0, dead_gate=True),
        loss_fn,
        make_data(),
        eval_data=make_data(16, 3),
        eval_fn=accuracy_fn,
        config=config(tmp_path / "single", PER_RANK_BATCH * WORLD),
    )
    single = summary(trainer, trainer.fit())
    assert first["max_ranks"] == single["max_ranks"] != [make_model()[0].max_ranks, make_model()[3].max_ranks]
    for name, value in single["state"].items():
        torch.testing.assert_close(first["state"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert first["targets"][0] == single["targets"][0]
    torch.testing.assert_close(first["targets"][1], single["targets"][1], rtol=1e-5, atol=0)
    assert first["eval"].keys() == single["eval"].keys()
    for name in single["eval"]:
        torch.testing.assert_close(first["eval"][name], single["eval"][name], rtol=1e-5, atol=1e-6)

    steps = [record["step"] for record in read_metrics(tmp_path / "ddp") if record["kind"] == "train"]
    assert steps == [2, 4, 6, 8, 10, 12], "metrics written by more than one rank"
    saved = [step for step, _ in list_checkpoints(tmp_path / "ddp" / "checkpoints")]
    assert saved == [8, 12]
