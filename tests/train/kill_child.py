"""Child process of the SIGKILL test: trains the tiny model, optionally pausing forever after a step.

Usage: ``python kill_child.py RUN_DIR PAUSE_AFTER_STEP`` (0 = never pause). It resumes from the latest
checkpoint in ``RUN_DIR`` when there is one, and prints ``PAUSED <step>`` before pausing.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import loss_fn, make_data, make_model, run_settings  # noqa: E402

from comera.methods.comera import CoMERAObjective  # noqa: E402
from comera.train import Trainer  # noqa: E402

KILL_CONFIG = {
    "early": 2,
    "late": 2,
    "batch_size": 8,
    "checkpoint_every": 5,
    "keep_checkpoints": 3,
    "log_every": 1,
    "gamma": 1.0,
    "lr_gates": 0.2,
    "lr_cores": 1e-3,
    "lr_other": 1e-3,
    "plot": False,
    "progress": False,
}


def kill_trainer(run_dir: str, callbacks=()) -> Trainer:
    """The Trainer of the killed and the uninterrupted runs (a fresh model with a dead gate)."""
    config, settings = run_settings(run_dir=run_dir, **KILL_CONFIG)
    model = make_model(dead_gate=True)
    objective = CoMERAObjective(model, settings)
    return Trainer(model, loss_fn, make_data(), config=config, objective=objective, callbacks=callbacks)


def pause_after(step: int):
    def callback(trainer: Trainer) -> None:
        if trainer.step == step:
            print(f"PAUSED {step}", flush=True)
            time.sleep(600)

    return callback


def main() -> None:
    run_dir, pause = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    callbacks = [pause_after(pause)] if pause else []
    kill_trainer(run_dir, callbacks).fit(resume=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
