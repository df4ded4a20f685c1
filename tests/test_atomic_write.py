"""atomic_write: the temporary file lives in the target folder (same filesystem for ``os.replace``), is
synced before the rename, the folder after it, and nothing is left behind or half-written on failure.

The write callback looks at the folder while the write is in progress; ``os.replace`` and ``os.fsync`` are
observed with spies that call through to the real functions.
"""

import os
import stat
from pathlib import Path

import pytest

from comera.atomic import atomic_write, atomic_write_bytes


def _entries(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def test_temporary_file_is_created_in_the_target_folder(tmp_path, monkeypatch):
    target = tmp_path / "run" / "weights.bin"
    target.parent.mkdir()
    (target.parent / "neighbour.txt").write_text("untouched")
    renames = []
    real_replace = os.replace

    def spy_replace(source, destination):
        renames.append((Path(source), Path(destination)))
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", spy_replace)
    seen = {}

    def write(file):
        file.write(b"payload")
        new = _entries(target.parent) - {"neighbour.txt"}
        assert len(new) == 1, new
        (name,) = new
        seen["name"] = name
        # the entry in the target folder is the very file being written
        assert os.stat(target.parent / name).st_ino == os.fstat(file.fileno()).st_ino

    assert atomic_write(target, write) == target
    name = seen["name"]
    assert name.startswith(".weights.bin.") and name.endswith(".tmp")
    assert renames == [(target.parent / name, target)]
    assert os.stat(renames[0][0].parent).st_dev == os.stat(target.parent).st_dev
    assert target.read_bytes() == b"payload"
    assert _entries(target.parent) == {"weights.bin", "neighbour.txt"}


def test_file_is_synced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(handle):
        info = os.fstat(handle)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
        events.append((kind, info.st_ino))
        return real_fsync(handle)

    def spy_replace(source, destination):
        events.append(("replace", os.stat(source).st_ino))
        return real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    atomic_write_bytes(target, b"{}")
    written = os.stat(target).st_ino
    assert events == [("file", written), ("replace", written), ("folder", os.stat(tmp_path).st_ino)]


def test_missing_parent_folders_are_created_and_an_existing_file_is_replaced(tmp_path):
    target = tmp_path / "a" / "b" / "c.bin"
    assert atomic_write_bytes(str(target), b"first") == target
    assert target.read_bytes() == b"first"
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert _entries(target.parent) == {"c.bin"}


def test_a_reader_sees_the_old_file_until_the_rename(tmp_path):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")

    def write(file):
        file.write(b"new")
        file.flush()
        assert target.read_bytes() == b"old"

    atomic_write(target, write)
    assert target.read_bytes() == b"new"


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, error):
    target = tmp_path / "model.bin"
    target.write_bytes(b"old")

    def write(file):
        file.write(b"partial")
        raise error

    with pytest.raises(type(error)):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert _entries(tmp_path) == {"model.bin"}


def test_a_failed_rename_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "model.bin"

    def failing_replace(source, destination):
        raise OSError("cross-device link")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="cross-device"):
        atomic_write_bytes(target, b"data")
    assert _entries(tmp_path) == set()


def test_an_interrupt_right_after_the_rename_propagates_as_itself(tmp_path, monkeypatch):
    target = tmp_path / "model.bin"
    real_replace = os.replace

    def replace_then_interrupt(source, destination):
        real_replace(source, destination)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):  # not a FileNotFoundError from cleaning up the renamed file
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert _entries(tmp_path) == {"model.bin"}
