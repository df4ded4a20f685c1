"""A CoMERATrainer run of the tiny LLaMA that ``test_hf_trainer_ddp.py`` launches under ``torchrun`` (and runs
in one process for the reference): ``python hf_ddp_run.py OUTPUT_DIR PER_PROCESS_BATCH [LOSS_CHUNK_SIZE]``
(the last: ``CoMERATrainer(loss_chunk_size=...)``, the chunked loss).

16 sequences read in order (``train_sampling_strategy="sequential"``, so that two processes with batches of
``B`` see together what one process sees with ``2B``), 16 steps: early 8, late 8; the trim comes by step 12
and the ``late_epoch`` prune at step 12, and 4 more steps train the pruned model. Process 0 writes
``run.json`` (the events and the logged training records) and ``weights.safetensors`` into ``OUTPUT_DIR``.
"""

import json
import sys
from pathlib import Path

import torch
from hf_tiny import RepeatingTokens, arguments, tiny_llama
from safetensors.torch import save_file

from comera.integrations.hf_trainer import CoMERATrainer
from comera.methods.comera import CoMERASettings

SETTINGS = CoMERASettings(lr_cores=1e-2, lr_gates=1e-2, recovery=0.6)
STEPS, EARLY, SEQUENCES = 16, 8, 16


def train(output_dir: str, batch: int, loss_chunk_size: int | None = None) -> CoMERATrainer:
    """The run with ``batch`` sequences per process and step, on the chunked loss with ``loss_chunk_size``."""
    args = arguments(
        output_dir, max_steps=STEPS, per_device_train_batch_size=batch, train_sampling_strategy="sequential"
    )
    trainer = CoMERATrainer(
        tiny_llama(),
        args,
        train_dataset=RepeatingTokens(size=SEQUENCES),
        settings=SETTINGS,
        early=EARLY,
        loss_chunk_size=loss_chunk_size,
    )
    trainer.train()
    return trainer


def write(trainer: CoMERATrainer, output_dir: str) -> None:
    """``run.json`` and ``weights.safetensors`` (process 0 only)."""
    if trainer.args.process_index != 0:
        return
    folder = Path(output_dir)
    logs = [record for record in trainer.state.log_history if "comera_task_loss" in record]
    record = {"events": trainer.comera_callback.events, "logs": logs, "processes": trainer.args.world_size}
    (folder / "run.json").write_text(json.dumps(record))
    weights = {name: value.detach().contiguous() for name, value in trainer.model.state_dict().items()}
    save_file(weights, str(folder / "weights.safetensors"))


if __name__ == "__main__":
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else None
    write(train(sys.argv[1], int(sys.argv[2]), chunk), sys.argv[1])
    if torch.distributed.is_initialized():
        # gloo's threads can abort a process that exits with its group alive ("terminate called without an
        # active exception"): the group is closed first, as torch's own examples do
        torch.distributed.destroy_process_group()
