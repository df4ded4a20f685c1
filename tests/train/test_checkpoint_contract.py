"""Checkpoint helpers: listing order of files and sharded folders, loading onto the CPU with weights_only and
the format version check, removal racing another process, the unreadable-checkpoint error, and RNG states
(numpy keys as int64, CUDA states captured and restored) through a checkpoint file."""

import fractions
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.serialization

from comera.train.checkpoint import (
    CHECKPOINT_FORMAT,
    NoReadableCheckpointError,
    capture_rng,
    foreign_entry,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_checkpoint,
    restore_rng,
    save_checkpoint,
)


def payload(**extra) -> dict:
    """A minimal checkpoint payload."""
    return {"format": CHECKPOINT_FORMAT, "format_version": 1, **extra}


def test_list_checkpoints_orders_by_step_with_the_folder_after_the_file_of_the_same_step(tmp_path):
    """list_checkpoints: files and .dcp folders by step; for one step the file first, then the folder; names
    of the wrong kind or shape are skipped; latest_checkpoint is the last one."""
    for name in ["step-00000003.dcp", "step-00000002.dcp", "step-00000004.pt"]:
        (tmp_path / name).mkdir()
    for name in ["step-00000003.pt", "step-00000010.pt", "step-00000005.dcp", "step-1.pt", "notes.txt"]:
        (tmp_path / name).write_bytes(b"")
    expected = [
        (2, tmp_path / "step-00000002.dcp"),
        (3, tmp_path / "step-00000003.pt"),
        (3, tmp_path / "step-00000003.dcp"),
        (10, tmp_path / "step-00000010.pt"),
    ]
    assert list_checkpoints(tmp_path) == expected
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010.pt"
    (tmp_path / "step-00000010.pt").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000003.dcp"


def test_latest_checkpoint_of_an_empty_or_missing_folder_is_none(tmp_path):
    """latest_checkpoint: None when the folder holds no checkpoint or does not exist."""
    (tmp_path / "other.pt").write_bytes(b"")
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


def test_load_checkpoint_maps_tensors_saved_on_a_gpu_onto_the_cpu(tmp_path, monkeypatch):
    """load_checkpoint: tensors whose file says cuda:0 are read onto the CPU (a GPU run resumed on a CPU)."""
    path = tmp_path / "step-00000001.pt"
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save_checkpoint(payload(model={"w": torch.arange(4.0)}), path)
    loaded = load_checkpoint(path)
    assert loaded["model"]["w"].device == torch.device("cpu")
    assert torch.equal(loaded["model"]["w"], torch.arange(4.0))


def test_load_checkpoint_refuses_pickled_objects_even_when_the_environment_relaxes_torch_load(
    tmp_path, monkeypatch
):
    """load_checkpoint always reads with weights_only=True: a pickled object makes the file unreadable,
    also with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set (which only changes torch.load's default)."""
    path = tmp_path / "step-00000001.pt"
    save_checkpoint(payload(extra=fractions.Fraction(1, 3)), path)
    message = rf"^{re.escape(str(path))}: not a readable checkpoint, truncated or corrupt \("
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_load_checkpoint_refuses_a_newer_format_version_naming_key_and_versions(tmp_path):
    """load_checkpoint: format_version above CHECKPOINT_VERSION is a ValueError naming the file, the key, the
    value and the highest version read; a missing version or version 1 is read."""
    path = tmp_path / "step-00000001.pt"
    save_checkpoint({**payload(), "format_version": 2}, path)
    message = f"{path}: key 'format_version' is 2; this comera reads versions up to 1"
    with pytest.raises(ValueError, match=rf"^{re.escape(message)}$"):
        load_checkpoint(path)
    save_checkpoint({"format": CHECKPOINT_FORMAT, "step": 3}, path)
    assert load_checkpoint(path) == {"format": CHECKPOINT_FORMAT, "step": 3}


def test_load_checkpoint_refuses_a_checkpoint_of_an_earlier_comera_saying_what_to_do(tmp_path):
    """A checkpoint with the objective's state under the old top-level key ``rank_adaptation`` is refused
    in one line naming the file and the way on (a fresh start), not read under the old key."""
    path = tmp_path / "step-00000001.pt"
    save_checkpoint(payload(rank_adaptation={"stage": "early"}), path)
    message = f"{path}: a checkpoint of an earlier comera"
    with pytest.raises(ValueError, match=rf"^{re.escape(message)}.*start the run again \(--restart\)$"):
        load_checkpoint(path)


def test_remove_checkpoint_of_a_folder_removed_meanwhile_by_another_process_is_silent(tmp_path, monkeypatch):
    """remove_checkpoint: nothing if the folder is gone, also when it goes between the check and the
    removal (another process removing the same checkpoint)."""
    folder = tmp_path / "step-00000001.dcp"
    folder.mkdir()
    (folder / "trainer.pt").write_bytes(b"x")
    real = Path.is_symlink

    def removed_meanwhile(self):
        if self == folder and folder.exists():
            shutil.rmtree(folder)
        return real(self)

    monkeypatch.setattr(Path, "is_symlink", removed_meanwhile)
    remove_checkpoint(folder)
    assert list(tmp_path.iterdir()) == []


def test_no_readable_checkpoint_error_keeps_folder_and_count_and_says_how_to_start_fresh(tmp_path):
    """NoReadableCheckpointError: a ValueError with .directory (a Path), .count, naming both and the fix."""
    error = NoReadableCheckpointError(str(tmp_path), 3)
    assert isinstance(error, ValueError)
    assert error.directory == tmp_path and isinstance(error.directory, Path)
    assert error.count == 3
    expected = (
        f"no readable checkpoint in {tmp_path}: all 3 are truncated or corrupt; start fresh with resume=False"
    )
    assert str(error) == expected


