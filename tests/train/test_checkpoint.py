"""Checkpoints: atomic, weights_only-loadable; a run killed by SIGKILL resumes to identical parameters."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kill_child import kill_trainer
from tiny import loss_fn, make_data, make_model

from comera.atomic import remove_stale_temporaries
from comera.train import TrainConfig, Trainer, latest_checkpoint, load_checkpoint, read_metrics
from comera.train.checkpoint import (
    capture_rng,
    checkpoint_path,
    list_checkpoints,
    remove_checkpoint,
    restore_rng,
    save_checkpoint,
)

CHILD = Path(__file__).with_name("kill_child.py")


def run_child(run_dir: Path, pause: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(run_dir), str(pause)], stdout=subprocess.PIPE, text=True, env=env
    )


def test_sigkill_mid_run_then_resume_gives_identical_parameters(tmp_path):
    child = run_child(tmp_path / "killed", pause=14)
    try:
        line = child.stdout.readline()
        assert line.strip() == "PAUSED 14", f"child did not reach step 14: {line!r}"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    checkpoints = [step for step, _ in list_checkpoints(tmp_path / "killed" / "checkpoints")]
    assert checkpoints[-1] == 12, checkpoints  # forced by the prune at the end of the early stage
    resumed_trainer = kill_trainer(str(tmp_path / "killed"))
    assert resumed_trainer.fit(resume=True).step == 24
    resumed = resumed_trainer.module

    whole = kill_trainer(str(tmp_path / "whole"))
    whole.fit()
    model = whole.module
    final = load_checkpoint(latest_checkpoint(tmp_path / "killed" / "checkpoints"))
    assert final["progress"]["step"] == 24
    expected = model.state_dict()
    assert final["model"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(final["model"][name], value), name
        assert torch.equal(resumed.state_dict()[name], value), name
    steps = [r["step"] for r in read_metrics(tmp_path / "killed") if r["kind"] == "train"]
    assert steps == list(range(1, 25)), "metrics of the lost steps 13-14 must be replaced, not duplicated"
    events = [r["event"] for r in read_metrics(tmp_path / "killed") if r["kind"] == "event"]
    assert "resume" in events and "prune" in events


def test_checkpoint_holds_everything_and_loads_weights_only(tmp_path):
    config = TrainConfig(
        early=1, batch_size=8, checkpoint_every=2, keep_checkpoints=2, run_dir=str(tmp_path), plot=False
    )
    trainer = Trainer(make_model(), loss_fn, make_data(), config=config)
    trainer.fit()
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000004.pt", "step-00000006.pt"]
    payload = torch.load(directory / "step-00000006.pt", weights_only=True)
    assert set(payload) >= {"model", "optimizer", "objective", "progress", "rng", "structure", "config"}
    progress = payload["progress"]
    assert {key: progress[key] for key in ("step", "epoch", "batch_in_epoch")} == {
        "step": 6,
        "epoch": 1,
        "batch_in_epoch": 0,
    }
    assert progress["train_time_s"] > 0
    assert TrainConfig.from_dict(payload["config"]) == config
    assert torch.equal(payload["model"]["0.cores.1"], trainer.module[0].cores[1].detach())
    assert payload["objective"]["rank_adaptation"]["stage"] == "early"


def test_interrupted_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = tmp_path / "step-00000001.pt"
    save_checkpoint({"format": "comera-train-checkpoint", "value": torch.arange(3)}, path)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint({"format": "comera-train-checkpoint", "value": torch.zeros(3)}, path)
    assert list(tmp_path.iterdir()) == [path], "temporary file left behind"
    assert torch.equal(load_checkpoint(path)["value"], torch.arange(3))


def test_corrupt_or_foreign_files_are_refused(tmp_path):
    torn = tmp_path / "torn.pt"
    save_checkpoint({"format": "comera-train-checkpoint", "x": torch.ones(100)}, torn)
    torn.write_bytes(torn.read_bytes()[:50])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_checkpoint(torn)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(ValueError, match="not a comera training checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def test_bytes_damaged_inside_a_tensor_record_are_refused_not_loaded_as_values(tmp_path):
    """``torch.load`` does not check the archive's CRC-32s: a checkpoint whose tensor bytes were overwritten
    in place (same size, readable structure) is refused by name, never loaded as other values."""
    path = tmp_path / "step-00000001.pt"
    values = torch.arange(4096, dtype=torch.float32)
    save_checkpoint({"format": "comera-train-checkpoint", "x": values}, path)
    data = bytearray(path.read_bytes())
    start = bytes(data).index(values[1000:1002].numpy().tobytes())
    data[start : start + 64] = b"\xab" * 64
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["x"][1000] != 1000.0  # torch itself reads the damage
    message = r"step-00000001.pt: not a readable checkpoint.*fails the CRC-32 check"
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    save_checkpoint({"format": "comera-train-checkpoint", "rng": capture_rng()}, tmp_path / "rng.pt")
    expected = (torch.rand(4), random.random(), np.random.rand(2))
    restore_rng(load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (torch.rand(4), random.random(), np.random.rand(2))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and (got[2] == expected[2]).all()


def _save_shards(folder, values=None):
    """One process's ``torch.distributed.checkpoint`` shards of a small state into ``folder``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(4096.0) if values is None else values, "b": torch.ones(7)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process", as intended
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


