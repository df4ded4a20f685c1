"""Helpers of the multi-process tests: the tiny comera run (early stage, prune at its end, late stage) in one
process on batches of ``GLOBAL_BATCH``, or in 2 fresh processes on gloo with half of it each, DDP or FSDP."""

from __future__ import annotations

import multiprocessing
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tiny import loss_fn, make_data, make_model

from comera import save_pretrained
from comera.methods.comera.structure import apply_structure
from comera.train import TrainConfig, Trainer
from comera.train.checkpoint import list_checkpoints
from comera.train.fsdp import is_sharded, whole_copy
from comera.train.parallel import shutdown

WORLD = 2
GLOBAL_BATCH = 8
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}
"""Two processes and one agree to rounding: the loss of 2 B examples is summed in another order."""


class Stop(Exception):
    """Raised by a callback to end a run after a step (as a killed job would)."""


def stop_at(step):
    """A callback that ends the run after ``step`` (its checkpoint, if due, is written first)."""

    def callback(trainer):
        if trainer.step == step:
            raise Stop(step)

    return callback


def die_at(step, rank):
    """A callback that kills process ``rank`` after ``step``."""

    def callback(trainer):
        if trainer.step == step and trainer.process_rank == rank:
            os._exit(3)

    return callback


CALLBACKS = {"stop": stop_at, "die": die_at}


def build():
    """The tiny model every run starts from."""
    return make_model(dropout=0.0, dead_gate=True)


def train(run_dir, world_size=1, resume=False, callback=None, parallel="ddp", save_to=None, **settings):
    """The tiny run in this process (one rank of ``world_size``): the final state dict, or None if stopped.

    ``callback``: None or ``(name in CALLBACKS, *arguments)`` (closures do not reach a spawned process).
    ``save_to``: a folder for ``comera.save_pretrained`` of the trained model (by rank 0).
    ``settings``: ``TrainConfig`` fields, and ``eval_samples``. With the default 20 evaluation examples
    every rank evaluates as many batches, and the mean over batches equals one process's (batches of 8, 8,
    4 against 4, 4, 2 on each rank).
    """
    eval_samples = settings.pop("eval_samples", 20)
    inspect = settings.pop("inspect", None)
    defaults = {"early": 1, "late": 1, "checkpoint_every": 4, "log_every": 2}
    config = TrainConfig(
        **{**defaults, **settings},
        batch_size=GLOBAL_BATCH // world_size,
        run_dir=str(run_dir),
        plot=False,
        progress=False,
        parallel=parallel,
    )
    made = [] if callback is None else [CALLBACKS[callback[0]](*callback[1:])]
    trainer = Trainer(
        build(),
        loss_fn,
        make_data(),
        eval_data=make_data(eval_samples, 3),
        config=config,
        callbacks=made,
    )
    try:
        trainer.fit(resume=resume)
    except Stop:
        return None
    if save_to is not None:
        structure = trainer.objective.structure()

        def rebuilt():
            fresh = build()
            apply_structure(fresh, structure)
            return fresh

        whole = whole_copy(trainer.module, rebuilt) if is_sharded(trainer.module) else trainer.module
        if trainer.process_rank == 0:
            save_pretrained(whole, save_to)
    state = trainer.state_dict()  # whole on rank 0 under FSDP too
    result = {"state": state["model"], "eval": dict(trainer.last_eval), "ranks": state["structure"]}
    if inspect == "sharded_cores":
        result["inspected"] = sharding_of(trainer)
    return result


def sharding_of(trainer) -> dict[str, bool]:
    """Whether the trained model's TT cores are sharded (DTensor), its gates whole, and the run pruned."""
    from torch.distributed.tensor import DTensor

    layer = trainer.module[0]
    return {
        "cores_sharded": all(isinstance(core, DTensor) for core in layer.cores),
        "gates_whole": not any(isinstance(gate, DTensor) for gate in layer.gates),
        "pruned": tuple(core.shape[-1] for core in layer.cores[:-1]) != (4,) * (len(layer.cores) - 1),
    }


def rank_main(rank, init_file, out_file, kwargs):
    """One rank: join the group, run :func:`train`, save its result or the error text."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    finished = False
    try:
        result = train(world_size=WORLD, **kwargs)
        torch.save({"result": result, "error": None}, f"{out_file}.{rank}")
        finished = True
    except Exception as error:
        torch.save({"result": None, "error": f"{type(error).__name__}: {error}"}, f"{out_file}.{rank}")
        traceback.print_exc()
        raise
    finally:
        shutdown(wait=finished)


def two_ranks(tmp_path, name, **kwargs):
    """:func:`train` in 2 fresh processes; ``[(exit code, {"result", "error"} or None)]`` per rank."""
    context = multiprocessing.get_context("spawn")
    out_file = tmp_path / name
    args = (str(tmp_path / f"{name}.init"), out_file, kwargs)
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


def assert_same_end(result, reference):
    """Same ranks, parameters to :data:`TOLERANCE` and evaluation to 1e-5 as the reference run."""
    assert result["ranks"] == reference["ranks"]
    state, expected = result["state"], reference["state"]
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].shape == value.shape, name
        torch.testing.assert_close(state[name], value, **TOLERANCE, msg=name)
    assert result["eval"].keys() == reference["eval"].keys()
    for name, value in reference["eval"].items():
        assert result["eval"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def checkpoint_steps(run_dir):
    """Steps of the checkpoints in ``run_dir``."""
    return [step for step, _ in list_checkpoints(run_dir / "checkpoints")]