def draws() -> tuple:
    """One draw from each generator."""
    return torch.rand(3), random.random(), np.random.rand(2).tolist()


def test_rng_states_round_trip_through_a_checkpoint_with_numpy_keys_as_int64(tmp_path):
    """capture_rng/restore_rng through a saved checkpoint: the same draws again; numpy's 624 keys are stored
    as an int64 tensor equal to numpy's state (the file format)."""
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    draws()
    state = capture_rng()
    keys = np.random.get_state()[1]
    assert state["numpy"]["keys"].dtype == torch.int64
    assert state["numpy"]["keys"].tolist() == keys.astype(np.int64).tolist()
    path = save_checkpoint(payload(rng=state), tmp_path / "step-00000001.pt")
    expected = draws()
    draws()
    restore_rng(load_checkpoint(path)["rng"])
    again = draws()
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]


class FakeCuda:
    """Stands in for two CUDA devices' generators: what is read and what is set."""

    def __init__(self) -> None:
        self.states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
        self.set_calls: list = []

    def install(self, monkeypatch, available: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [state.clone() for state in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.set_calls.append)


def test_cuda_rng_states_are_captured_and_restored_on_a_gpu(monkeypatch):
    """With CUDA available: capture_rng keeps every device's state under "cuda" and restore_rng sets them;
    a state captured without CUDA restores without touching the devices."""
    cuda = FakeCuda()
    cuda.install(monkeypatch, available=True)
    state = capture_rng()
    assert [value.tolist() for value in state["cuda"]] == [[1, 2], [3, 4]]
    restore_rng(state)
    assert len(cuda.set_calls) == 1
    assert [value.tolist() for value in cuda.set_calls[0]] == [[1, 2], [3, 4]]
    without = {key: value for key, value in state.items() if key != "cuda"}
    restore_rng(without)
    assert len(cuda.set_calls) == 1


def test_cuda_rng_states_are_skipped_on_a_machine_without_cuda(monkeypatch):
    """Without CUDA: capture_rng has no "cuda" entry, and a GPU run's state restores without setting one."""
    cuda = FakeCuda()
    cuda.install(monkeypatch, available=False)
    state = capture_rng()
    assert "cuda" not in state
    restore_rng({**state, "cuda": [torch.tensor([9], dtype=torch.uint8)]})
    assert cuda.set_calls == []


def test_foreign_entry_allows_only_what_pruning_changes():
    """Entries of pruned layers may lose bond size (first/last dimension, a gate's length) or be absent;
    anything else that differs, or an entry the model lacks, is named."""
    own = {"a.cores.0": torch.zeros(1, 4, 3), "a.gates.0": torch.zeros(3), "head.weight": torch.zeros(2, 5)}
    structure = {"a": {"removed": False, "ranks": [2]}}
    pruned = {
        "a.cores.0": torch.zeros(1, 4, 2),
        "a.gates.0": torch.zeros(2),
        "head.weight": torch.zeros(2, 5),
    }
    assert foreign_entry(pruned, own, structure) is None
    assert foreign_entry({"head.weight": torch.zeros(2, 5)}, own, structure) == (
        "it lacks this model's entry 'a.cores.0'"
    )
    removed = {"a": {"removed": True, "ranks": []}}
    assert foreign_entry({"head.weight": torch.zeros(2, 5)}, own, removed) is None, "a removed layer's go"
    assert foreign_entry({**pruned, "a.cores.0": torch.zeros(1, 5, 2)}, own, structure) == (
        "its entry 'a.cores.0' has shape [1, 5, 2], this model's [1, 4, 3]"
    )
    assert foreign_entry({**pruned, "a.cores.0": torch.zeros(1, 4, 4)}, own, structure) is not None
    assert foreign_entry(pruned, own, {}) is not None, "without the layer in the structure nothing may shrink"
    assert foreign_entry({**pruned, "head.weight": torch.zeros(3, 5)}, own, structure) == (
        "its entry 'head.weight' has shape [3, 5], this model's [2, 5]"
    )
    assert (
        foreign_entry({"head.bias": torch.zeros(2)}, own, structure)
        == "its entry 'head.bias' is not in this model"
    )
    tied = {**own, "out.cores.0": own["a.cores.0"]}  # a head sharing the layer's core: one object, two names
    assert foreign_entry({**pruned, "out.cores.0": torch.zeros(1, 4, 2)}, tied, structure) is None
    untied = {**own, "out.cores.0": torch.zeros(1, 4, 3)}
    assert foreign_entry({**pruned, "out.cores.0": torch.zeros(1, 4, 2)}, untied, structure) is not None
    assert foreign_entry(
        {**pruned, "head.weight": torch.zeros(2, 5, dtype=torch.float16)}, own, structure
    ) == ("its entry 'head.weight' is torch.float16, this model's torch.float32")
    assert foreign_entry({**pruned, "head.weight": [[0.0] * 5] * 2}, own, structure) == (
        "its entry 'head.weight' is not a tensor (list)"
    )


def test_an_empty_checkpoint_file_is_named_as_such(tmp_path):
    """A zero-byte file (a write that never began) says so, not an empty pair of parentheses."""
    path = tmp_path / "step-00000001.pt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"truncated or corrupt \(an empty file\)$"):
        load_checkpoint(path)