@pytest.mark.parametrize(
    "damage", ["no index", "cut short", "bytes changed in a record", "a record shifted (shards swapped)"]
)
def test_a_sharded_folder_with_damaged_shards_is_unreadable_before_anything_loads(tmp_path, damage):
    """DCP checks neither its index nor its records: a folder whose ``.metadata`` is gone, whose shard is
    cut short or whose tensor bytes changed is refused by ``load_checkpoint`` (so a resume skips it, as it
    skips a damaged file), naming the damage."""
    folder = checkpoint_path(tmp_path, 8, sharded=True)
    folder.mkdir()
    save_checkpoint({"format": "comera-train-checkpoint"}, folder / "trainer.pt")
    _save_shards(folder)
    assert load_checkpoint(folder)["shards"] == str(folder)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "no index":
        (folder / ".metadata").unlink()
        expected = "its index .metadata cannot be read"
    elif damage == "cut short":
        shard.write_bytes(bytes(data[: len(data) // 2]))
        expected = "__0_0.distcp is cut short"
    elif damage == "bytes changed in a record":
        start = bytes(data).index(torch.arange(4096.0)[1000:1002].numpy().tobytes())
        data[start : start + 16] = b"\xab" * 16
        shard.write_bytes(bytes(data))
        expected = "__0_0.distcp: the record of model.w fails the CRC-32 check"
    else:  # the record's bytes moved by 700 (zipfile then seeks before its start: a ValueError)
        from torch.distributed.checkpoint import FileSystemReader

        where = next(
            where
            for key, where in FileSystemReader(str(folder)).read_metadata().storage_data.items()
            if key.fqn == "model.w"
        )
        record = bytes(data[where.offset : where.offset + where.length])
        data[where.offset : where.offset + where.length] = record[700:] + b"\0" * 700
        shard.write_bytes(bytes(data))
        expected = r"__0_0.distcp: the record of model.w is not a readable archive \(negative seek value"
    with pytest.raises(ValueError, match=f"step-00000008.dcp: not a readable checkpoint.*{expected}"):
        load_checkpoint(folder)


def test_sharded_folders_are_listed_read_and_removed_beside_files(tmp_path):
    payload = {"format": "comera-train-checkpoint", "value": torch.arange(3)}
    save_checkpoint(payload, checkpoint_path(tmp_path, 4))
    folder = checkpoint_path(tmp_path, 8, sharded=True)
    folder.mkdir()
    save_checkpoint(payload, folder / "trainer.pt")
    _save_shards(folder)
    incomplete = checkpoint_path(tmp_path, 12, sharded=True)
    incomplete.mkdir()  # a folder without its trainer state: listed, but not readable
    staging = tmp_path / f".{checkpoint_path(tmp_path, 16, sharded=True).name}.{'ab' * 16}.tmp"
    staging.mkdir()
    (tmp_path / "step-00000020.dcp").write_bytes(b"a file with a folder's name")
    assert list_checkpoints(tmp_path) == [(4, tmp_path / "step-00000004.pt"), (8, folder), (12, incomplete)]
    loaded = load_checkpoint(folder)
    assert loaded["shards"] == str(folder) and torch.equal(loaded["value"], torch.arange(3))
    assert "shards" not in load_checkpoint(checkpoint_path(tmp_path, 4))
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        load_checkpoint(incomplete)
    assert remove_stale_temporaries(tmp_path) == [staging]
    remove_checkpoint(folder)
    remove_checkpoint(checkpoint_path(tmp_path, 4))
    remove_checkpoint(checkpoint_path(tmp_path, 4))  # gone already: nothing happens
    assert list_checkpoints(tmp_path) == [(12, incomplete)]
