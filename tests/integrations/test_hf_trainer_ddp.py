"""``CoMERATrainer`` under ``torchrun`` on the CPU (gloo): two processes with batches of 2 (on the model's own
loss, and on the chunked loss) train the tiny LLaMA as one process with batches of 4 (``hf_ddp_run.py``): the
same events (the late stage, the trim, a prune after which DDP's wrapper is rebuilt for the new shapes), the
same losses and the same weights, to float rounding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

import hf_ddp_run  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import comera  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = 300


def torchrun(output_dir: Path, batch: int, *extra: str) -> subprocess.CompletedProcess:
    """``hf_ddp_run.py`` in two processes, importing the comera this test imports."""
    source = Path(comera.__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(source), str(HERE)])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(HERE / "hf_ddp_run.py"), str(output_dir), str(batch), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env)


@pytest.mark.parametrize("chunked", [False, True], ids=["own-loss", "chunked-loss"])
def test_two_processes_with_half_the_batch_train_as_one(tmp_path, chunked):
    """With ``chunked``, the two processes train on the chunked loss of 5 tokens
    (``CoMERATrainer(loss_chunk_size=5)``: the loss computed inside DDP's forward, before and after the prune
    rebuilt DDP's wrapper) and the one process on the model's own loss."""
    (tmp_path / "two").mkdir()
    launched = torchrun(tmp_path / "two", 2, *(["5"] if chunked else []))
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = hf_ddp_run.train(str(tmp_path / "one"), 4)
    hf_ddp_run.write(one, str(tmp_path / "one"))
    two = json.loads((tmp_path / "two" / "run.json").read_text())
    reference = json.loads((tmp_path / "one" / "run.json").read_text())
    assert (two["processes"], reference["processes"]) == (2, 1)
    steps_and_names = [(event["step"], event["event"]) for event in reference["events"]]
    assert [(event["step"], event["event"]) for event in two["events"]] == steps_and_names
    assert (12, "prune") in steps_and_names and two["logs"][-1]["step"] == 16  # 4 steps after the prune
    for key in ("loss", "comera_task_loss", "comera_size"):
        assert [r[key] for r in two["logs"]] == pytest.approx([r[key] for r in reference["logs"]], rel=1e-5)
    ours, theirs = (
        load_file(tmp_path / "two" / "weights.safetensors"),
        load_file(tmp_path / "one" / "weights.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-4, msg=name)
